"""vLLM bench result-JSON export and the bootstrap interval of a change."""
import json

import numpy as np
import pytest

from lab_utils.client import RequestRecord
from lab_utils.export import export_arm, to_vllm_bench
from lab_utils.metrics import bootstrap_change_pct
from lab_utils.results import Results

# The summary keys `vllm bench serve --save-result` wrote on vLLM 0.32.0.
BENCH_KEYS = {
    "backend", "burstiness", "completed", "date", "duration", "endpoint_type", "failed",
    "label", "max_concurrency", "model_id", "num_prompts", "output_throughput",
    "request_goodput", "request_rate", "request_throughput", "tokenizer_id",
    "total_input_tokens", "total_output_tokens", "total_token_throughput",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p99")
      for m in ("ttft", "tpot", "itl", "e2el")),
}


def records():
    out = []
    for i in range(4):
        ttft = 0.1 * (i + 1)
        out.append(RequestRecord(index=i, tag="t", ok=True, ttft=ttft, e2e=ttft + 0.4,
                                 itl=[0.1] * 4, output_tokens=5, prompt_tokens=10,
                                 chunk_times=[ttft + 0.1 * k for k in range(5)],
                                 chunk_tokens=[1, 2, 3, 4, 5], text="abc"))
    return out


def test_export_has_vllm_bench_keys_and_values():
    doc = to_vllm_bench(records(), 2.0, model_id="m")
    assert BENCH_KEYS <= set(doc)
    assert doc["median_ttft_ms"] == pytest.approx(250.0)
    assert doc["median_tpot_ms"] == pytest.approx(100.0)
    assert doc["median_itl_ms"] == pytest.approx(100.0)
    assert doc["total_output_tokens"] == 20 and doc["completed"] == 4
    assert doc["ttfts"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    json.dumps(doc)  # serialisable


def test_export_arm_reads_the_records(tmp_path):
    res = Results("nb", tmp_path, "cpu")
    path = res.records_path("arm one")
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records()))

    class FakeRun:
        load, counters, duration_s = "sequential", None, 2.0
        def summary(self, slo=None):
            from lab_utils.metrics import summarize
            return summarize(records(), 2.0, slo)
    res.add_arm("arm one", FakeRun())
    out = export_arm(res.path, "arm one", tmp_path / "bench.json")
    doc = json.loads(out.read_text())
    assert doc["completed"] == 4 and doc["label"] == "nb:arm one"
    with pytest.raises(KeyError, match="arms"):
        export_arm(res.path, "missing", tmp_path / "x.json")


def test_bootstrap_interval_separates_a_real_effect_from_noise():
    rng = np.random.default_rng(0)
    lo, hi = bootstrap_change_pct(rng.normal(100, 10, 30), rng.normal(50, 5, 30))
    assert -60 < lo < hi < -40
    lo, hi = bootstrap_change_pct(rng.normal(100, 10, 30), rng.normal(100, 10, 30))
    assert lo < 0 < hi
    assert all(np.isnan(bootstrap_change_pct([1.0], [2.0])))
    with pytest.raises(ValueError, match="stat"):
        bootstrap_change_pct([1, 2, 3], [1, 2, 3], stat="mode")


def test_finding_with_samples_records_interval(tmp_path):
    res = Results("nb", tmp_path, "cpu")
    f = res.add_finding("t", "m", 100.0, 50.0, "claim", "mech",
                        samples=([100, 101, 99, 100], [50, 51, 49, 50]), checklist="prefix caching:ttft")
    assert f["significant"] is True and f["checklist"] == "prefix caching:ttft"
    assert f["change_ci95"][1] < 0
