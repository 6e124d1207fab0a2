"""The run index (index.md / index.html) built from a run folder."""
import json
import math

import pytest

from lab_utils.report import build_index, findings_rows, load_findings

ERROR = ("Traceback (most recent call last):\n  File \"cell\", line 3\n"
         "ServerError: vLLM exited with code 1 while starting <see log>")


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "20250101-120000"
    (run / "results").mkdir(parents=True)
    status = {"profile": "cpu", "base_url": "", "started": "2025-01-01T12:00:00",
              "finished": "2025-01-01T12:30:00",
              "notebooks": [
                  {"name": "00_baseline", "status": "ok", "seconds": 61.25},
                  {"name": "01_prefix_caching", "status": "failed", "seconds": 12.0,
                   "error": ERROR},
                  {"name": "02_speculative", "status": "pending"}]}
    (run / "status.json").write_text(json.dumps(status))
    (run / "results" / "00_baseline.json").write_text(json.dumps({
        "notebook": "00_baseline", "findings": [
            {"technique": "prefix caching", "metric": "ttft_ms_median", "baseline": 812.5,
             "treated": 203.1, "change_pct": -75.0029, "article_claim": "TTFT drops | a lot",
             "mechanism": "hit rate 0.93", "extra": "ignored"},
            {"technique": "chunked prefill", "metric": "itl_ms_p99", "baseline": 1234.0,
             "treated": None, "change_pct": None, "article_claim": "p99 ITL drops",
             "mechanism": ""},
        ]}))
    (run / "results" / "01_prefix_caching.json").write_text("{not json")
    return run


def test_build_index_markdown(run_dir):
    md_path, html_path = build_index(run_dir)
    assert md_path == run_dir / "index.md" and html_path == run_dir / "index.html"
    md = md_path.read_text()
    assert md.startswith("# vLLM Latency Lab run 20250101-120000\n")
    assert "profile: `cpu` · started 2025-01-01T12:00:00 · finished 2025-01-01T12:30:00" in md
    # one status row per notebook: status, time, number of findings, link
    assert ("| 00_baseline | ok | 61.2 | 2 | [00_baseline.ipynb](notebooks/00_baseline.ipynb) |"
            in md)
    assert "| 01_prefix_caching | failed | 12 | 0 |" in md
    assert "| 02_speculative | pending | – | 0 |" in md
    # findings rows, with "|" in a cell made harmless and missing numbers as "–"
    assert ("| 00_baseline | prefix caching | ttft_ms_median | 812 | 203 | -75 | "
            "TTFT drops / a lot | hit rate 0.93 |") in md
    assert ("| 00_baseline | chunked prefill | itl_ms_p99 | 1,234 | – | – | p99 ITL drops |  |"
            in md)
    assert "ignored" not in md


def test_build_index_failures_section(run_dir):
    md = build_index(run_dir)[0].read_text()
    failures = md.split("## Failures", 1)[1].split("## Findings", 1)[0]
    assert "### 01_prefix_caching" in failures
    assert "ServerError: vLLM exited with code 1 while starting <see log>" in failures
    assert "```" in failures
    assert "00_baseline" not in failures


def test_build_index_html(run_dir):
    html = build_index(run_dir)[1].read_text()
    assert html.startswith("<!doctype html>")
    assert "<title>20250101-120000</title>" in html
    assert "<h1>vLLM Latency Lab run 20250101-120000</h1>" in html
    assert "<h2>Failures</h2>" in html and "<h2>Findings</h2>" in html
    assert ("<tr><td>00_baseline</td><td>ok</td><td>61.2</td><td>2</td>"
            '<td><a href="notebooks/00_baseline.ipynb">00_baseline.ipynb</a></td></tr>') in html
    assert "<tr><td>01_prefix_caching</td><td>failed</td>" in html
    assert "<th>notebook</th><th>technique</th><th>metric</th>" in html
    assert "<td>prefix caching</td><td>ttft_ms_median</td><td>812</td><td>203</td>" in html
    # the error is shown escaped inside <pre>
    assert "<pre>" in html and "starting &lt;see log&gt;" in html
    assert "<see log>" not in html
    assert html.count("<table>") == html.count("</table>") == 2
    assert "---" not in html


def test_build_index_without_failures_or_findings(tmp_path):
    run = tmp_path / "r"
    (run / "results").mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({
        "profile": "gpu", "started": "t0", "finished": None,
        "notebooks": [{"name": "00_baseline", "status": "running"}]}))
    md = build_index(run)[0].read_text()
    assert "finished (unfinished)" in md
    assert "| 00_baseline | running | – | 0 |" in md
    assert "## Failures" not in md
    assert md.rstrip().endswith("|---|---|---|---|---|---|---|---|")


def test_load_findings_and_rows(run_dir):
    results = load_findings(run_dir / "results")
    assert set(results) == {"00_baseline", "01_prefix_caching"}
    assert results["01_prefix_caching"]["error"] == "unreadable JSON"
    rows = findings_rows(results)
    assert len(rows) == 2
    assert list(rows[0]) == ["notebook", "technique", "metric", "baseline", "treated",
                             "change_pct", "article_claim", "mechanism"]
    assert rows[0]["change_pct"] == pytest.approx(-75.0029)
    assert math.isclose(rows[1]["baseline"], 1234.0)
