"""The article's checklist: improvement arithmetic, verdicts, missing rows."""
import json
import math

from lab_utils.checklist import ARTICLE_TABLE, checklist_table, improvement_pct, judge


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
                       "notebook": "02_prefix_caching", "reason": "cpu"}],
        "crosscheck": {"rows": [{"metric": "ttft", "stat": "median", "vllm_bench_ms": 100.0,
                                 "lab_utils_ms": 101.0, "diff_pct": 1.0}]}}))
    md, html = build_index(tmp_path)
    text = md.read_text()
    assert "| prefix caching | TTFT | 40–60% | 90 | -95 … -85 | confirmed |" in text
    assert "vllm bench serve" in text and "+1.0" in text
    assert "<img" in html.read_text()
