"""The article's checklist: improvement arithmetic, verdicts, missing rows."""
import json
import math

import pytest

from lab_utils.article_table import ARTICLE_TABLE, checklist_table, improvement_ci, improvement_pct, judge


def test_improvement_reads_the_claims_like_the_article():
    assert improvement_pct("ttft", 1000.0, 600.0) == 40.0          # TTFT cut by 40%
    assert improvement_pct("tpot", 60.0, 30.0) == 100.0            # 2x faster
    assert math.isnan(improvement_pct("ttft", None, 1.0))


def test_verdicts():
    claim = (40, 60)
    assert judge("ttft", {"baseline": 100, "treated": 50}, claim).verdict == "confirmed"
    assert judge("ttft", {"baseline": 100, "treated": 80}, claim).verdict == "partly"
    assert judge("ttft", {"baseline": 100, "treated": 120}, claim).verdict == "not reproduced here"
    noisy = {"baseline": 100, "treated": 50, "significant": False}
    assert judge("ttft", noisy, claim).verdict.endswith("(within noise)")
    assert judge("ttft", None, claim).verdict == "missing"


def test_table_marks_missing_rows_and_uses_tags(tmp_path):
    (tmp_path / "02_prefix_caching.json").write_text(json.dumps({
        "notebook": "02_prefix_caching", "environment": {"device": "cpu"},
        "findings": [{"technique": "prefix caching", "metric": "TTFT median", "baseline": 600.0,
                      "treated": 60.0, "checklist": "prefix caching:ttft", "significant": True},
                     {"technique": "other", "metric": "x", "baseline": 1, "treated": 2}]}))
    table = checklist_table(tmp_path)
    assert len(table) == len(ARTICLE_TABLE)
    row = table[table.technique == "prefix caching"].iloc[0]
    assert row.verdict == "confirmed" and row.measured == 90.0
    assert (table[table.technique != "prefix caching"].verdict == "missing").all()


def test_report_shows_checklist_and_crosscheck(tmp_path):
    from lab_utils.report import build_index
    (tmp_path / "results").mkdir()
    (tmp_path / "status.json").write_text(json.dumps(
        {"profile": "cpu", "notebooks": [{"name": "12_checklist", "status": "ok"}]}))
    (tmp_path / "results" / "12_checklist.json").write_text(json.dumps({
        "notebook": "12_checklist", "findings": [],
        "checklist": [{"technique": "prefix caching", "metric": "TTFT", "claimed": "40–60%",
                       "measured": 90.0, "verdict": "confirmed", "change_ci95": [-95.0, -85.0],
                       "measured_ci95": [85.0, 95.0],
                       "notebook": "02_prefix_caching", "reason": "cpu"}],
        "crosscheck": {"rows": [{"metric": "ttft", "stat": "median", "vllm_bench_ms": 100.0,
                                 "lab_utils_ms": 101.0, "diff_pct": 1.0}]}}))
    md, html = build_index(tmp_path)
    text = md.read_text()
    assert "| prefix caching | TTFT | 40–60% | 90 | 85 … 95 | confirmed |" in text
    assert "vllm bench serve" in text and "+1.0" in text
    assert "<img" in html.read_text()


def test_improvement_interval_reads_like_measured():
    # TTFT: a change of -60 … -40 % is a cut of 40 … 60 %
    assert improvement_ci("ttft", [-60.0, -40.0]) == [40.0, 60.0]
    # TPOT: a change of -50 … -20 % is a speed-up of 25 … 100 %
    lo, hi = improvement_ci("tpot", [-50.0, -20.0])
    assert abs(lo - 25.0) < 1e-9 and abs(hi - 100.0) < 1e-9
    # the point estimate lies inside its interval, read the same way
    assert lo < improvement_pct("tpot", 30.0, 20.0) < hi
    assert improvement_ci("ttft", None) is None and improvement_ci("tpot", [None, 1.0]) is None


def test_crosscheck_takes_the_median_of_rounds():
    from lab_utils.crosscheck import METRICS, markdown, summarize_rounds

    def round_(ttft, tpot):
        return {f"{s}_{m}_ms": {"ttft": ttft, "tpot": tpot}.get(m, 10.0)
                for m in METRICS for s in ("median", "p99")}
    # one disturbed vllm bench round (TPOT 40 ms) among three does not move the result
    rows = summarize_rounds({"vllm_bench": [round_(100, 30), round_(100, 40), round_(104, 31)],
                             "lab_utils": [round_(101, 31), round_(99, 30), round_(100, 31)]})
    by = {(r["metric"], r["stat"]): r for r in rows}
    assert by[("tpot", "median")]["vllm_bench_ms"] == 31 and by[("tpot", "median")]["diff_pct"] == 0
    assert by[("ttft", "median")]["vllm_bench_rounds_ms"] == [100, 100, 104]
    assert by[("ttft", "median")]["diff_pct"] == 0
    text = markdown({"workload": {"num_prompts": 4, "rounds": 3, "input_len": 8, "output_len": 4,
                                  "concurrency": 1}, "rows": rows}, 5.0)
    assert "median of its rounds" in text and "⚠" not in text
    rows[0]["diff_pct"] = 6.0
    assert "⚠" in markdown({"workload": {"num_prompts": 4, "rounds": 3, "input_len": 8,
                                         "output_len": 4, "concurrency": 1}, "rows": rows}, 5.0)


def test_add_finding_rejects_a_tag_that_is_not_a_row_of_the_article(tmp_path):
    from lab_utils.results import Results
    r = Results("x", tmp_path)
    r.add_finding("prefix caching", "TTFT", 100.0, 40.0, "40-60%", "hits",
                  checklist="prefix caching:ttft")
    for bad in ("prefix caching:tpot", "prefix-caching:ttft", "speculative decoding", "ttft"):
        with pytest.raises(ValueError, match="not a row of the article's table"):
            r.add_finding("t", "m", 1.0, 2.0, "c", "m", checklist=bad)
    assert [f["checklist"] for f in r.data["findings"]] == ["prefix caching:ttft"]


def test_a_finding_without_values_is_noted_not_recorded(tmp_path):
    from lab_utils.results import Results
    r = Results("x", tmp_path)
    got = r.add_finding("fp8 KV cache", "TPOT", 25.0, None, "claim", "arm skipped",
                        samples=([1.0, 2.0], []))
    assert got["recorded"] is False and r.data["findings"] == []
    assert r.data["notes"] == ["not recorded: fp8 KV cache / TPOT: no treated value "
                               "(an arm did not run here)"]
    r.add_finding("t", "m", float("nan"), float("nan"), "c", "m")
    assert "no baseline and no treated value" in r.data["notes"][-1]


def test_findings_frame_keeps_its_columns_when_nothing_was_recorded(tmp_path):
    # On a CPU without fp8 KV cache every 06 finding lacks its treated value;
    # the notebook's last cell still selects these columns.
    from lab_utils.results import Results
    r = Results("x", tmp_path)
    r.add_finding("fp8 KV cache", "TPOT", 25.0, None, "claim", "arm skipped")
    frame = r.findings_frame()
    assert frame.empty
    assert list(frame[["metric", "baseline", "treated", "change_pct"]].columns) == \
        ["metric", "baseline", "treated", "change_pct"]
