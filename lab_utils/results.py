"""The results contract every notebook writes, and the measuring step that fills it.

`<results_dir>/<notebook>.json` holds the engines (exact command lines), the
environment, per-arm summaries with counter deltas, and findings
`{technique, metric, baseline, treated, change_pct, article_claim, mechanism}`.
Per-request records go to `<results_dir>/<notebook>/<arm>.jsonl`. The JSON is
rewritten after every arm and finding, so an interrupted notebook keeps them.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .client import Client, Load, RequestSpec, Run
from .counters import delta, scrape
from .errors import ServerError
from .http import http_get
from .machine import machine_info
from .metrics import SLO, bootstrap_change_pct, change_pct


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")[:120] or "arm"


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _is_number(value: Any) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def environment(engine=None) -> dict[str, Any]:
    """Device, versions and host facts for the results file; `machine` names the
    CPU, its ISA extensions, memory, cores and the engine's thread binding."""
    local_env = engine.server.env if engine is not None and engine.server is not None else None
    machine = machine_info(local_env)
    env: dict[str, Any] = {k: machine[k] for k in ("python", "platform", "cpu_count", "hostname",
                                                   "vllm_version")}
    env["machine"] = machine
    if engine is not None:
        env.update(profile=engine.profile.name, device=engine.profile.device,
                   model=engine.model_path or engine.model, served_model_name=engine.model)
        if engine.server is None:  # remote: ask the server itself
            try:
                status, body = http_get(engine.base_url + "/version", api_key=engine.api_key)
                if status == 200:
                    env["server_vllm_version"] = json.loads(body).get("version")
            except OSError:
                pass
    return env


class Results:
    """Collects one notebook's arms and findings and writes them as it goes."""

    def __init__(self, notebook: str, results_dir: str | Path, profile: str = ""):
        self.notebook = notebook
        self.dir = Path(results_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"{notebook}.json"
        self.data: dict[str, Any] = {
            "notebook": notebook, "profile": profile,
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "environment": environment(), "engines": [], "arms": {}, "findings": [],
            "notes": []}

    # -- writing --------------------------------------------------------
    def records_path(self, label: str) -> Path:
        path = self.dir / self.notebook / f"{_slug(label)}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def add_engine(self, engine) -> None:
        desc = engine.describe()
        arm = getattr(engine, "arm", None)
        if arm:  # the plan's arm it serves (lab_utils.arms), or "explore"
            desc["arm"] = arm
        if not any(e["command"] == desc["command"] for e in self.data["engines"]):
            self.data["engines"].append(desc)
            self.data["environment"] = environment(engine)
            self.save()

    def add_app(self, app) -> None:
        """An app the notebook started (`AppServer.describe()`), under "apps"."""
        self.data.setdefault("apps", []).append(app.describe())
        self.save()

    def add_arm(self, label: str, run: Run, slo: SLO | None = None, **extra: Any) -> dict[str, Any]:
        arm = {"load": run.load, "summary": run.summary(slo), "counters": run.counters,
               "records": str(self.records_path(label).relative_to(self.dir)), **extra}
        self.data["arms"][label] = arm
        self.save()
        return arm

    def add_run(self, run: Run, slo: SLO | None = None, **extra: Any) -> dict[str, Any]:
        """An arm timed outside `measure` (labelled `run.label`): its records
        written to the arm's JSONL file, then recorded as `add_arm` does."""
        with open(self.records_path(run.label), "w") as out:
            out.writelines(json.dumps(r.to_json()) + "\n" for r in run.records)
        return self.add_arm(run.label, run, slo, **extra)

    def add_finding(self, technique: str, metric: str, baseline: float, treated: float,
                    article_claim: str, mechanism: str, *, samples: tuple | None = None,
                    stat: str = "median", checklist: str | None = None,
                    why_missing: str | None = None, **extra: Any) -> dict[str, Any]:
        """Record one measured effect beside the article's claim.

        `samples=(baseline_values, treated_values)` adds a 95% bootstrap interval
        of the change of `stat` and whether it excludes zero (`significant`).
        `checklist="<row>:<ttft|tpot>"` marks the finding the checklist notebook
        uses for a row of the article's table (e.g. "prefix caching:ttft").
        A finding without a baseline or treated value is noted, not recorded:
        `why_missing` says why when both arms ran and the value is undefined
        (e.g. no goodput knee: nothing met the SLO), else the note says an arm
        did not run."""
        finding = {"technique": technique, "metric": metric, "baseline": baseline,
                   "treated": treated, "change_pct": change_pct(baseline, treated),
                   "article_claim": article_claim, "mechanism": mechanism, **extra}
        if checklist is not None:
            from .article_table import ARTICLE_TABLE
            row, _, column = checklist.rpartition(":")
            if (row, column) not in ARTICLE_TABLE:
                rows = sorted(f"{r}:{m}" for r, m in ARTICLE_TABLE)
                raise ValueError(f"checklist={checklist!r} is not a row of the article's table; "
                                 f"use one of {rows} (or leave checklist out)")
            finding["checklist"] = checklist
        missing = [k for k in ("baseline", "treated") if not _is_number(finding[k])]
        if missing:  # an arm did not run: a finding without values would read as measured
            self.note(f"not recorded: {technique} / {metric}: no {' and no '.join(missing)} "
                      f"value ({why_missing or 'an arm did not run here'})")
            return {**_clean(finding), "recorded": False}
        if samples is not None:
            lo, hi = bootstrap_change_pct(*samples, stat=stat)
            finding.update(change_ci95=[lo, hi], n_samples=[len(samples[0]), len(samples[1])],
                           significant=bool(lo > 0 or hi < 0) if math.isfinite(lo) else None)
        self.data["findings"].append(finding)
        self.save()
        return _clean(finding)

    def add_findings(self, findings: Iterable[Mapping[str, Any]]):
        """Record each finding of an experiment module's `findings(...)` (a list
        of `add_finding` keyword sets: the one way notebooks record findings)
        and return the findings table."""
        for finding in findings:
            self.add_finding(**finding)
        return self.findings_frame()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def save(self) -> Path:
        self.data["updated"] = _dt.datetime.now().isoformat(timespec="seconds")
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_clean(self.data), indent=2))
        tmp.replace(self.path)  # atomic: a crash never leaves half a file
        return self.path

    # -- reading --------------------------------------------------------
    def iter_records(self):
        """Every per-request record (dict) this notebook has written so far."""
        for path in sorted((self.dir / self.notebook).glob("*.jsonl")):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)

    def findings_frame(self):
        """One row per finding; with none recorded (every treated arm skipped),
        an empty frame that still has the finding columns."""
        import pandas as pd
        columns = ["technique", "metric", "baseline", "treated", "change_pct",
                   "article_claim", "mechanism"]
        frame = pd.DataFrame(_clean(self.data["findings"]))
        return frame if len(frame) else pd.DataFrame(columns=columns)

    def arms_frame(self, columns: Sequence[str] = ("ttft_ms_median", "ttft_ms_p99",
                                                   "tpot_ms_median", "tpot_ms_p99",
                                                   "e2e_ms_median", "output_throughput")):
        import pandas as pd
        rows = {label: {c: arm["summary"].get(c) for c in columns}
                for label, arm in self.data["arms"].items()}
        return pd.DataFrame.from_dict(rows, orient="index")


def measure(engine, specs: Sequence[RequestSpec], load: Load = Load(), *, label: str,
            results: Results | None = None, slo: SLO | None = None, progress: bool = True,
            client: Client | None = None, **extra: Any) -> Run:
    """Run `specs` against `engine`, with counter deltas and records saved.

    Scrapes /metrics before and after, streams the records into the arm's
    JSONL file as they arrive, and adds the arm to `results`. `client`
    replaces the plain client of `engine` (e.g. a `tiering.TieredClient`)."""
    client = client or Client.for_engine(engine)
    jsonl = results.records_path(label) if results else None
    if jsonl is not None and jsonl.exists():
        jsonl.unlink()  # a re-run of the same arm replaces its records
    before = scrape(engine.base_url, engine.api_key)
    run = client.run(specs, load, label=label, jsonl=jsonl, progress=progress)
    failed = [r for r in run.records if not r.ok]
    try:
        run.counters = delta(before, scrape(engine.base_url, engine.api_key))
    except OSError as exc:  # the server went away during the run
        if results is not None:
            results.add_arm(label, run, slo, engine=engine.label, error=str(exc))
        tail = engine.server.log_tail(15) if engine.server else ""
        raise ServerError(
            f"the server at {engine.base_url} stopped answering during {label!r}: "
            f"{len(failed)} of {len(run.records)} requests failed (first error: "
            f"{failed[0].error if failed else 'none'}). The records measured so far are kept"
            f"{' in ' + str(jsonl) if jsonl else ''}.\n--- server log tail ---\n{tail}") from exc
    if results is not None:
        results.add_engine(engine)
        results.add_arm(label, run, slo, engine=engine.label, **extra)
    if failed and len(failed) == len(run.records):
        raise RuntimeError(f"every request of {label!r} failed; first error: {failed[0].error}")
    return run
