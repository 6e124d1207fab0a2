"""Compare runs: what changed between two (or more) run folders of `runall`.

    python -m lab_utils.compare runs/20261201-095953 runs/20261201-132756 [--out DIR]

    from lab_utils.compare import compare_runs      # in a notebook
    comparison = compare_runs("runs/20261201-095953", "runs/latest")
    comparison.findings                              # a DataFrame; .pages: the files written

The first run is the reference: every change is "B - A" (absolute) and "B vs A"
(% of A). The page (`compare.md`, `compare.html` and `article_table.png` in the
output folder) holds the environments side by side (machine, its fingerprint,
CPU, ISA, device, profile, model, vLLM version), each notebook's engine command
lines and parameters where they differ, the notebooks whose status differs, the
article's table across runs with the verdicts that changed and why, every
finding all runs have with each run's values and the change, and the findings
only some runs have (with the reason where the run recorded one).

A finding is the same finding in two runs when its notebook, technique and
metric are the same. A run folder may also be a bare results folder (the
`results_dir` of a notebook run by hand); an interrupted run is compared as far
as it got, and said so.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .article_table import ARTICLE_TABLE, checklist_table
from .machine import fingerprint, summary_line
from .metrics import change_pct
from .paths import RUNS_DIR
from .report import _fmt, _markdown_table_html, engine_command, load_findings


class RunFolderError(ValueError):
    """A folder that holds no run to compare (missing, or no readable results)."""


@dataclass
class RunFolder:
    """One run as recorded: its status (runall's status.json; {} for a bare
    results folder), the readable results JSON per notebook, and what was wrong
    with the rest (`problems`, said on the page)."""
    path: Path
    results_dir: Path
    status: dict[str, Any]
    results: dict[str, dict[str, Any]]
    problems: list[str] = field(default_factory=list)
    label: str = "A"

    @property
    def name(self) -> str:  # runs/<stamp>/results given: the run's stamp
        return self.path.parent.name if self.path.name == "results" else self.path.name

    @property
    def title(self) -> str:
        return f"{self.label} ({self.name})"


def _is_results(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("findings", []), list) and all(
        isinstance(f, dict) for f in data.get("findings", []))


def load_run(path: str | Path, label: str = "A") -> RunFolder:
    """Read a run folder (`runs/<stamp>`, with status.json and results/) or a bare
    results folder; raise RunFolderError with what is wrong when there is nothing
    to compare. Unreadable files and an interrupted run become `problems`."""
    path = Path(path)
    if not path.exists():
        raise RunFolderError(f"{path}: no such folder")
    if not path.is_dir():
        raise RunFolderError(f"{path}: not a folder (give a run folder, e.g. runs/latest)")
    path = path.resolve()  # runs/latest -> the run it points at
    results_dir = path / "results" if (path / "results").is_dir() else path
    problems: list[str] = []
    status: dict[str, Any] = {}
    status_path = path / "status.json"
    if status_path.exists():
        try:
            status = json.loads(status_path.read_text())
            if not isinstance(status, dict) or not isinstance(status.get("notebooks", []), list):
                raise ValueError("not a status object")
        except ValueError:
            status = {}
            problems.append("status.json is unreadable: notebook statuses unknown")
    elif results_dir != path:
        problems.append("no status.json (runall writes it first: the run's statuses are unknown)")
    results = {}
    for notebook, data in load_findings(results_dir).items():
        if not _is_results(data) or data.get("error") == "unreadable JSON":
            problems.append(f"results/{notebook}.json is not a results file (unreadable or "
                            "cut short): its findings are left out")
        else:
            results[notebook] = data
    if not results:
        listed = [nb.get("name") for nb in status.get("notebooks", [])]
        raise RunFolderError(
            f"{path}: no readable results file in {results_dir} "
            + (f"(status.json lists {len(listed)} notebooks; none recorded results: the run "
               "was interrupted or failed before any notebook wrote its findings)" if listed
               else "(not a run folder of `python -m lab_utils.runall`, nor a results folder)"))
    notebooks = status.get("notebooks", [])
    if status and not status.get("finished"):
        problems.append("the run did not finish (still running, or killed): compared as far as "
                        "it got")
    interrupted = [nb["name"] for nb in notebooks if "interrupted" in str(nb.get("status"))]
    if interrupted:
        problems.append(f"interrupted: {len(interrupted)} of {len(notebooks)} notebooks not run "
                        f"or cut short ({', '.join(interrupted)})")
    return RunFolder(path, results_dir, status, results, problems, label)


# -- environments ---------------------------------------------------------
def _distinct(values: Iterable[Any]) -> str:
    """The distinct values, in order, joined (" / "); "–" when there is none."""
    seen = []
    for v in values:
        if v not in (None, "") and v not in seen:
            seen.append(v)
    return " / ".join(str(v) for v in seen) or "–"


def _environments(run: RunFolder, with_engines: bool = False) -> list[dict[str, Any]]:
    """The environments the notebooks recorded (`with_engines`: only those of
    notebooks that started an engine, whose binding is the engine's)."""
    return [d["environment"] for d in run.results.values()
            if isinstance(d.get("environment"), dict) and (d.get("engines") or not with_engines)]


def _machines(run: RunFolder, with_engines: bool = False) -> list[dict[str, Any]]:
    return [e["machine"] for e in _environments(run, with_engines)
            if isinstance(e.get("machine"), dict)]


def _run_state(run: RunFolder) -> str:
    notebooks = run.status.get("notebooks", [])
    if not run.status:
        return "results folder only (no status.json)"
    counts: dict[str, int] = {}
    for nb in notebooks:
        counts[nb.get("status", "?")] = counts.get(nb.get("status", "?"), 0) + 1
    state = "finished" if run.status.get("finished") else "unfinished"
    return f"{state}: " + ", ".join(f"{n} {s}" for s, n in counts.items())


def environment_table(runs: Sequence[RunFolder]) -> pd.DataFrame:
    """One row per fact (machine, fingerprint, CPU, ISA, device, profile, model,
    vLLM and torch versions, ...), one column per run, and `differs`. Where the
    notebooks of one run recorded different values, all are listed."""
    def facts(run: RunFolder) -> dict[str, str]:
        envs, machines = _environments(run), _machines(run)
        nbs = run.status.get("notebooks", [])
        seconds = [nb["seconds"] for nb in nbs if isinstance(nb.get("seconds"), (int, float))]
        binding = [" ".join(f"{k}={v}" for k, v in m.get("thread_binding", {}).items() if v)
                   for m in _machines(run, with_engines=True)]  # the engines' own binding
        return {
            "run folder": str(run.path),
            "started": run.status.get("started")
                       or min(str(d.get("started") or "–") for d in run.results.values()),
            "state": _run_state(run),
            "notebooks' time (s)": _fmt(float(sum(seconds))) if seconds else "–",
            "profile": _distinct([run.status.get("profile")]
                                 + [d.get("profile") for d in run.results.values()]),
            "smoke parameters": _distinct([run.status.get("smoke") if run.status else
                                           any(d.get("smoke") for d in run.results.values())]),
            "base_url": _distinct([run.status.get("base_url")]),
            "machine": _distinct(summary_line(m) for m in machines),
            "machine fingerprint": _distinct(fingerprint(m) for m in machines),
            "CPU model": _distinct(m.get("cpu_model") for m in machines),
            "ISA": _distinct(m.get("isa_summary") for m in machines),
            "cores available": _distinct(m.get("cores_available") for m in machines),
            "memory (GiB)": _distinct(m.get("memory_gib") for m in machines),
            "device": _distinct(e.get("device") for e in envs),
            "model": _distinct(e.get("served_model_name") for e in envs),
            "model path": _distinct(e.get("model") for e in envs),
            "vLLM": _distinct(f"{m.get('vllm_distribution') or 'vllm'} {m['vllm_version']}"
                              for m in machines if m.get("vllm_version")),
            "vLLM of the server (remote)": _distinct(e.get("server_vllm_version") for e in envs),
            "torch": _distinct(m.get("torch_version") for m in machines),
            "python": _distinct(e.get("python") for e in envs),
            "thread binding": _distinct(binding),
            "hostname": _distinct(e.get("hostname") for e in envs),
        }
    table = pd.DataFrame({run.title: facts(run) for run in runs})
    table["differs"] = table.nunique(axis=1) > 1
    table.loc[["run folder", "started"], "differs"] = False  # always differ; not a change
    return table


# -- engines and parameters ----------------------------------------------------
def engine_table(runs: Sequence[RunFolder]) -> pd.DataFrame:
    """Each notebook's engines, matched by command line (port left out; an arm
    may be named differently in another run): one row per (notebook, command),
    per run the arm names that started it ("" where that run did not), and
    `in_every_run`."""
    rows: dict[tuple[str, str], dict[str, list[str]]] = {}
    for run in runs:
        for notebook, data in run.results.items():
            for engine in data.get("engines", []):
                if not isinstance(engine, dict) or not engine.get("command"):
                    continue
                arms = rows.setdefault((notebook, engine_command(engine["command"])), {})
                name = str(engine.get("arm") or engine.get("label") or "?")
                if name not in arms.setdefault(run.title, []):  # a restart: the same arm
                    arms[run.title].append(name)
    table = pd.DataFrame([{"notebook": nb, "command": command,
                           **{r.title: ", ".join(arms.get(r.title, [])) for r in runs},
                           "in_every_run": all(r.title in arms for r in runs)}
                          for (nb, command), arms in rows.items()],
                         columns=["notebook", "command", *(r.title for r in runs), "in_every_run"])
    return table.sort_values("notebook", kind="stable", ignore_index=True)


def flag_differences(reference: str, other: str) -> tuple[list[str], list[str]]:
    """The words of two command lines that only one has: (only in reference,
    only in other), e.g. (['--max-num-batched-tokens', '512'], ['2048'])."""
    a, b = shlex.split(reference), shlex.split(other)
    return [w for w in a if w not in b], [w for w in b if w not in a]


def closest_command(command: str, candidates: Iterable[str]) -> str | None:
    """The candidate command line sharing the most words with `command`."""
    words = set(shlex.split(command))
    return max(candidates, key=lambda c: len(words & set(shlex.split(c))), default=None)


def parameter_table(runs: Sequence[RunFolder]) -> pd.DataFrame:
    """The notebook parameters that differ between runs: notebook, parameter,
    one column per run (the value as JSON; "–" where the run has none), for
    the notebooks every run recorded. `results_dir` is left out: each run
    writes into its own folder."""
    rows = []
    in_every_run = set.intersection(*(set(run.results) for run in runs))
    for notebook in sorted(in_every_run):
        params = [run.results[notebook].get("parameters") or {} for run in runs]
        for name in sorted({k for p in params for k in p} - {"results_dir"}):
            values = [json.dumps(p[name], sort_keys=True) if name in p else "–" for p in params]
            if len(set(values)) > 1:
                rows.append({"notebook": notebook, "parameter": name,
                             **{run.title: v for run, v in zip(runs, values)}})
    return pd.DataFrame(rows, columns=["notebook", "parameter", *(r.title for r in runs)])


def status_table(runs: Sequence[RunFolder]) -> pd.DataFrame:
    """The notebooks whose status differs between the runs that recorded
    statuses (a bare results folder has none): notebook, each run's status
    ("not in the run" where it is not listed, "–" for a run without statuses)
    and the last line of its error where it failed."""
    def statuses(run: RunFolder) -> dict[str, str]:
        out = {}
        for nb in run.status.get("notebooks", []):
            error = (nb.get("error") or "").strip().splitlines()
            out[nb.get("name")] = nb.get("status", "?") + (f": {error[-1][:160]}" if error
                                                           else "")
        return out

    per_run = [statuses(run) if run.status else None for run in runs]
    rows = []
    for notebook in sorted({nb for s in per_run if s for nb in s}):
        values = [s.get(notebook, "not in the run") if s is not None else "–" for s in per_run]
        if len({v.split(":")[0] for v in values if v != "–"}) > 1:
            rows.append({"notebook": notebook, **{r.title: v for r, v in zip(runs, values)}})
    return pd.DataFrame(rows, columns=["notebook", *(r.title for r in runs)])


# -- findings ---------------------------------------------------------------
KEY = ("notebook", "technique", "metric")
QUANTITIES = ("baseline", "treated", "change_pct")


def _findings(run: RunFolder) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for notebook, data in run.results.items():
        for f in data.get("findings", []):
            out.setdefault((notebook, str(f.get("technique")), str(f.get("metric"))), f)
    return out


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def finding_changes(runs: Sequence[RunFolder]) -> pd.DataFrame:
    """Every finding all runs have: three rows each (quantity baseline, treated,
    change_pct), each run's value, and per later run X: `X - A` (absolute; in
    percentage points for change_pct), `X vs A (%)` (relative, for baseline and
    treated) and, for change_pct where A recorded a 95% bootstrap interval
    (`A CI95`), whether X's change lies inside it (`X in A's CI95`)."""
    ref, others = runs[0], runs[1:]
    found = [_findings(run) for run in runs]
    common = [k for k in found[0] if all(k in f for f in found[1:])]
    rows = []
    for key in common:
        for quantity in QUANTITIES:
            values = [_number(f[key].get(quantity)) for f in found]
            row: dict[str, Any] = dict(zip(KEY, key), quantity=quantity)
            row.update({run.label: v for run, v in zip(runs, values)})
            a = values[0]
            ci = found[0][key].get("change_ci95")
            if quantity == "change_pct" and ci and None not in ci:
                row[f"{ref.label} CI95"] = f"{min(ci):.3g} … {max(ci):.3g}"
            for run, v in zip(others, values[1:]):
                row[f"{run.label} - {ref.label}"] = (v - a if None not in (a, v) else None)
                row[f"{run.label} vs {ref.label} (%)"] = (
                    _number(change_pct(a, v)) if quantity != "change_pct" and None not in (a, v)
                    else None)
                if quantity == "change_pct":
                    inside = (None if v is None or not ci or None in ci
                              else bool(min(ci) <= v <= max(ci)))
                    row[f"{run.label} in {ref.label}'s CI95"] = inside
            rows.append(row)
    columns = [*KEY, "quantity", *(r.label for r in runs), f"{ref.label} CI95"]
    for run in others:
        columns += [f"{run.label} - {ref.label}", f"{run.label} vs {ref.label} (%)",
                    f"{run.label} in {ref.label}'s CI95"]
    return pd.DataFrame(rows, columns=columns)


def beyond_noise(findings: pd.DataFrame, ref: str) -> pd.DataFrame:
    """The rows of `finding_changes` whose change in a later run lies outside
    the reference's 95% interval, largest move first."""
    inside = [c for c in findings.columns if c.endswith(f" in {ref}'s CI95")]
    changes = findings[findings.quantity == "change_pct"]
    outside = changes[(changes[inside] == False).any(axis=1)]  # noqa: E712 (None: no interval)
    moved = outside[[c for c in outside.columns if c.endswith(f" - {ref}")]].abs().max(axis=1)
    relative = [c for c in outside.columns if c.endswith(f" vs {ref} (%)")]  # none for a change
    return outside.loc[moved.sort_values(ascending=False).index].drop(
        columns=["quantity", *relative])


def _why_missing(run: RunFolder, notebook: str, technique: str, metric: str) -> str:
    """Why `run` has no such finding, from what it recorded."""
    listed = {nb.get("name"): nb for nb in run.status.get("notebooks", [])}
    data = run.results.get(notebook)
    if data is None:
        if notebook in listed:
            return f"{run.label}: notebook {listed[notebook].get('status')}, no results file"
        return f"{run.label}: notebook not in the run"
    note = next((n for n in data.get("notes", []) if isinstance(n, str)
                 and n.startswith("not recorded:") and technique in n and metric in n), None)
    if note:
        return f"{run.label}: {note}"
    status = listed.get(notebook, {}).get("status")
    if status and status != "ok":
        return f"{run.label}: notebook {status}"
    return f"{run.label}: not recorded (another finding of the notebook, or renamed)"


def only_some_findings(runs: Sequence[RunFolder]) -> pd.DataFrame:
    """The findings some runs have and others not: in which runs, why not in the
    others (the run's own note, the notebook's status), and each run's
    "baseline -> treated (change %)"."""
    found = [_findings(run) for run in runs]
    keys = []
    for f in found:
        keys += [k for k in f if k not in keys]
    rows = []
    for key in keys:
        have = [run for run, f in zip(runs, found) if key in f]
        if len(have) == len(runs):
            continue
        row = dict(zip(KEY, key), **{"in": ", ".join(r.label for r in have)})
        row["why not in the others"] = "; ".join(_why_missing(run, *key) for run, f
                                                  in zip(runs, found) if key not in f)
        for run, f in zip(runs, found):
            g = f.get(key)
            row[run.label] = (f"{_fmt(_number(g.get('baseline')))} -> "
                              f"{_fmt(_number(g.get('treated')))} "
                              f"({_signed(_number(g.get('change_pct')))}%)" if g else "")
        rows.append(row)
    return pd.DataFrame(rows, columns=[*KEY, "in", "why not in the others",
                                       *(r.label for r in runs)])


# -- the article's table ------------------------------------------------------------
def checklist_across(runs: Sequence[RunFolder]) -> pd.DataFrame:
    """The article's table (`article_table.checklist_table` of each run's results),
    long: one row per (run, technique, metric) with claimed, measured, its
    interval, verdict and reason."""
    frames = []
    for run in runs:
        table = checklist_table(run.results_dir)
        frames.append(table.assign(run=run.label))
    return pd.concat(frames, ignore_index=True)


def _claim_low(technique: str, metric: str) -> float:
    return ARTICLE_TABLE[(technique, metric.lower())][0]


def _verdict_why(ref: pd.Series, other: pd.Series, ref_label: str, label: str) -> str:
    """Why a verdict changed, from the two rows of the checklist."""
    low = _claim_low(other.technique, other.metric)
    a, b = _number(ref.measured), _number(other.measured)
    if a is None or b is None:
        missing = (ref_label, ref) if a is None else (label, other)
        return f"{missing[0]} has no finding for this row: {missing[1].reason}"
    parts = [f"measured {a:+.1f}% -> {b:+.1f}% (the claim starts at {low:g}%)"]
    for who, row in ((ref_label, ref), (label, other)):
        if "within noise" in str(row.verdict):
            parts.append(f"{who}'s 95% interval of the change includes 0")
    if str(ref.reason) != str(other.reason):
        parts.append(f"{ref_label}: {ref.reason}; {label}: {other.reason}")
    return "; ".join(parts)


def verdict_changes(runs: Sequence[RunFolder], across: pd.DataFrame | None = None) -> pd.DataFrame:
    """The rows of the article's table whose verdict in a later run differs
    from the reference run's: technique, metric, claimed, run, both verdicts
    with their measured improvement, and why."""
    across = checklist_across(runs) if across is None else across
    ref = runs[0].label
    rows = []
    for (technique, metric), group in across.groupby(["technique", "metric"], sort=False):
        by_run = group.set_index("run")
        a = by_run.loc[ref]
        for run in runs[1:]:
            b = by_run.loc[run.label]
            if a.verdict != b.verdict:
                rows.append({"technique": technique, "metric": metric, "claimed": a.claimed,
                             "run": run.label, ref: _verdict_text(a), "other": _verdict_text(b),
                             "why": _verdict_why(a, b, ref, run.label)})
    return pd.DataFrame(rows, columns=["technique", "metric", "claimed", "run", ref, "other",
                                       "why"])


def _verdict_text(row: pd.Series) -> str:
    m = _number(row.measured)
    return f"{row.verdict}: {m:+.1f}%" if m is not None else str(row.verdict)


# -- the comparison and its page ---------------------------------------------------
@dataclass
class Comparison:
    """Every table of the comparison page (DataFrames) and, once written, `pages`."""
    runs: list[RunFolder]
    environment: pd.DataFrame
    engines: pd.DataFrame
    parameters: pd.DataFrame
    statuses: pd.DataFrame
    checklist: pd.DataFrame
    verdicts: pd.DataFrame
    findings: pd.DataFrame
    only_some: pd.DataFrame
    pages: dict[str, Path] = field(default_factory=dict)

    def _repr_markdown_(self) -> str:  # the page in a notebook (its plot: `pages["plot"]`)
        return "\n".join(line for line in markdown(self).splitlines()
                         if not line.startswith("!["))


def compare(runs: Sequence[RunFolder]) -> Comparison:
    """Every table of the comparison of `runs` (the first is the reference)."""
    if len(runs) < 2:
        raise RunFolderError("compare needs two runs or more")
    across = checklist_across(runs)
    return Comparison(list(runs), environment_table(runs), engine_table(runs),
                      parameter_table(runs), status_table(runs), across,
                      verdict_changes(runs, across), finding_changes(runs),
                      only_some_findings(runs))


def _signed(value: float | None) -> str:
    return "–" if value is None else (f"{value:+,.3g}" if abs(value) < 1000 else f"{value:+,.0f}")


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return _fmt(value).replace("|", "/").replace("\n", " ")


def _table(frame: pd.DataFrame, index: bool = False) -> list[str]:
    frame = frame.reset_index() if index else frame
    head = [str(c) for c in frame.columns]
    md = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in frame.itertuples(index=False):
        md.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return md


def _engines_section(c: Comparison) -> list[str]:
    md = ["", "## Engine command lines", "",
          "Ports left out (each start picks one). A command is the same engine in two runs "
          "whatever its arm was called."]
    if c.engines.empty:
        return md + ["", "No run recorded an engine (a remote target, or nothing ran)."]
    for notebook, group in c.engines.groupby("notebook", sort=False):
        same = group.in_every_run.all()
        md += ["", f"### {notebook}: " + ("the same engines in every run" if same
                                           else "the engines differ"), ""]
        for row in group.to_dict("records"):
            used = [f"{r.label} `{row[r.title]}`" for r in c.runs if row[r.title]]
            md += [("arm " if row["in_every_run"] else "only in ") + ", ".join(used) + ":",
                   "```", row["command"], "```"]
            if row["in_every_run"]:
                continue
            for run in c.runs:
                if row[run.title]:
                    continue
                theirs = group[group[run.title] != ""]
                near = closest_command(row["command"], theirs.command)
                if near:
                    gone, new = (" ".join(w) or "(nothing)"
                                 for w in flag_differences(near, row["command"]))
                    arm = theirs.loc[theirs.command == near, run.title].iloc[0]
                    md.append(f"against {run.label}'s closest engine (arm `{arm}`): `{new}` "
                              f"instead of `{gone}`")
    return md


def _findings_section(c: Comparison) -> list[str]:
    ref = c.runs[0].label
    md = ["", "## Findings in every run", "",
          f"Each finding's baseline and treated value and its change (%, treated vs baseline) "
          f"in every run; `X - {ref}` is absolute (percentage points for the change), "
          f"`X vs {ref} (%)` relative to {ref}; `X in {ref}'s CI95`: whether X's change lies "
          f"inside the 95% bootstrap interval {ref} recorded for it."]
    if c.findings.empty:
        return md + ["", "No finding is in every run."]
    frame = c.findings.copy()
    repeat = frame[list(KEY)].eq(frame[list(KEY)].shift())
    for k in KEY:  # the three rows of a finding: its name once
        frame[k] = frame[k].where(~repeat.all(axis=1), "")
    frame["quantity"] = frame["quantity"].replace({"change_pct": "change (%)"})
    for col in frame.columns:
        if col.endswith(f"- {ref}") or col.endswith(f"vs {ref} (%)"):
            frame[col] = frame[col].map(lambda v: _signed(_number(v)))
    return md + [""] + _table(frame)


def markdown(c: Comparison) -> str:
    """The comparison page in Markdown."""
    ref = c.runs[0]
    names = " · ".join(f"{r.label} {r.name}" for r in c.runs)
    md = [f"# Comparing runs: {names}", "",
          f"{ref.label} is the reference: a change is X - {ref.label}, or X vs {ref.label} in %."]
    problems = [f"{r.label} ({r.name}): {p}" for r in c.runs for p in r.problems]
    if problems:
        md += ["", "## Read with care", ""] + [f"- {p}" for p in problems]
    env = c.environment.copy()
    env["differs"] = env["differs"].map(lambda d: "**differs**" if d else "")
    md += ["", "## Environments", ""] + _table(env.rename_axis("fact"), index=True)
    md += _engines_section(c)
    md += ["", "## Parameters that differ", ""]
    md += (_table(c.parameters) if len(c.parameters)
           else ["Every notebook ran with the same parameters in every run."])
    md += ["", "## Notebooks whose status differs", ""]
    if len(c.statuses):
        md += _table(c.statuses)
    else:
        n = max(len(r.status.get("notebooks", [])) or len(r.results) for r in c.runs)
        md += [f"None: each of the {n} notebooks has the same status in every run."]
    table = c.checklist.pivot(index=["technique", "metric"], columns="run",
                              values=["measured", "verdict"])
    table.columns = [f"{run} {'measured (%)' if what == 'measured' else what}"
                     for what, run in table.columns]
    claimed = c.checklist.drop_duplicates(["technique", "metric"]).set_index(
        ["technique", "metric"]).claimed
    order = [f"{r.label} {w}" for r in c.runs for w in ("measured (%)", "verdict")]
    table = pd.concat([claimed, table[order]], axis=1).loc[claimed.index]
    md += ["", "## The article's table across runs", "",
           "Measured improvement: TTFT cut, or TPOT speed-up (%), as the article states it.", ""]
    md += _table(table, index=True)
    md += ["", "![the article's table across runs](article_table.png)"]
    md += ["", "## Checklist verdicts that changed", ""]
    md += (_table(c.verdicts.rename(columns={"other": "verdict in run"}))
           if len(c.verdicts) else ["None: every row of the article's table has the same "
                                    "verdict in every run."])
    ref_label = c.runs[0].label
    noise = beyond_noise(c.findings, ref_label)
    md += ["", f"## Changes outside {ref_label}'s 95% interval", "",
           f"The findings whose change (%) in a later run lies outside the 95% bootstrap "
           f"interval {ref_label} recorded for it (only findings with an interval; largest "
           "move first)."]
    for col in [c for c in noise.columns if c.endswith(f"- {ref_label}")]:
        noise[col] = noise[col].map(lambda v: _signed(_number(v)))
    md += [""] + (_table(noise) if len(noise) else ["None."])
    md += _findings_section(c)
    md += ["", "## Findings not in every run", ""]
    md += (_table(c.only_some) if len(c.only_some)
           else ["None: every run has the same findings."])
    return "\n".join(md) + "\n"


def default_out(runs: Sequence[RunFolder]) -> Path:
    return RUNS_DIR / "compare" / "_vs_".join(r.name for r in runs)


def write_pages(c: Comparison, out: str | Path) -> dict[str, Path]:
    """Write compare.md, compare.html and article_table.png into `out`."""
    from .plots import article_table_across_runs
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "article_table.png"
    fig = article_table_across_runs(c.checklist, [r.label for r in c.runs],
                                    {r.label: r.name for r in c.runs}, save_to=png)
    import matplotlib.pyplot as plt
    plt.close(fig)
    text = markdown(c)
    md_path, html_path = out / "compare.md", out / "compare.html"
    md_path.write_text(text)
    html_path.write_text(_markdown_table_html(text, "compare " + " vs ".join(
        r.name for r in c.runs)))
    c.pages = {"markdown": md_path, "html": html_path, "plot": png}
    return c.pages


def compare_runs(*paths: str | Path, out: str | Path | None = None) -> Comparison:
    """Compare run folders (the first is the reference) and write the page into
    `out` (default runs/compare/<A>_vs_<B>); returns the Comparison, whose
    tables are DataFrames and whose `pages` are the files written."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    runs = [load_run(p, letters[i] if i < 26 else f"R{i + 1}") for i, p in enumerate(paths)]
    c = compare(runs)
    write_pages(c, out or default_out(runs))
    return c


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path,
                        help="run folders (runs/<stamp>, runs/latest) or results folders; "
                             "the first is the reference")
    parser.add_argument("--out", type=Path, help="output folder (default runs/compare/A_vs_B)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give two run folders or more")
    try:
        c = compare_runs(*args.runs, out=args.out)
    except RunFolderError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    for run in c.runs:
        print(f"{run.label}: {run.path} ({len(run.results)} results files)")
        for problem in run.problems:
            print(f"   note: {problem}")
    n_common = len(c.findings) // len(QUANTITIES)
    n_noise = len(beyond_noise(c.findings, c.runs[0].label))
    print(f"findings in every run: {n_common} ({n_noise} of them changed beyond "
          f"{c.runs[0].label}'s 95% interval); not in every run: {len(c.only_some)}; "
          f"verdicts changed: {len(c.verdicts)}; notebooks whose status differs: "
          f"{len(c.statuses)}; environment facts that differ: "
          f"{', '.join(c.environment.index[c.environment.differs]) or 'none'}")
    for row in c.verdicts.itertuples(index=False):
        print(f"   {row.technique} {row.metric}: {c.runs[0].label} {row[4]}, {row.run} "
              f"{row.other} ({row.why})")
    for path in c.pages.values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
