"""Profiles -> the exact `vllm serve` command lines, and flag validation."""
import dataclasses
import json
import shlex

import pytest

from lab_utils import profiles
from lab_utils.profiles import (
    ConfigError,
    available_profiles,
    check_device_rules,
    check_known_options,
    display_command,
    engine_argv,
    flag_items,
    flags_to_args,
    known_options,
    load_profile,
)

PREFIX = ["python", "-m", "lab_utils.vllm_cli", "serve"]
CPU_BASE = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
            "--enable-prompt-tokens-details"]
GPU_BASE = ["--dtype", "auto", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9",
            "--max-model-len", "16384", "--enable-prompt-tokens-details"]


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

def test_available_profiles():
    assert available_profiles() == ["cpu", "gpu", "remote"]


def test_cpu_profile_fields(cpu):
    assert (cpu.kind, cpu.device, cpu.model) == ("local", "cpu", "embedded")
    assert cpu.served_model_name == "smollm2-135m"
    assert not cpu.is_remote
    assert dict(cpu.env) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert dict(cpu.engine) == {"dtype": "float32", "enforce_eager": True, "max_model_len": 4096,
                                "enable_prompt_tokens_details": True}


def test_gpu_profile_models(gpu):
    assert gpu.device == "cuda"
    assert gpu.model_for() == "Qwen/Qwen2.5-7B-Instruct"
    assert gpu.model_for("draft") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert gpu.model_for("awq") == "Qwen/Qwen2.5-7B-Instruct-AWQ"
    with pytest.raises(ConfigError, match="no model for role 'nope'"):
        gpu.model_for("nope")


def test_unknown_profile_names_the_choices():
    with pytest.raises(ConfigError) as err:
        load_profile("gpux")
    msg = str(err.value)
    assert "unknown profile 'gpux'" in msg
    assert "['cpu', 'gpu', 'remote']" in msg
    assert "Did you mean 'gpu'?" in msg


@pytest.mark.parametrize("name", ["", None, 3])
def test_profile_name_must_be_a_string(name):
    with pytest.raises(ConfigError, match="choose one of"):
        load_profile(name)


def _toml(tmp_path, model: str, models: str = "") -> str:
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\nkind = "local"\ndevice = "cpu"\ndescription = "d"\n'
                    f'model = "{model}"\nserved_model_name = "x"\nstartup_timeout_s = 5\n'
                    '[engine]\nmax_model_len = 1024\n[env]\nN = 3\n'
                    f'[models]\n{models}')
    return str(path)


def test_profile_from_toml_path(tmp_path):
    model_dir = tmp_path / "models" / "x"
    model_dir.mkdir(parents=True)
    p = load_profile(_toml(tmp_path, str(model_dir)), enforce_eager=True)
    assert p.name == "mine" and p.model_for() == str(model_dir)
    assert dict(p.engine) == {"max_model_len": 1024, "enforce_eager": True}
    assert dict(p.env) == {"N": "3"}           # env values become strings
    assert dict(p.models) == {}


def test_model_paths_are_checked(tmp_path, monkeypatch):
    p = load_profile(_toml(tmp_path, "/nonexistent/model",
                           'draft = "./no/such/draft"\nhub = "org/name"\nhome = "~/m"\n'))
    with pytest.raises(ConfigError, match="model path '/nonexistent/model' does not exist"):
        p.model_for()
    with pytest.raises(ConfigError, match="'./no/such/draft' does not exist"):
        p.model_for("draft")
    assert p.model_for("hub") == "org/name"       # hub ids are not paths
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    assert p.model_for("home") == str(tmp_path / "m")


def test_profile_toml_errors(tmp_path):
    bad_key = tmp_path / "a.toml"
    bad_key.write_text('name = "a"\nkind = "local"\ndevice = "cpu"\ncolour = "red"\n')
    with pytest.raises(ConfigError, match=r"unknown keys \['colour'\]"):
        load_profile(str(bad_key))
    bad_kind = tmp_path / "b.toml"
    bad_kind.write_text('name = "b"\nkind = "cloud"\ndevice = "cpu"\n')
    with pytest.raises(ConfigError, match="kind must be 'local' or 'remote'"):
        load_profile(str(bad_kind))
    missing = tmp_path / "c.toml"
    missing.write_text('name = "c"\nkind = "local"\n')
    with pytest.raises(ConfigError):
        load_profile(str(missing))


@pytest.mark.parametrize("key", ["fork_engine_core", "stack_room", "c_kernels", "huge_pages"])
@pytest.mark.parametrize("value", ['"yes"', "1"])
def test_cpu_binding_switches_are_true_or_false(tmp_path, key, value):
    # TOML's 1 is not true: an integer is refused as a string is (1 == True in Python)
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nkind = "local"\ndevice = "cpu"\nmodel = "embedded"\n'
                   f'[cpu_binding]\n{key} = {value}\n')
    with pytest.raises(ConfigError, match=f"{key} = .*allowed: true or false"):
        load_profile(str(bad))


def test_huge_pages_and_tcmalloc_are_refused_together(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nkind = "local"\ndevice = "cpu"\nmodel = "embedded"\n'
                   '[cpu_binding]\nhuge_pages = true\ntcmalloc = true\n')
    with pytest.raises(ConfigError, match="set tcmalloc = false"):
        load_profile(str(bad))


def test_remote_profile_needs_base_url(monkeypatch):
    monkeypatch.delenv("LAB_REMOTE_URL", raising=False)
    with pytest.raises(ConfigError, match="base_url"):
        load_profile("remote")
    with pytest.raises(ConfigError, match="LAB_REMOTE_URL"):
        load_profile("remote", base_url="myhost:8000")   # no scheme


def test_remote_profile(monkeypatch):
    monkeypatch.delenv("LAB_REMOTE_URL", raising=False)
    monkeypatch.setenv("LAB_REMOTE_API_KEY", "sekret")
    p = load_profile("remote", base_url="http://10.0.0.5:8000/")
    assert p.is_remote and p.base_url == "http://10.0.0.5:8000"
    assert p.api_key == "sekret"
    with pytest.raises(ConfigError, match="launches nothing"):
        engine_argv(p, {}, port=8000, model="/m", python="python")
    monkeypatch.setenv("LAB_REMOTE_URL", "https://vllm.example:443")
    assert load_profile("remote").base_url == "https://vllm.example:443"


def test_local_profile_has_no_api_key(cpu):
    assert cpu.api_key is None


# --------------------------------------------------------------------------
# Flags -> argv
# --------------------------------------------------------------------------

def test_flags_to_args_shapes():
    assert flags_to_args({"enable_prefix_caching": False, "max_num_batched_tokens": 512}) == \
        ["--no-enable-prefix-caching", "--max-num-batched-tokens", "512"]
    assert flags_to_args({"enforce_eager": True}) == ["--enforce-eager"]
    assert flags_to_args({"gpu_memory_utilization": 0.9}) == ["--gpu-memory-utilization", "0.9"]
    assert flags_to_args({"kv_cache_dtype": "fp8"}) == ["--kv-cache-dtype", "fp8"]
    assert flags_to_args({"middleware": ["a", "b"]}) == ["--middleware", "a", "b"]
    assert flags_to_args({"cuda_graph_sizes": (1, 2, 4)}) == ["--cuda-graph-sizes", "1", "2", "4"]
    assert flags_to_args({"speculative_config": {"num_speculative_tokens": 4, "method": "ngram"}}) \
        == ["--speculative-config", '{"method":"ngram","num_speculative_tokens":4}']
    assert flags_to_args({}) == []


def test_flag_items_layers_and_none_removes(cpu):
    items = flag_items(cpu, {"enable_prefix_caching": False, "max_model_len": 2048,
                             "enforce_eager": None})
    # overridden keys keep the profile's position; None drops the flag
    assert items == {"dtype": "float32", "max_model_len": 2048,
                     "enable_prompt_tokens_details": True, "enable_prefix_caching": False}
    assert "--enforce-eager" not in flags_to_args(items)


def test_cpu_engine_argv_exact(cpu):
    argv = engine_argv(cpu, {}, port=8123, model="/m", python="python", validate=False)
    assert argv == PREFIX + ["/m", "--host", "127.0.0.1", "--port", "8123",
                             "--served-model-name", "smollm2-135m"] + CPU_BASE


def test_cpu_engine_argv_with_technique_flags(cpu):
    argv = engine_argv(cpu, {"enable_prefix_caching": False, "max_num_batched_tokens": 512,
                             "scheduling_policy": "priority"},
                       port=9000, host="0.0.0.0", model="/m", python="python", validate=False)
    assert argv == PREFIX + ["/m", "--host", "0.0.0.0", "--port", "9000",
                             "--served-model-name", "smollm2-135m"] + CPU_BASE + [
        "--no-enable-prefix-caching", "--max-num-batched-tokens", "512",
        "--scheduling-policy", "priority"]


def test_engine_argv_defaults_to_this_python(cpu):
    import sys
    argv = engine_argv(cpu, {}, port=1, model="/m", validate=False)
    assert argv[0] == sys.executable


def test_gpu_engine_argv_exact(gpu):
    argv = engine_argv(gpu, {}, port=8000, python="python", validate=False)
    assert argv == PREFIX + ["Qwen/Qwen2.5-7B-Instruct", "--host", "127.0.0.1", "--port", "8000",
                             "--served-model-name", "qwen2.5-7b-instruct"] + GPU_BASE


def test_gpu_tensor_parallel_override():
    gpu4 = load_profile("gpu", tensor_parallel_size=4)
    argv = engine_argv(gpu4, {}, port=8000, python="python", validate=False)
    i = argv.index("--tensor-parallel-size")
    assert argv[i + 1] == "4"
    assert argv.count("--tensor-parallel-size") == 1
    # the override replaces the value in place: same flag order as the base profile
    assert argv[-len(GPU_BASE):] == [a if a != "1" else "4" for a in GPU_BASE]


def test_gpu_speculative_config_compact_sorted_json(gpu):
    spec = {"prompt_lookup_max": 4, "method": "ngram", "num_speculative_tokens": 4}
    argv = engine_argv(gpu, {"speculative_config": spec}, port=8000, python="python",
                       validate=False)
    assert argv[-2:] == ["--speculative-config",
                         '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}']
    draft = {"num_speculative_tokens": 5, "model": gpu.model_for("draft")}
    argv = engine_argv(gpu, {"speculative_config": draft}, port=8000, python="python",
                       validate=False)
    assert json.loads(argv[-1]) == draft
    assert argv[-1] == '{"model":"Qwen/Qwen2.5-0.5B-Instruct","num_speculative_tokens":5}'


@pytest.mark.parametrize("role, quantization, model", [
    ("awq", "awq", "Qwen/Qwen2.5-7B-Instruct-AWQ"),
    ("gptq_int4", "gptq", "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"),
    ("fp8", None, "RedHatAI/Qwen2.5-7B-Instruct-FP8-dynamic"),
])
def test_gpu_quantized_variants(gpu, role, quantization, model):
    flags = {"quantization": quantization} if quantization else {}
    argv = engine_argv(gpu, flags, port=8001, model=gpu.model_for(role), python="python",
                       validate=False)
    assert argv[4] == model
    tail = ["--quantization", quantization] if quantization else []
    assert argv[-len(GPU_BASE) - len(tail):] == GPU_BASE + tail


def test_gpu_small_tier_command(gpu):
    # 11_model_tiering's small tier on the gpu profile: same family, own engine.
    argv = engine_argv(gpu, {}, port=8002, model=gpu.model_for("small"), python="python",
                       validate=False)
    assert argv[4] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert argv[-len(GPU_BASE):] == GPU_BASE


def test_gpu_kv_cache_fp8(gpu):
    argv = engine_argv(gpu, {"kv_cache_dtype": "fp8"}, port=8000, python="python",
                       validate=False)
    assert argv[-2:] == ["--kv-cache-dtype", "fp8"]


def test_display_command(cpu):
    argv = engine_argv(cpu, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_max": 3}},
                       port=8123, model="/m", python="/venv/bin/python", validate=False)
    line = display_command(argv, cpu.env)
    assert line.startswith("VLLM_CPU_KVCACHE_SPACE=1 vllm serve /m --host 127.0.0.1 --port 8123 "
                           "--served-model-name smollm2-135m --dtype float32 --enforce-eager ")
    assert line.endswith("""--speculative-config '{"method":"ngram","num_speculative_tokens":2,"""
                         """"prompt_lookup_max":3}'""")
    assert "lab_utils.vllm_cli" not in line and "/venv/bin/python" not in line
    # copy-pasteable: the shell splits it back into the same arguments
    assert shlex.split(line)[1:] == ["vllm"] + argv[argv.index("serve"):]


def test_display_command_without_env_and_quoting(gpu):
    argv = engine_argv(gpu, {}, port=8000, model="/models/my model", python="python",
                       validate=False)
    line = display_command(argv)
    assert line.startswith("vllm serve '/models/my model' --host")
    assert display_command(argv, {"A": "x y"}).startswith("A='x y' vllm serve ")


# --------------------------------------------------------------------------
# Device rules
# --------------------------------------------------------------------------

def _device_error(profile, **flags):
    with pytest.raises(ConfigError) as err:
        check_device_rules(profile, flag_items(profile, flags))
    return str(err.value)


def test_cpu_int8_weight_only_needs_bfloat16(cpu):
    msg = _device_error(cpu, quantization="int8_per_channel_weight_only")
    assert "needs dtype='bfloat16'" in msg and "'float32'" in msg
    # with bfloat16 (and the profile's enforce_eager) it is accepted
    check_device_rules(cpu, flag_items(cpu, {"quantization": "int8_per_channel_weight_only",
                                             "dtype": "bfloat16"}))


def test_cpu_rejects_gpu_memory_utilization(cpu):
    msg = _device_error(cpu, gpu_memory_utilization=0.5)
    assert "VLLM_CPU_KVCACHE_SPACE" in msg


def test_cpu_rejects_tensor_parallel(cpu):
    assert "tensor_parallel_size" in _device_error(cpu, tensor_parallel_size=2)


@pytest.mark.parametrize("kv", ["nvfp4", "fp8_inc", "turboquant_4bit_nc"])
def test_cpu_rejects_gpu_only_kv_formats(cpu, kv):
    assert "GPU-only" in _device_error(cpu, kv_cache_dtype=kv)


def test_cpu_accepts_fp8_kv_cache(cpu):
    check_device_rules(cpu, flag_items(cpu, {"kv_cache_dtype": "fp8"}))


def test_cpu_lists_every_problem(cpu):
    msg = _device_error(cpu, gpu_memory_utilization=0.5, tensor_parallel_size=2)
    assert msg.startswith("profile 'cpu' cannot run these flags:")
    assert msg.count("\n- ") == 2


def test_gpu_allows_what_cpu_rejects(gpu):
    check_device_rules(gpu, flag_items(gpu, {"gpu_memory_utilization": 0.8,
                                             "tensor_parallel_size": 2,
                                             "kv_cache_dtype": "nvfp4", "dtype": "bfloat16"}))


@pytest.mark.parametrize("spec", ['{"method": "ngram"}', {"num_speculative_tokens": 4}, {}, 4])
def test_bad_speculative_config(gpu, spec):
    assert "speculative_config must be a dict" in _device_error(gpu, speculative_config=spec)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"model": "Qwen/Qwen2.5-0.5B-Instruct",
                                   "num_speculative_tokens": 5}])
def test_good_speculative_config(cpu, gpu, spec):
    check_device_rules(gpu, flag_items(gpu, {"speculative_config": spec}))
    check_device_rules(cpu, flag_items(cpu, {"speculative_config": spec}))


def test_engine_argv_validates_before_building(cpu, monkeypatch):
    monkeypatch.setattr(profiles, "known_options", lambda: pytest.fail("device rules come first"))
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        engine_argv(cpu, {"gpu_memory_utilization": 0.5}, port=1, model="/m", python="python")


# --------------------------------------------------------------------------
# Known options
# --------------------------------------------------------------------------

OPTIONS = {
    "max-num-batched-tokens": {"choices": None, "boolean": False},
    "max-num-seqs": {"choices": None, "boolean": False},
    "kv-cache-dtype": {"choices": ["auto", "fp8"], "boolean": False},
    "enable-prefix-caching": {"choices": None, "boolean": True},
    "no-enable-prefix-caching": {"choices": None, "boolean": True},
    "scheduling-policy": {"choices": ["fcfs", "priority"], "boolean": False},
    "disable-log-stats": {"choices": None, "boolean": True},   # store_true: no --no- form
}


def test_check_known_options_accepts_known():
    check_known_options({"max_num_batched_tokens": 512, "kv_cache_dtype": "fp8",
                         "enable_prefix_caching": False, "scheduling_policy": "priority",
                         "disable_log_stats": True}, OPTIONS)


def test_check_known_options_unknown_flag_with_suggestion():
    with pytest.raises(ConfigError) as err:
        check_known_options({"max_num_batch_tokens": 512}, OPTIONS)
    msg = str(err.value)
    assert msg.startswith("invalid engine flags for vLLM ")
    assert "unknown vLLM option 'max_num_batch_tokens'" in msg
    assert "did you mean max_num_batched_tokens" in msg


def test_check_known_options_unknown_flag_without_suggestion():
    with pytest.raises(ConfigError) as err:
        check_known_options({"frobnicate": 1}, OPTIONS)
    assert "unknown vLLM option 'frobnicate'" in str(err.value)
    assert "did you mean" not in str(err.value)


def test_check_known_options_bad_choice():
    with pytest.raises(ConfigError) as err:
        check_known_options({"kv_cache_dtype": "fp4", "scheduling_policy": "lifo"}, OPTIONS)
    msg = str(err.value)
    assert "kv_cache_dtype='fp4' is not one of ['auto', 'fp8']" in msg
    assert "scheduling_policy='lifo' is not one of ['fcfs', 'priority']" in msg


def test_engine_argv_validates_with_known_options(cpu, monkeypatch):
    monkeypatch.setattr(profiles, "known_options", lambda: {
        **OPTIONS, "dtype": {"choices": ["auto", "float32"], "boolean": False},
        "enforce-eager": {"choices": None, "boolean": True},
        "max-model-len": {"choices": None, "boolean": False},
        "enable-prompt-tokens-details": {"choices": None, "boolean": True}})
    argv = engine_argv(cpu, {"max_num_seqs": 4}, port=1, model="/m", python="python")
    assert argv[-2:] == ["--max-num-seqs", "4"]
    with pytest.raises(ConfigError, match="max_num_seq'"):
        engine_argv(cpu, {"max_num_seq": 4}, port=1, model="/m", python="python")


def test_check_known_options_false_needs_a_no_form():
    assert "--no-disable-log-stats" in flags_to_args({"disable_log_stats": False})
    with pytest.raises(ConfigError):
        check_known_options({"disable_log_stats": False}, OPTIONS)


def test_real_known_options_from_installed_vllm(cpu, gpu):
    """Reads the installed vLLM's own `vllm serve` parser (cached per version)."""
    options = known_options()
    for name in ("enable-prefix-caching", "max-num-batched-tokens", "speculative-config",
                 "kv-cache-dtype", "scheduling-policy"):
        assert name in options, name
    assert options["enable-prefix-caching"]["boolean"]
    assert "no-enable-prefix-caching" in options
    assert "fp8" in options["kv-cache-dtype"]["choices"]
    assert set(options["scheduling-policy"]["choices"]) >= {"fcfs", "priority"}
    # the shipped profiles' base flags and the notebooks' common technique flags are all known
    check_known_options(flag_items(cpu, {"enable_prefix_caching": False,
                                         "max_num_batched_tokens": 512,
                                         "scheduling_policy": "priority",
                                         "kv_cache_dtype": "fp8"}), options)
    check_known_options(flag_items(gpu, {"speculative_config": {"method": "ngram"}}), options)


def test_cpu_small_tier_is_the_embedded_models_int8_copy():
    assert load_profile("cpu").models["small"] == "quantized:w8a8"


@pytest.mark.parametrize("ref, fix", [("quantized:nope", "choose one of"),
                                      ("embedded-0L", "positive int"),
                                      ("embedded-99L", "only 30 layers")])
def test_derived_model_refs_fail_with_the_fix(ref, fix, monkeypatch):
    import lab_utils.derived_models as dm
    # The layer check of a 30-layer source, without reading or building a model.
    monkeypatch.setattr(dm, "truncated_model",
                        lambda n, **k: dm.kept_layers(n, 30) and pytest.fail("built"))
    p = dataclasses.replace(load_profile("cpu"), models={"x": ref})
    with pytest.raises(ConfigError, match=fix):
        p.model_for("x")


def test_serving_names_the_device_and_the_served_model():
    from lab_utils import load_profile
    assert load_profile("cpu").serving == "cpu, smollm2-135m"
    assert load_profile("gpu").serving == "cuda, qwen2.5-7b-instruct"
    assert load_profile("remote", base_url="http://127.0.0.1:9").serving == \
        "remote, the server's model"
