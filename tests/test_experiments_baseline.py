"""00_baseline's pure pieces: the perceived-latency fit and the binding table."""
from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from lab_utils.experiments import baseline


def test_perceived_latency_fit_recovers_a_hand_made_line():
    # E2E = 100 ms + 20 ms x n exactly, TTFT 100, TPOT 20: the article's formula
    # predicts 100 + n x 20, so every residual is 0 and R^2 is 1.
    n = [8, 16, 32, 64]
    frame = pd.DataFrame({"output_tokens": n, "e2e_ms": [100 + 20 * k for k in n],
                          "ttft_ms": [100.0] * 4, "tpot_ms": [20.0] * 4})
    fit = baseline.perceived_latency_fit(frame)
    assert fit["fit_intercept_ms"] == pytest.approx(100) and fit["r2"] == pytest.approx(1)
    assert fit["fit_slope_ms_per_token"] == pytest.approx(20)
    assert fit["article_residual_pct_max_abs"] == pytest.approx(0, abs=1e-9)


def test_engine_binding_reads_what_vllm_applied(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "(EngineCore pid=1) INFO 12-01 09:44:27 [ompmultiprocessing.py:185] OpenMP thread "
        "binding info: \n"
        "(EngineCore pid=1) INFO 12-01 09:44:27 [ompmultiprocessing.py:185] \t"
        "VLLM_CPU_OMP_THREADS_BIND='0-1', auto_setup=False, skip_setup=False\n"
        "(EngineCore pid=1) INFO 12-01 09:44:27 [ompmultiprocessing.py:185] \t"
        "local_world_size=1, reserve_cpu_num=0\n"
        "(EngineCore pid=1) INFO 12-01 09:44:27 [ompmultiprocessing.py:185] \t"
        "local_rank=0, core ids=[0, 1]\n"
        "(EngineCore pid=1) INFO 12-01 09:44:27 [ompmultiprocessing.py:185] \treserved_cpus=[]\n")
    server = SimpleNamespace(log_path=log, env={"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                                "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"})
    table = baseline.engine_binding(SimpleNamespace(server=server, base_url="http://x"))["value"]
    assert table["worker core ids (vLLM)"] == "[[0, 1]]"
    assert table["reserved for the engine core (vLLM)"] == "[]"
    assert table["lab's setting (profile [cpu_binding] + [env])"] == "bind=0-1 +tcmalloc"
    assert table["engine core's process"].startswith("spawned")
    server.env["LAB_FORK_ENGINE_CORE"] = "1"
    table = baseline.engine_binding(SimpleNamespace(server=server, base_url="http://x"))["value"]
    assert table["engine core's process"].startswith("forked from the API server")
    assert table["lab's setting (profile [cpu_binding] + [env])"] == \
        "bind=0-1 +tcmalloc +forked-core"
    remote = baseline.engine_binding(SimpleNamespace(server=None, base_url="http://h:8000"))
    assert "remote server at http://h:8000" in remote["value"]["engine"]


def test_findings_compare_the_extremes_by_hand():
    ttft = pd.DataFrame({"prompt_len": [128, 128, 128, 2048, 2048, 2048],
                         "ttft_ms": [10.0, 30.0, 20.0, 300.0, 100.0, 200.0],
                         "prefix_cache_hits": [0] * 6})
    tpot = pd.DataFrame({"concurrency": [1, 1, 4, 4], "tpot_ms": [20.0, 22.0, 40.0, 50.0]})
    fit = {"article_residual_pct_median": 3.5, "fit_intercept_ms": 12.0,
           "fit_slope_ms_per_token": 21.0, "r2": 0.99}
    prefill, batching, perceived = baseline.findings(ttft, tpot, fit)
    assert (prefill["baseline"], prefill["treated"]) == (20.0, 200.0)
    assert prefill["metric"] == "TTFT median (ms), 128 -> 2048 prompt tokens"
    assert "delta = 0 " in prefill["mechanism"]
    assert (batching["baseline"], batching["treated"]) == (21.0, 45.0)
    assert (perceived["baseline"], perceived["treated"]) == (0.0, 3.5)
    assert "12 ms + 21.0 ms x n" in perceived["mechanism"]


def test_the_profiled_arm_is_planned_on_a_local_cpu_engine_only(cpu, gpu, monkeypatch, tmp_path):
    from lab_utils.arms import knobs_between
    from lab_utils.profiles import load_profile
    from lab_utils.step_profile import PROFILER_FLAG
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    arms = baseline.plan(cpu, {"profile_tokens": 64}).arms
    assert [a.name for a in arms] == ["baseline", "profiled"]
    # one knob against the baseline: the profiler, writing into the lab's cache
    assert knobs_between(arms[0], arms[1]) == {PROFILER_FLAG}
    cfg = arms[1].flags[PROFILER_FLAG]
    assert cfg["torch_profiler_dir"] == str(tmp_path / "step_profiles" / "00_baseline")
    assert [a.name for a in baseline.plan(cpu, {"profile_tokens": 0}).arms] == ["baseline"]
    remote = load_profile("remote", base_url="http://127.0.0.1:9")
    for target, why in ((gpu, "GPU"), (remote, "remote")):
        assert [a.name for a in baseline.plan(target, {"profile_tokens": 64}).arms] == ["baseline"]
        ctx = SimpleNamespace(plan=baseline.plan(target, {"profile_tokens": 64}), profile=target)
        table, split = baseline.decode_step_split(ctx, 64)
        assert table is None and why in split["why"]


def test_calls_per_forward_divides_the_profiles_counts_by_the_forward_passes():
    # 2 requests of 4 answer tokens: 8 forward passes of a 30-layer model, norms in C
    split = {"requests": 2, "tokens": 4, "layers": 30, "gemm_calls": 968,
             "norm_calls": 488, "activation_calls": 240}
    table = baseline.calls_per_forward(split)
    assert table["counted per pass"].tolist() == [121, 61, 30]
    assert table["the layers call for"].tolist() == [121, 61, 30]
    # norms and activations as PyTorch ops: none counted
    table = baseline.calls_per_forward({**split, "norm_calls": 0, "activation_calls": 0})
    assert table["counted per pass"].tolist() == [121, 0, 0]
    assert baseline.calls_per_forward({"why": "a remote server"}) is None
