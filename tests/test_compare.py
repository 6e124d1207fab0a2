"""Comparing runs (lab_utils.compare): two small runs recorded with
lab_utils.results in the test, the changes checked against hand-computed values."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab_utils.compare import (RunFolderError, compare_runs, flag_differences, load_run,
                               main)
from lab_utils.profiles import load_profile
from lab_utils.results import Results
from lab_utils.server import Engine

ENV = "VLLM_CPU_KVCACHE_SPACE=2 vllm serve /models/m --host 127.0.0.1 --port {port}"
PREFIX = ("prefix caching: 512-token system prompt", "TTFT median (ms), off -> on")
PREFILL = ("baseline: prefill", "TTFT median (ms), 128 -> 2048 prompt tokens")
STREAM = ("streaming: perceived latency", "first visible text (ms), off -> on")


def _engine(command: str, arm: str, bind: str, **flags) -> Engine:
    """A real Engine whose server is a stand-in: the command line and the
    binding variables it was started with, no process."""
    server = SimpleNamespace(command=command, env={"VLLM_CPU_OMP_THREADS_BIND": bind},
                             startup_s=20.0, log_path=Path("/nonexistent/vllm.log"))
    return Engine(load_profile("cpu"), flags, "http://127.0.0.1:1", "m", model_path="/models/m",
                  server=server, arm=arm)


def _status(run: Path, notebooks: dict[str, str], finished: str | None = "2025-01-01T11:00:00"):
    (run / "status.json").write_text(json.dumps({
        "profile": "cpu", "base_url": "", "smoke": False, "started": "2025-01-01T10:00:00",
        "finished": finished,
        "notebooks": [{"name": n, "status": s, "seconds": 10.0,
                       **({"error": "Traceback ...\nServerError: vLLM exited with code 1"}
                          if s == "failed" else {})} for n, s in notebooks.items()]}))


def _record(results: Path, notebook: str, engines, findings, parameters=None) -> Results:
    r = Results(notebook, results, "cpu")
    r.data["parameters"] = {"profile": "cpu", "results_dir": str(results), **(parameters or {})}
    r.save()
    for engine in engines:
        r.add_engine(engine)
    for finding in findings:
        r.add_finding(**finding)
    return r


@pytest.fixture
def runs(tmp_path):
    """Run A and run B, as runall leaves them: B changed 00's --max-model-len and
    its repeats, its prefix-cache arm helped less, its 00 treated arm did not
    run, and 07 failed in A but ran in B."""
    a, b = tmp_path / "20250101-100000", tmp_path / "20250102-100000"
    for run in (a, b):
        (run / "results").mkdir(parents=True)
    _status(a, {"00_baseline": "ok", "02_prefix_caching": "ok", "07_streaming": "failed"})
    _status(b, {"00_baseline": "ok", "02_prefix_caching": "ok", "07_streaming": "ok"})
    claim = "prefix caching: TTFT -40-60%"
    _record(a / "results", "02_prefix_caching",
            [_engine(ENV.format(port=40001) + " --no-enable-prefix-caching", "off", "0-1"),
             _engine(ENV.format(port=40002) + " --enable-prefix-caching", "on", "0-1")],
            [dict(technique=PREFIX[0], metric=PREFIX[1], baseline=400.0, treated=100.0,
                  article_claim=claim, mechanism="hits 95%", checklist="prefix caching:ttft",
                  samples=([390.0, 400.0, 410.0], [95.0, 100.0, 105.0]))])
    _record(b / "results", "02_prefix_caching",
            [_engine(ENV.format(port=50001) + " --no-enable-prefix-caching", "off", "all"),
             _engine(ENV.format(port=50002) + " --enable-prefix-caching", "on", "all")],
            [dict(technique=PREFIX[0], metric=PREFIX[1], baseline=500.0, treated=400.0,
                  article_claim=claim, mechanism="hits 40%", checklist="prefix caching:ttft")])
    prefill = dict(technique=PREFILL[0], metric=PREFILL[1], article_claim="shorter input",
                   mechanism="no hits")
    _record(a / "results", "00_baseline",
            [_engine(ENV.format(port=40003) + " --max-model-len 4096", "baseline", "0-1")],
            [dict(prefill, baseline=100.0, treated=1500.0)], {"repeats": 4})
    _record(b / "results", "00_baseline",
            [_engine(ENV.format(port=50003) + " --max-model-len 2048", "baseline", "all")],
            [dict(prefill, baseline=120.0, treated=None)], {"repeats": 8})
    _record(b / "results", "07_streaming", [],
            [dict(technique=STREAM[0], metric=STREAM[1], baseline=1000.0, treated=50.0,
                  article_claim="perceived -80%", mechanism="first chunk",
                  checklist="streaming:ttft")])
    return a, b


def test_findings_both_runs_have_with_the_change(runs, tmp_path):
    c = compare_runs(*runs, out=tmp_path / "out")
    rows = c.findings.set_index(["technique", "quantity"])
    baseline, treated, change = (rows.loc[(PREFIX[0], q)] for q in
                                 ("baseline", "treated", "change_pct"))
    assert (baseline.A, baseline.B, baseline["B - A"]) == (400.0, 500.0, 100.0)
    assert baseline["B vs A (%)"] == pytest.approx(25.0)          # 100 / 400
    assert (treated.A, treated.B, treated["B - A"]) == (100.0, 400.0, 300.0)
    assert treated["B vs A (%)"] == pytest.approx(300.0)          # 300 / 100
    # the change itself: -75% -> -20%, +55 points; no relative change of a percentage
    assert change.A == pytest.approx(-75.0) and change.B == pytest.approx(-20.0)
    assert change["B - A"] == pytest.approx(55.0) and math.isnan(change["B vs A (%)"])
    # A's interval lies within [(95-410)/410, (105-390)/390] = [-76.8%, -73.1%]: -20 is outside
    assert change["B in A's CI95"] is False
    lo, hi = (float(x) for x in change["A CI95"].split(" … "))
    assert -76.8 <= lo <= hi <= -73.1
    assert set(c.findings.technique) == {PREFIX[0]}   # the only finding both runs have


def test_findings_only_one_run_has_say_why(runs, tmp_path):
    c = compare_runs(*runs, out=tmp_path / "out")
    only = c.only_some.set_index("technique")
    assert set(only.index) == {PREFILL[0], STREAM[0]}
    prefill = only.loc[PREFILL[0]]
    assert prefill["in"] == "A" and prefill.A == "100 -> 1,500 (+1,400%)" and prefill.B == ""
    # B's notebook ran but its treated arm did not: Results noted it, the page says so
    assert prefill["why not in the others"].startswith("B: not recorded: baseline: prefill")
    stream = only.loc[STREAM[0]]
    assert stream["in"] == "B" and stream.B == "1,000 -> 50 (-95%)"
    assert stream["why not in the others"] == "A: notebook failed, no results file"


def test_changed_verdict_and_why(runs, tmp_path):
    c = compare_runs(*runs, out=tmp_path / "out")
    changed = c.verdicts.set_index(["technique", "metric"])
    # prefix caching: a TTFT cut of 75% (>= the claim's 40%) then 20% (> 0): partly
    row = changed.loc[("prefix caching", "TTFT")]
    assert row.A == "confirmed: +75.0%" and row.other == "partly: +20.0%"
    assert row.why == "measured +75.0% -> +20.0% (the claim starts at 40%)"
    # streaming: no finding in A (07 failed), 95% cut in B
    row = changed.loc[("streaming", "TTFT")]
    assert row.A == "missing" and row.other == "confirmed: +95.0%"
    assert row.why == ("A has no finding for this row: no finding recorded (notebook not run "
                       "or failed)")
    assert len(changed) == 2   # every other row is missing in both


def test_environment_engines_parameters_and_statuses(runs, tmp_path):
    c = compare_runs(*runs, out=tmp_path / "out")
    env = c.environment
    # the same machine and versions (recorded by this process): not a difference
    assert not env.loc[["machine fingerprint", "CPU model", "ISA", "vLLM"], "differs"].any()
    assert env.loc["thread binding", "differs"]          # 0-1 vs all
    # the binding the engines were started with (B's 07 started none: not counted)
    assert [v.split()[0] for v in env.loc["thread binding"].tolist()[:2]] == [
        "VLLM_CPU_OMP_THREADS_BIND=0-1", "VLLM_CPU_OMP_THREADS_BIND=all"]
    assert env.loc["state", "A (20250101-100000)"] == "finished: 2 ok, 1 failed"
    engines = c.engines.set_index(["notebook", "command"])
    same = engines.loc[("02_prefix_caching", ENV.format(port="").replace("--port ", "").strip()
                        + " --enable-prefix-caching")]
    assert same.in_every_run and same["A (20250101-100000)"] == "on"   # ports ignored
    assert engines.loc["00_baseline"].in_every_run.tolist() == [False, False]
    assert flag_differences(*engines.loc["00_baseline"].index) == (["4096"], ["2048"])
    params = c.parameters.set_index(["notebook", "parameter"])
    assert list(params.index) == [("00_baseline", "repeats")]         # results_dir left out
    assert params.iloc[0].tolist() == ["4", "8"]
    statuses = c.statuses.set_index("notebook")
    assert list(statuses.index) == ["07_streaming"]
    assert statuses.iloc[0].tolist() == ["failed: ServerError: vLLM exited with code 1", "ok"]


def test_pages_written(runs, tmp_path):
    c = compare_runs(*runs, out=tmp_path / "out")
    assert c.pages == {"markdown": tmp_path / "out" / "compare.md",
                       "html": tmp_path / "out" / "compare.html",
                       "plot": tmp_path / "out" / "article_table.png"}
    md = c.pages["markdown"].read_text()
    assert md.startswith("# Comparing runs: A 20250101-100000 · B 20250102-100000\n")
    assert ("| 02_prefix_caching | prefix caching: 512-token system prompt | "
            "TTFT median (ms), off -> on | baseline | 400 | 500 | – | +100 | +25 | – |") in md
    change = next(line for line in md.splitlines() if "| change (%) |" in line)
    assert change.startswith("|  |  |  | change (%) | -75 | -20 | -7") and change.endswith(
        " | +55 | – | no |")   # A's interval: inside -76.8 … -73.1
    outside = md.split("## Changes outside A's 95% interval", 1)[1].split("## Findings in", 1)[0]
    assert "| 02_prefix_caching | prefix caching: 512-token system prompt |" in outside
    assert "### 00_baseline: the engines differ" in md
    assert "### 02_prefix_caching: the same engines in every run" in md
    assert "against A's closest engine (arm `baseline`): `2048` instead of `4096`" in md
    assert "![the article's table across runs](article_table.png)" in md
    assert "<h2>Checklist verdicts that changed</h2>" in c.pages["html"].read_text()
    assert c.pages["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_units_and_a_series_per_run(runs, tmp_path):
    from lab_utils.compare import checklist_across
    from lab_utils.plots import article_table_across_runs
    folders = [load_run(p, label) for p, label in zip(runs, "AB")]
    fig = article_table_across_runs(checklist_across(folders), ["A", "B"])
    ax = fig.axes[0]
    assert ax.get_xlabel() == "measured improvement (%): TTFT cut, or TPOT speed-up"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["A: A", "B: B",
                                                                   "article's claim"]


def test_three_runs_compare_each_against_the_first(runs, tmp_path):
    c = compare_runs(runs[0], runs[1], runs[0], out=tmp_path / "out")
    change = c.findings.set_index(["technique", "quantity"]).loc[(PREFIX[0], "change_pct")]
    assert change["C - A"] == 0.0 and change["B - A"] == pytest.approx(55.0)


def test_missing_and_garbled_runs_are_said_not_raised(runs, tmp_path, capsys):
    a, b = runs
    assert main([str(a), str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"compare: {tmp_path / 'nope'}: no such folder\n"
    empty = tmp_path / "20250103-100000"
    (empty / "results").mkdir(parents=True)
    _status(empty, {"00_baseline": "not run (interrupted)"}, finished=None)
    assert main([str(a), str(empty), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no readable results file" in err and "interrupted or failed before" in err
    with pytest.raises(RunFolderError, match="not a folder"):
        load_run(a / "status.json")


def test_interrupted_run_with_a_garbled_file_is_compared_as_far_as_it_got(runs, tmp_path,
                                                                            capsys):
    a, b = runs
    _status(b, {"00_baseline": "ok", "02_prefix_caching": "interrupted",
                "07_streaming": "not run (interrupted)"}, finished="2025-01-02T10:05:00")
    (b / "results" / "07_streaming.json").write_text('{"notebook": "07_streaming", "find')
    (b / "results" / "05_quantization.json").write_text("[1, 2]")
    assert main([str(a), str(b), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "results/07_streaming.json is not a results file" in out
    assert "results/05_quantization.json is not a results file" in out
    assert "interrupted: 2 of 3 notebooks not run or cut short" in out
    md = (tmp_path / "o" / "compare.md").read_text()
    assert "## Read with care" in md and "B (20250102-100000): interrupted: 2 of 3" in md
    statuses = load_run(b, "B")
    assert sorted(statuses.results) == ["00_baseline", "02_prefix_caching"]


def test_a_bare_results_folder_compares_without_statuses(runs, tmp_path):
    a, b = runs
    c = compare_runs(a / "results", b, out=tmp_path / "out")
    assert c.runs[0].name == "20250101-100000"                  # the run's stamp, not "results"
    assert c.environment.loc["state"].tolist()[0] == "results folder only (no status.json)"
    assert c.statuses.empty                    # A's statuses are unknown: nothing to set beside B's
    assert set(c.findings.technique) == {PREFIX[0]}
