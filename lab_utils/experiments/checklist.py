"""Experiments of `12_checklist`: every helpful technique combined against an
everything-off baseline on one realistic mixed workload, a goodput-vs-rate
sweep for both, and the one-page summary figure.

The two engines (`plan`) are the baseline and the combined configuration; the
combined arm's flags depend on the findings the checklist reads (only the
techniques that helped on this machine are turned on), so the plan reads them
too, from the same folder as the notebook."""
from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from .. import arms
from ..article_table import checklist_table
from ..client import Load, RequestSpec
from ..metrics import SLO
from ..paths import NOTEBOOKS_DIR
from ..profiles import Profile
from ..results import Results, measure
from ..workloads import (chat, chat_questions, code_edit_prompts, long_documents,
                         system_prompts)

BASELINE, COMBINED = "baseline", "combined"

#: Checklist rows whose technique is a plain engine flag set, and those flags.
TECHNIQUE_FLAGS: dict[str, dict[str, Any]] = {
    "prefix caching": {"enable_prefix_caching": True},
    "chunked prefill": {"enable_chunked_prefill": True},
    "speculative decoding": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_max": 4,
                                                    "prompt_lookup_min": 2}},
}


def baseline_flags(max_model_len: int) -> dict[str, Any]:
    """Everything the article recommends switched off (vLLM V1 turns prefix
    caching and chunked prefill on by default). Without chunking, one step must
    fit a whole prompt: max_num_batched_tokens >= max_model_len."""
    return {"enable_prefix_caching": False, "enable_chunked_prefill": False,
            "max_num_batched_tokens": max_model_len}


def combined_flags(checklist: pd.DataFrame, max_model_len: int) -> tuple[dict[str, Any], list[str]]:
    """The baseline with every flag technique that this run found helpful
    (verdict confirmed or partly) turned on; returns (flags, chosen rows)."""
    flags = baseline_flags(max_model_len)
    chosen = []
    for row, extra in TECHNIQUE_FLAGS.items():
        verdicts = checklist[checklist.technique == row].verdict
        if any(v in ("confirmed", "partly") for v in verdicts):
            flags.update(extra)
            chosen.append(row)
    return flags, chosen


def findings_source(params: Mapping[str, Any]) -> Path:
    """The results folder whose findings fill the checklist: `findings_dir`, or
    this run's `results_dir` (relative ones from the notebooks folder, as
    `lab.setup` resolves `results_dir`)."""
    folder = Path(params.get("findings_dir") or params.get("results_dir", "results"))
    return folder if folder.is_absolute() else (NOTEBOOKS_DIR / folder).resolve()


def plan(profile: Profile, params: Mapping[str, Any],
         checklist: pd.DataFrame | None = None) -> arms.Plan:
    """The baseline (`baseline_flags` for the profile's max_model_len) and the
    combined configuration (`combined_flags` of the checklist read from
    `findings_source(params)`, or `checklist`). When nothing helped, the
    combined arm would be the baseline engine again: it is left out, with a note."""
    max_len = int(profile.engine.get("max_model_len", 4096))
    if checklist is None:
        checklist = checklist_table(findings_source(params))
    flags, chosen = combined_flags(checklist, max_len)
    baseline = arms.Arm(BASELINE, baseline_flags(max_len),
                        title="everything the article recommends switched off")
    if not chosen:
        return arms.Plan("12_checklist", (baseline,), notes=(
            f"arm {COMBINED!r} left out: no flag technique ({', '.join(TECHNIQUE_FLAGS)}) "
            "helped in the findings read, so it would equal the baseline",))
    # The article's combined checklist: every technique that helped, turned on
    # at once. It changes several knobs against the baseline by design: that
    # comparison is this notebook's point.
    knob = tuple(name for row in chosen for name in TECHNIQUE_FLAGS[row])
    combined = arms.Arm(COMBINED, flags, knob=knob, title="combined: " + ", ".join(chosen))
    return arms.Plan("12_checklist", (baseline, combined))


def chosen_techniques(plan: arms.Plan) -> list[str]:
    """The checklist rows whose flags the plan's combined arm turns on ([]
    when the plan has no combined arm)."""
    if COMBINED not in plan.names:
        return []
    flags = plan.arm(COMBINED).flags
    return [row for row, extra in TECHNIQUE_FLAGS.items()
            if all(flags.get(k) == v for k, v in extra.items())]


def mixed_workload(n: int, *, seed: int = 0, long_share: float = 0.15,
                   code_share: float = 0.15) -> list[RequestSpec]:
    """Chat questions behind the shared 512-token system prompt, with some
    long documents (prefill-heavy) and some code edits (decode-heavy) mixed in."""
    rng = random.Random(seed)
    system = system_prompts()["long"]
    qs, docs, edits = chat_questions(), long_documents(), code_edit_prompts()
    specs = []
    for _ in range(n):
        u = rng.random()
        if u < long_share:
            d = rng.choice(docs)
            specs.append(RequestSpec(messages=chat(d["text"][:6000] + "\n\nSummarize this in one "
                                                   "sentence."), max_tokens=32, tag="long_doc"))
        elif u < long_share + code_share:
            e = rng.choice(edits)
            specs.append(RequestSpec(messages=chat(f"{e['instruction']}\n\n```{e['language']}\n"
                                                   f"{e['code']}\n```"),
                                     max_tokens=96, tag="code_edit"))
        else:
            specs.append(RequestSpec(messages=chat(rng.choice(qs)["question"], system),
                                     max_tokens=32, tag="chat"))
    return specs


def goodput_sweep(engine, arm: str, rates: Sequence[float], requests_per_rate: int, *,
                  seed: int = 0, slo: SLO | None = None, results: Results | None = None,
                  progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The mixed workload at each Poisson request rate: (one row per rate,
    one row per request)."""
    slo = slo or SLO()
    rows, frames = [], []
    for rate in rates:
        specs = mixed_workload(requests_per_rate, seed=seed + int(rate * 1000))
        run = measure(engine, specs, Load.poisson(rate, seed=seed), label=f"{arm},rate={rate}",
                      results=results, slo=slo, progress=progress)
        s = run.summary(slo)
        rows.append({"arm": arm, "rate": rate, "goodput": s["goodput"],
                     "slo_met_fraction": s["slo_met_fraction"],
                     "ttft_ms_median": s["ttft_ms_median"], "ttft_ms_p99": s["ttft_ms_p99"],
                     "tpot_ms_median": s["tpot_ms_median"], "tpot_ms_p99": s["tpot_ms_p99"],
                     "prefix_cache_hit_rate": run.counters["prefix_cache_hit_rate"],
                     "spec_acceptance": run.counters["spec_decode_acceptance_rate"],
                     "preemptions": run.counters["preemptions"]})
        frames.append(run.frame().assign(arm=arm, rate=rate))
    return pd.DataFrame(rows), pd.concat(frames, ignore_index=True)


def sweep_arms(ctx, rates: Sequence[float], requests_per_rate: int, *, seed: int = 0,
               progress: bool = True) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """`goodput_sweep` on each arm of the plan, the combined arm first so the
    baseline engine is still up for the cross-check after it. Returns (one row
    per arm and rate, one row per request), None when no arm ran."""
    order = [a for a in (COMBINED, BASELINE) if a in ctx.plan.names]
    got = arms.run(ctx, order, lambda a, engine: goodput_sweep(
        engine, a.name, rates, requests_per_rate, seed=seed, results=ctx.results,
        progress=progress))
    if not got:
        return None, None
    sweep = pd.concat([rows for rows, _ in got.values()], ignore_index=True)
    return (sweep.sort_values(["arm", "rate"], ignore_index=True),
            pd.concat([reqs for _, reqs in got.values()], ignore_index=True))


def findings(sweep: pd.DataFrame | None, chosen: Sequence[str]) -> list[dict[str, Any]]:
    """`Results.add_finding` arguments: the combined configuration against the
    baseline at the highest rate of the sweep (p99 TTFT and TPOT, goodput),
    with the combined arm's prefix-cache hit rate and speculative acceptance
    as the mechanism; none unless both arms ran."""
    if sweep is None or set(sweep.arm) != {BASELINE, COMBINED}:
        return []
    top = sweep.rate.max()
    b, c = (sweep[(sweep.arm == a) & (sweep.rate == top)].iloc[0] for a in (BASELINE, COMBINED))
    return [{"technique": "combined configuration",
             "metric": f"{metric} at {top} req/s, mixed workload",
             "baseline": b[metric], "treated": c[metric],
             "article_claim": "the checklist's techniques combine",
             "mechanism": f"combined = {list(chosen)}; prefix-cache hit rate "
                          f"{c.prefix_cache_hit_rate or 0:.0%}, spec acceptance "
                          f"{c.spec_acceptance or 0:.0%}"}
            for metric in ("ttft_ms_p99", "tpot_ms_p99", "goodput")]


def explore(ctx, arm: str, rates: Sequence[float], requests_per_rate: int, *,
            seed: int = 0) -> pd.DataFrame | None:
    """The goodput sweep of one planned arm at other rates (not recorded)."""
    engine = ctx.arm(arm)
    if engine is None:  # ctx.arm printed why
        return None
    return goodput_sweep(engine, arm, list(rates), requests_per_rate, seed=seed)[0]


def summary_figure(checklist: pd.DataFrame, sweep: pd.DataFrame, crosscheck: dict | None = None,
                   save_to=None):
    """One page: claimed vs measured per checklist row, goodput vs rate, and
    TTFT/TPOT p99 of both configurations."""
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns

    fig = plt.figure(figsize=(14, 8.5))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.1, 1])
    ax = fig.add_subplot(grid[0, :])
    labels = [f"{t} · {m}" for t, m in zip(checklist.technique, checklist.metric)]
    y = np.arange(len(labels))
    lo = checklist.claimed.str.extract(r"([\d.]+)")[0].astype(float)
    hi = checklist.claimed.str.extract(r"([\d.]+)%?$")[0].astype(float)
    ax.barh(y, hi - lo + 0.8, left=lo - 0.4, color="#c7d7ee", label="article's claim")
    measured = checklist.measured.astype(float)
    colors = {"confirmed": "#2a9d4b", "partly": "#e0a100", "missing": "#999999"}
    for i, (m, v) in enumerate(zip(measured, checklist.verdict)):
        if np.isfinite(m):
            ax.plot(np.clip(m, -100, 400), i, "o", ms=10, color=colors.get(v, "#c0392b"))
            ax.annotate(f"{m:+.0f}% ({v})", (np.clip(m, -100, 400), i), xytext=(8, -4),
                        textcoords="offset points", fontsize=9)
        else:
            ax.annotate("missing", (0, i), xytext=(8, -4), textcoords="offset points",
                        fontsize=9, color="#777777")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel("improvement (%): TTFT cut, or TPOT speed-up")
    ax.set_title("The article's checklist on this machine (dots: measured; bars: claimed)")
    from matplotlib.lines import Line2D
    ax.legend(handles=[ax.patches[0]] + [Line2D([], [], marker="o", ls="", color=c, label=k)
                                          for k, c in colors.items()] +
              [Line2D([], [], marker="o", ls="", color="#c0392b", label="not reproduced")],
              loc="lower right", fontsize=8)
    ax2 = fig.add_subplot(grid[1, 0])
    sns.lineplot(data=sweep, x="rate", y="goodput", hue="arm", marker="o", ax=ax2)
    ax2.set_xlabel("offered load (requests/s)")
    ax2.set_ylabel("goodput (requests/s within SLO)")
    ax2.set_title("Goodput vs request rate (SLO: TTFT ≤ 2 s, TPOT ≤ 50 ms)")
    ax3 = fig.add_subplot(grid[1, 1])
    long = sweep.melt(id_vars=["arm", "rate"], value_vars=["ttft_ms_p99", "tpot_ms_p99"],
                      var_name="metric", value_name="ms")
    sns.barplot(data=long, x="metric", y="ms", hue="arm", ax=ax3, errorbar=None)
    ax3.set_yscale("log")
    ax3.set_xlabel("")
    ax3.set_ylabel("p99 latency, mean over rates (ms, log)")
    title = "Tails: baseline vs combined"
    if crosscheck:
        med = [r for r in crosscheck["rows"] if r["stat"] == "median"]
        worst = max(abs(r["diff_pct"]) for r in med)
        title += f"\n(client vs vllm bench serve: medians within {worst:.1f}%)"
    ax3.set_title(title)
    fig.suptitle("vLLM Latency Lab: what held on this machine", fontsize=15)
    fig.tight_layout()
    if save_to:
        fig.savefig(save_to, dpi=110, bbox_inches="tight")
    return fig


__all__ = ["BASELINE", "COMBINED", "TECHNIQUE_FLAGS", "baseline_flags", "checklist_table",
           "chosen_techniques", "combined_flags", "explore", "findings", "findings_source",
           "goodput_sweep", "mixed_workload", "plan", "summary_figure", "sweep_arms"]
