"""Thread binding environments, their profile form, and the decode floor."""
from __future__ import annotations

import dataclasses
import os
import warnings

import pytest

from lab_utils import cpu_tuning
from lab_utils.facts import model_facts
from lab_utils.profiles import ConfigError, load_profile


def test_all_cores_is_what_vllm_parses_back_as_this_process_cpus():
    # vLLM's own parser of VLLM_CPU_OMP_THREADS_BIND (cpu_resource_utils).
    from vllm.utils.cpu_resource_utils import parse_id_list
    assert parse_id_list(cpu_tuning.all_cores()) == sorted(os.sched_getaffinity(0))


def test_binding_env():
    assert cpu_tuning.binding_env("auto") == {}
    env = cpu_tuning.binding_env("all")
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "LD_PRELOAD" not in env
    assert cpu_tuning.binding_env("0")["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert cpu_tuning.describe_env({"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                    "LD_PRELOAD": "/x/libtcmalloc_minimal.so.4"}) == \
        "bind=0-1 +tcmalloc"


@pytest.mark.parametrize("spec", ["0", "7", "0-3", "0,2,5", "0-1,4", "2-3,0"])
def test_cpu_lists_read_as_vllm_reads_them(spec):
    from vllm.utils.cpu_resource_utils import parse_id_list
    assert cpu_tuning.parse_cpu_list(spec) == sorted(parse_id_list(spec))


@pytest.mark.parametrize("spec", ["auto", "nobind", "0|1", "", "0-", "a-b"])
def test_what_is_not_one_cpu_list_is_refused(spec):
    with pytest.raises(ValueError):
        cpu_tuning.parse_cpu_list(spec)


ALL = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_the_worker_moves_into_the_engine_core_only_where_it_has_every_core():
    got = cpu_tuning.in_process_env(ALL, cpus=[0, 1])
    assert got == {**ALL, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2",
                   "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}
    assert cpu_tuning.in_process_env({**ALL, "VLLM_CPU_OMP_THREADS_BIND": "0,1"},
                                     cpus=[0, 1])["OMP_NUM_THREADS"] == "2"
    unchanged = [
        {**ALL, "VLLM_CPU_OMP_THREADS_BIND": "0"},        # a share: engines side by side
        {**ALL, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},      # two ranks
        {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},             # vLLM reserves a core by default
        {**ALL, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        {},                                               # vLLM's automatic binding
        {**ALL, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},   # said explicitly: kept
    ]
    for env in unchanged:
        assert cpu_tuning.in_process_env(env, cpus=[0, 1]) == env, env
    assert cpu_tuning.in_process_env(ALL, cpus=[0, 1, 2, 3]) == ALL  # not every core
    # vLLM's per-step times cover the forward pass only in a worker process of its own
    assert cpu_tuning.in_process_env(
        ALL, cpus=[0, 1], flags={cpu_tuning.STEP_TIMING_FLAG: True}) == ALL
    env = cpu_tuning.binding_env("all", in_process=True)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    assert cpu_tuning.describe_env(env).endswith("+in-process")


@pytest.mark.parametrize("preload", ["", "/usr/lib/libtcmalloc_minimal.so.4",
                                     "/venv/lib/libiomp5.so", "/usr/lib/libgomp.so.1"])
def test_the_in_process_worker_gets_the_openmp_variables_vllm_gives_its_worker(
        monkeypatch, preload):
    # vLLM's own manager, as its mp executor runs it before starting a worker process
    from types import SimpleNamespace

    from vllm.utils.ompmultiprocessing import OMPProcessManager
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cpu_tuning.all_cores())
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.setenv("LD_PRELOAD", preload)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(local_world_size=1, data_parallel_rank_local=None,
                                        _api_process_count=1),
        kv_transfer_config=None)
    before = dict(os.environ)
    with OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0):
        vllms = {k: v for k, v in os.environ.items() if before.get(k) != v}
    ours = cpu_tuning.in_process_env({"VLLM_CPU_OMP_THREADS_BIND": cpu_tuning.all_cores(),
                                      "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                                      "LD_PRELOAD": preload}, cpus=cpus)
    assert vllms and {k: ours.get(k) for k in vllms} == vllms


def test_the_profile_applies_in_process_after_per_engine_overrides(cpu):
    p = dataclasses.replace(cpu, cpu_binding={"bind": "all", "in_process": True})
    assert p.server_env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    share = p.server_env({"VLLM_CPU_OMP_THREADS_BIND": str(min(os.sched_getaffinity(0)))})
    if len(os.sched_getaffinity(0)) > 1:  # one core of several: vLLM's worker process binds it
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in share
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in p.server_env(
        flags={"enable_logging_iteration_details": True})


def test_a_missing_library_names_its_fix(monkeypatch):
    monkeypatch.setattr(cpu_tuning, "tcmalloc_path", lambda: None)
    with pytest.raises(cpu_tuning.LibraryMissing, match="libtcmalloc-minimal4"):
        cpu_tuning.binding_env("auto", tcmalloc=True)
    # In a profile it is optional: left out with a warning, the rest kept.
    monkeypatch.setattr(cpu_tuning, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = cpu_tuning.profile_binding_env({"bind": "all", "tcmalloc": True})
    assert "LD_PRELOAD" not in env and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert any("libtcmalloc-minimal4" in str(w.message) for w in caught)


def test_profile_env_precedence(cpu, monkeypatch):
    monkeypatch.delenv("LAB_CPU_ISA", raising=False)  # `LAB_CPU_ISA=avx2 make test` adds its own
    p = dataclasses.replace(cpu, cpu_binding={"bind": "all"}, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    env = p.server_env({"VLLM_CPU_OMP_THREADS_BIND": "1"})   # a per-engine override wins
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    from lab_utils.compile_cache import cache_env, users_own
    caches = {k: v for k, v in cache_env().items() if not users_own(k)}
    assert dataclasses.replace(cpu, cpu_binding={}).server_env() == {**caches, **cpu.env}


def test_profile_rejects_bad_binding_keys(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('name = "p"\nkind = "local"\ndevice = "cpu"\ndescription = ""\n'
                    'model = "embedded"\nserved_model_name = ""\nstartup_timeout_s = 10\n'
                    '[cpu_binding]\nthreads = 2\n')
    with pytest.raises(ConfigError, match="allowed: bind"):
        load_profile(str(path))
    gpu = tmp_path / "g.toml"
    gpu.write_text(path.read_text().replace('device = "cpu"', 'device = "cuda"')
                   .replace("threads = 2", "bind = 'all'"))
    with pytest.raises(ConfigError, match="device = 'cpu' only"):
        load_profile(str(gpu))
    maybe = tmp_path / "m.toml"
    maybe.write_text(path.read_text().replace("threads = 2", 'in_process = "sometimes"'))
    with pytest.raises(ConfigError, match='"one-core"'):
        load_profile(str(maybe))
    fork = tmp_path / "f.toml"
    fork.write_text(path.read_text().replace("threads = 2", 'fork_engine_core = "yes"'))
    with pytest.raises(ConfigError, match="fork_engine_core = 'yes'; allowed: true or false"):
        load_profile(str(fork))


@pytest.fixture
def one_cpu():
    """This process (and what it starts) on one CPU, as in each stream of
    `make test`; back on its own CPUs afterwards."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(own)})
    yield min(own)
    os.sched_setaffinity(0, own)


def test_one_core_puts_the_worker_in_the_engine_core_only_on_one_cpu(cpu, one_cpu):
    assert cpu.cpu_binding["in_process"] == cpu_tuning.ONE_CORE  # the embedded default
    env = cpu.server_env()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(one_cpu)
    assert env["OMP_NUM_THREADS"] == "1"
    # per-step times need the worker's own process, on one CPU too
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in cpu.server_env(
        flags={"enable_logging_iteration_details": True})
    assert cpu_tuning.wants_in_process("one-core", [3])
    assert not cpu_tuning.wants_in_process("one-core", [0, 1])
    assert cpu_tuning.wants_in_process(True, [0, 1])
    assert not cpu_tuning.wants_in_process(False, [0])


def test_one_core_keeps_the_worker_process_on_several_cpus(cpu):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    env = cpu.server_env()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert cpu_tuning.parse_cpu_list(env["VLLM_CPU_OMP_THREADS_BIND"]) == \
        sorted(os.sched_getaffinity(0))


def test_decode_floor_by_hand():
    # 513 MiB read at 40 GB/s: 537,919,488 B / 40e9 B/s = 13.45 ms.
    assert cpu_tuning.decode_floor_ms(513 * 2**20, 40.0) == pytest.approx(13.448, abs=1e-3)
    with pytest.raises(ValueError):
        cpu_tuning.decode_floor_ms(1, 0)


def test_weight_bytes(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "config.json").write_text("{}")
    assert cpu_tuning.weight_bytes(tmp_path) == 1000
    with pytest.raises(FileNotFoundError):
        cpu_tuning.weight_bytes(tmp_path / "none")


def test_core_shares_give_each_engine_its_own_cores():
    from lab_utils.cpu_tuning import core_shares
    assert core_shares(2, [0, 1]) == ["0", "1"]
    assert core_shares(2, [0, 1, 2, 3, 4]) == ["0,1,2", "3,4"]
    assert core_shares(3, [4, 2, 6]) == ["2", "4", "6"]
    assert core_shares(1, [0, 1]) == ["0,1"]
    with pytest.raises(ValueError, match="their own core"):
        core_shares(3, [0, 1])


def test_a_decode_steps_matrices_are_the_models_weights_but_its_norms():
    # models.toml's num_parameters is the embedded checkpoint's safetensors total
    facts = model_facts("embedded")
    shapes = facts.decode_linear_shapes()
    assert len(shapes) == 4 * 30 + 1
    assert shapes[:4] == [(576 + 2 * 3 * 64, 576), (576, 576), (2 * 1536, 576), (576, 1536)]
    assert shapes[-1] == (49152, 576)  # the LM head, tied to the embeddings
    norms = 30 * 2 * 576 + 576
    assert sum(n * k for n, k in shapes) + norms == facts.num_parameters == 134_515_008


def test_decode_linears_run_through_vllms_gemm():
    got = cpu_tuning.decode_linears_ms([(64, 32), (32, 64)], threads=1, steps=3)
    assert got["bytes"] == 2 * 64 * 32 * 4
    assert 0 < got["ms_min"] <= got["ms_median"] < 1000
    # ATen's linear, timed beside it, computes the same products: float32 sums of 32 and
    # 64 terms in another order differ in their last bits only
    assert 0 < got["aten_ms_min"] <= got["aten_ms_median"] < 1000
    assert got["max_rel_diff"] < 1e-5


def test_measurement_scripts_compute_with_the_engines_kernels(monkeypatch):
    # under LAB_CPU_ISA=avx2 the floor's bandwidth and matrix products are measured as
    # the engines compute: torch's own ISA answer and its kernel level are AVX2's
    from lab_utils.machine import cpu_facts
    if not cpu_facts()["isa"].get("avx2"):
        pytest.skip("this CPU has no AVX2 to emulate an AVX2-only CPU with")
    script = ("import json, torch; print(json.dumps({'avx512': torch.cpu._is_avx512_supported(), "
              "'capability': torch.backends.cpu.get_cpu_capability()}))")
    monkeypatch.setenv("LAB_CPU_ISA", "avx2")
    assert cpu_tuning._run_script(script, timeout=120) == {"avx512": False, "capability": "AVX2"}
    monkeypatch.delenv("LAB_CPU_ISA")
    native = cpu_tuning._run_script(script, timeout=120)
    assert native["capability"] == ("AVX512" if cpu_facts()["isa"].get("avx512f") else "AVX2")
    bf16 = cpu_tuning.decode_linears_ms([(64, 32)], threads=1, steps=3, dtype="bfloat16")
    assert bf16["bytes"] == 64 * 32 * 2
    assert bf16["max_rel_diff"] < 2e-2   # bfloat16 outputs: 8 bits of mantissa
