"""The article's end-to-end checklist, checked against a run's findings.

A technique notebook marks the finding that answers a row of the article's table
with `checklist="<row>:<ttft|tpot>"` (see `Results.add_finding`). Improvements
are read the way the article states them: a TTFT claim of "40-60%" is a cut in
TTFT (-change_pct); a TPOT claim of "50-100%" is a speed-up ("up to 2x faster"),
i.e. baseline/treated - 1. Rows with no finding are reported as missing, never
filled in.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: (row, metric) -> claimed improvement range in %, as in the article's table.
ARTICLE_TABLE: dict[tuple[str, str], tuple[float, float]] = {
    ("chunked prefill", "ttft"): (30, 50),
    ("prefix caching", "ttft"): (40, 60),
    ("quantization", "ttft"): (10, 20),
    ("quantization", "tpot"): (50, 100),
    ("speculative decoding", "tpot"): (50, 100),
    ("streaming", "ttft"): (80, 80),          # perceived latency, "80% lower"
    ("model tiering", "ttft"): (20, 40),
    ("model tiering", "tpot"): (30, 50),
}
EFFORT = {"chunked prefill": "low", "prefix caching": "low", "quantization": "medium",
          "speculative decoding": "medium", "streaming": "low", "model tiering": "medium"}


def improvement_pct(metric: str, baseline: float, treated: float) -> float:
    """The article's notion of improvement: TTFT cut (%) or TPOT speed-up (%)."""
    if baseline is None or treated is None or not baseline or not treated:
        return math.nan
    if metric == "tpot":
        return (baseline / treated - 1.0) * 100.0
    return (baseline - treated) / baseline * 100.0


def improvement_ci(metric: str, change_ci95) -> list[float] | None:
    """A finding's bootstrap interval of the change (%) read the way `measured`
    is: a TTFT cut, or a TPOT speed-up (both increasing in the improvement)."""
    if not change_ci95 or None in change_ci95:
        return None
    lo, hi = (float(x) for x in change_ci95)
    if metric == "tpot":
        if hi <= -100.0:
            return None
        return [100.0 / (1.0 + hi / 100.0) - 100.0, 100.0 / (1.0 + lo / 100.0) - 100.0]
    return [-hi, -lo]


@dataclass
class Verdict:
    verdict: str
    measured_pct: float


def judge(metric: str, finding: dict[str, Any] | None, claim: tuple[float, float]) -> Verdict:
    """confirmed / partly / not reproduced here / missing, for one table cell."""
    if not finding:
        return Verdict("missing", math.nan)
    m = improvement_pct(metric, finding.get("baseline"), finding.get("treated"))
    if math.isnan(m):
        return Verdict("missing", m)
    if finding.get("significant") is False:
        return Verdict("not reproduced here (within noise)", m)
    low = claim[0]
    if m >= low:
        return Verdict("confirmed", m)
    if m > 0:
        return Verdict("partly", m)
    return Verdict("not reproduced here", m)


def collect(results_dir: str | Path) -> list[dict[str, Any]]:
    """Every finding of every notebook in `results_dir`, with its notebook name
    and environment."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(data, dict):  # not a results file
            continue
        env = data.get("environment", {})
        for f in data.get("findings", []):
            out.append({**f, "notebook": data.get("notebook", path.stem),
                        "device": env.get("device"), "model": env.get("served_model_name")})
    return out


def checklist_table(results_dir: str | Path):
    """One row per (technique, metric) of the article's table: claim, measured
    improvement, interval, verdict, notebook and reason."""
    import pandas as pd
    findings = collect(results_dir)
    tagged = {}
    for f in findings:
        if f.get("checklist"):
            row, _, metric = f["checklist"].partition(":")
            tagged.setdefault((row.strip(), metric.strip()), f)
    rows = []
    for (row, metric), claim in ARTICLE_TABLE.items():
        f = tagged.get((row, metric))
        v = judge(metric, f, claim)
        ci = (f or {}).get("change_ci95")
        rows.append({
            "technique": row, "metric": metric.upper(),
            "claimed": f"{claim[0]:g}–{claim[1]:g}%" if claim[0] != claim[1] else f"{claim[0]:g}%",
            "measured": v.measured_pct, "verdict": v.verdict,
            "measured_ci95": improvement_ci(metric, ci), "change_ci95": ci, "effort": EFFORT.get(row, ""),
            "notebook": (f or {}).get("notebook", "—"),
            "reason": (f or {}).get("reason") or _default_reason(f),
        })
    return pd.DataFrame(rows)


def other_claims_table(results_dir: str | Path):
    """Findings outside the article's table (shorter input, warm-up, FP8 KV,
    connection reuse, priority, prefetch, ...): direction and noise."""
    import pandas as pd
    rows = []
    for f in collect(results_dir):
        if f.get("checklist"):
            continue
        ch = f.get("change_pct")
        rows.append({"notebook": f["notebook"], "technique": f.get("technique"),
                     "metric": f.get("metric"), "baseline": f.get("baseline"),
                     "treated": f.get("treated"), "change_pct": ch,
                     "within_noise": f.get("significant") is False,
                     "article_claim": f.get("article_claim")})
    return pd.DataFrame(rows)


def _default_reason(f: dict[str, Any] | None) -> str:
    if not f:
        return "no finding recorded (notebook not run or failed)"
    return f"{f.get('device') or '?'} device, model {f.get('model') or '?'}"
