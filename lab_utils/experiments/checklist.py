"""Experiments of `12_checklist`: every helpful technique combined against an
everything-off baseline on one realistic mixed workload, a goodput-vs-rate
sweep for both, and the one-page summary figure.

The two engines (`plan`) are the baseline and the combined configuration; the
combined arm's flags depend on the findings the checklist reads (only the
techniques that helped on this machine are turned on), so the plan reads them
too, from the same folder as the notebook."""
from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from .. import arms
from ..article_table import checklist_table
from ..capacity import (
    DEFAULT_TARGET,
    Capacity,
    goodput_knee,
    knee_ratio_ci,
    probe_capacity,
)
from ..client import Load, RequestSpec
from ..metrics import SLO
from ..paths import NOTEBOOKS_DIR
from ..profiles import Profile
from ..results import Results, measure
from ..speculation import ngram_config, ngram_method
from ..workloads import (chat, chat_questions, code_edit_prompts, long_documents,
                         system_prompts)

BASELINE, COMBINED = "baseline", "combined"

#: Checklist rows whose technique is a plain engine flag set, and those flags
#: (on the cpu profile: `technique_flags` gives each profile's).
TECHNIQUE_FLAGS: dict[str, dict[str, Any]] = {
    "prefix caching": {"enable_prefix_caching": True},
    "chunked prefill": {"enable_chunked_prefill": True},
    "speculative decoding": {"speculative_config": ngram_config(4, 4, 2)},
}
#: The notebook whose plan says which budget its chunked-prefill finding measured.
CHUNKED_PREFILL = "01_chunked_prefill"


def chunk_budget(params: Mapping[str, Any]) -> int:
    """The combined arm's max_num_batched_tokens: the smallest chunked budget
    of 01's plan in the findings folder (the arm its checklist finding
    compares with off), else the smallest of 01's default `budgets`. Either
    lies below the long documents of `mixed_workload` (~1,500 tokens), so
    their prefill is split into chunks between the other requests' decodes."""
    try:
        plan = json.loads((findings_source(params) / f"{CHUNKED_PREFILL}.json").read_text())["plan"]
        budgets = [json.loads(a["flags"]).get("max_num_batched_tokens") for a in plan["arms"]
                   if json.loads(a["flags"]).get("enable_chunked_prefill")
                   and "long_prefill_token_threshold" not in json.loads(a["flags"])]
    except (OSError, ValueError, KeyError, TypeError):
        budgets = []
    if not [b for b in budgets if b]:
        from ..notebook import parameter_defaults
        budgets = parameter_defaults(f"{CHUNKED_PREFILL}.ipynb")["budgets"]
    return int(min(b for b in budgets if b))


def technique_flags(profile: Profile, budget: int) -> dict[str, dict[str, Any]]:
    """`TECHNIQUE_FLAGS` on this profile: chunked prefill at `budget` tokens
    per step (at max_model_len, as the baseline keeps it, no prompt would be
    split), and n-gram speculation with the profile's method ("ngram_gpu" on
    cuda, which keeps vLLM's async scheduling as in the baseline)."""
    return {**TECHNIQUE_FLAGS,
            "chunked prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": budget},
            "speculative decoding": {"speculative_config": ngram_config(
                4, 4, 2, method=ngram_method(profile))}}


def baseline_flags(max_model_len: int) -> dict[str, Any]:
    """Everything the article recommends switched off (vLLM V1 turns prefix
    caching and chunked prefill on by default). Without chunking, one step must
    fit a whole prompt: max_num_batched_tokens >= max_model_len."""
    return {"enable_prefix_caching": False, "enable_chunked_prefill": False,
            "max_num_batched_tokens": max_model_len}


def combined_flags(checklist: pd.DataFrame, max_model_len: int,
                   techniques: Mapping[str, Mapping[str, Any]] | None = None
                   ) -> tuple[dict[str, Any], list[str]]:
    """The baseline with every flag technique that this run found helpful
    (verdict confirmed or partly) turned on, each with its flags in
    `techniques` (default `TECHNIQUE_FLAGS`); returns (flags, chosen rows)."""
    flags = baseline_flags(max_model_len)
    chosen = []
    for row, extra in (techniques or TECHNIQUE_FLAGS).items():
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
    `findings_source(params)`, or `checklist`, with the profile's
    `technique_flags`: chunked prefill at 01's `chunk_budget`). When nothing
    helped, the combined arm would be the baseline engine again: it is left
    out, with a note."""
    max_len = int(profile.engine.get("max_model_len", 4096))
    if checklist is None:
        checklist = checklist_table(findings_source(params))
    techniques = technique_flags(profile, chunk_budget(params))
    flags, chosen = combined_flags(checklist, max_len, techniques)
    baseline = arms.Arm(BASELINE, baseline_flags(max_len),
                        title="everything the article recommends switched off")
    if not chosen:
        return arms.Plan("12_checklist", (baseline,), notes=(
            f"arm {COMBINED!r} left out: no flag technique ({', '.join(TECHNIQUE_FLAGS)}) "
            "helped in the findings read, so it would equal the baseline",))
    # The article's combined checklist: every technique that helped, turned on
    # at once. It changes several knobs against the baseline by design: that
    # comparison is this notebook's point.
    knob = tuple(dict.fromkeys(name for row in chosen for name in techniques[row]))
    combined = arms.Arm(COMBINED, flags, knob=knob, title="combined: " + ", ".join(chosen))
    return arms.Plan("12_checklist", (baseline, combined))


def chosen_techniques(plan: arms.Plan) -> list[str]:
    """The checklist rows whose flags the plan's combined arm turns on ([]
    when the plan has no combined arm)."""
    if COMBINED not in plan.names:
        return []
    flags = plan.arm(COMBINED).flags
    return [row for row, extra in TECHNIQUE_FLAGS.items()
            if all(flags.get(k) not in (None, False) for k in extra)]


def mixed_workload(n: int, *, seed: int = 0, long_share: float = 0.15,
                   code_share: float = 0.15, mix_seed: int | None = None) -> list[RequestSpec]:
    """Chat questions behind the shared 512-token system prompt, with some
    long documents (prefill-heavy) and some code edits (decode-heavy) mixed in.
    `mix_seed` fixes which request is of which kind (default: `seed`), so that
    runs with other `seed`s send other text in the same composition."""
    rng = random.Random(seed)
    kinds = random.Random(seed if mix_seed is None else mix_seed)
    system = system_prompts()["long"]
    qs, docs, edits = chat_questions(), long_documents(), code_edit_prompts()
    specs = []
    for _ in range(n):
        u = kinds.random()
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


def _sweep_point(arm: str, rate: float, load: str, run, slo: SLO
                 ) -> tuple[dict[str, Any], pd.DataFrame]:
    """One point of a goodput sweep: its row, and its requests with `slo_met`."""
    s = run.summary(slo)
    row = {"arm": arm, "rate": rate, "load": load, "goodput": s["goodput"],
           "slo_met_fraction": s["slo_met_fraction"],
           "ttft_ms_median": s["ttft_ms_median"], "ttft_ms_p99": s["ttft_ms_p99"],
           "tpot_ms_median": s["tpot_ms_median"], "tpot_ms_p99": s["tpot_ms_p99"],
           "prefix_cache_hit_rate": run.counters["prefix_cache_hit_rate"],
           "spec_acceptance": run.counters["spec_decode_acceptance_rate"],
           "preemptions": run.counters["preemptions"]}
    return row, run.frame().assign(arm=arm, rate=rate,
                                   slo_met=[slo.met(r) for r in run.records])


def goodput_sweep(engine, arm: str, rates: Sequence[float], requests_per_rate: int, *,
                  seed: int = 0, slo: SLO | None = None, results: Results | None = None,
                  progress: bool = True, synchronous: tuple[float, Any] | None = None
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The mixed workload at each Poisson request rate: (one row per rate,
    one row per request, with `slo_met`). `synchronous` = (its rate, its run):
    the capacity probe's one-at-a-time run, the sweep's first point."""
    if not rates and synchronous is None:
        raise ValueError("no load to sweep: choose at least one request rate (req/s)")
    slo = slo or SLO()
    points = []
    if synchronous is not None:
        points.append(_sweep_point(arm, synchronous[0], "synchronous", synchronous[1], slo))
    for rate in rates:
        # Other text at each rate (no prefix-cache hits across rates), the same
        # mix of request kinds: the curve shows load, not a different workload.
        specs = mixed_workload(requests_per_rate, seed=seed + int(rate * 1000), mix_seed=seed)
        run = measure(engine, specs, Load.poisson(rate, seed=seed), label=f"{arm},rate={rate}",
                      results=results, slo=slo, progress=progress)
        points.append(_sweep_point(arm, rate, "poisson", run, slo))
    return (pd.DataFrame([row for row, _ in points]),
            pd.concat([frame for _, frame in points], ignore_index=True))


def arm_capacity(ctx, engine, arm: str, *, seed: int = 0, budget_s: float = 90.0,
                 sequential: int = 8, progress: bool = True) -> tuple[Capacity, Any]:
    """The engine's capacity on the mixed workload (`lab_utils.capacity`:
    `sequential` requests one at a time, then 8 in flight), and its
    one-at-a-time run, kept as the sweep's first point: recorded as arm
    `<arm>,synchronous` with its counters. The mix of request kinds is the
    sweep's (`mix_seed`), the text another."""
    slo = SLO()

    def run(specs, load, phase):
        label = f"{arm},synchronous" if phase == "sequential" else f"{arm},saturated"
        return measure(engine, specs, load, label=label, results=ctx.results, slo=slo,
                       progress=progress)

    cap, seq, _ = probe_capacity(engine, lambda n, s: mixed_workload(n, seed=seed + s,
                                                                     mix_seed=seed),
                                 workload=f"12 mixed workload, seed {seed}", budget_s=budget_s,
                                 sequential=sequential, run=run, results=ctx.results,
                                 progress=progress)
    return cap, seq


def sweep_arms(ctx, rates: Sequence[float], requests_per_rate: int, *, points: int = 4,
               budget_s: float = 90.0, seed: int = 0, progress: bool = True
               ) -> tuple[pd.DataFrame | None, pd.DataFrame | None, dict[str, Capacity]]:
    """`goodput_sweep` on each arm of the plan, the combined arm first so the
    baseline engine is still up for the cross-check after it. With `rates`
    empty, each arm's sweep is placed from its own measured capacity, as
    GuideLLM's `sweep` places it: its first point is the capacity probe's
    synchronous run (`requests_per_rate` requests one at a time: the lightest
    load), then `points - 1` Poisson rates evenly above it up to 1.3x the
    saturation throughput: the curve then spans its knee on any machine.
    Returns (one row per arm and point, one row per request, each arm's
    capacity); None frames when no arm ran."""
    order = [a for a in (COMBINED, BASELINE) if a in ctx.plan.names]
    capacities: dict[str, Capacity] = {}

    def one(a, engine):
        if rates:
            return goodput_sweep(engine, a.name, list(rates), requests_per_rate, seed=seed,
                                 results=ctx.results, progress=progress)
        cap, sync = arm_capacity(ctx, engine, a.name, seed=seed, budget_s=budget_s,
                                 sequential=requests_per_rate, progress=progress)
        capacities[a.name] = cap
        grid = cap.rates_above_sync(points)
        print(f"[{a.name}] {cap.describe()}\n[{a.name}] sweep: one at a time "
              f"({cap.sync_rate:.3g} req/s), then Poisson {grid} req/s")
        return goodput_sweep(engine, a.name, grid, requests_per_rate, seed=seed,
                             results=ctx.results, progress=progress,
                             synchronous=(float(f"{cap.sync_rate:.3g}"), sync))

    got = arms.run(ctx, order, one)
    if not got:
        return None, None, capacities
    sweep = pd.concat([rows for rows, _ in got.values()], ignore_index=True)
    return (sweep.sort_values(["arm", "rate"], ignore_index=True),
            pd.concat([reqs for _, reqs in got.values()], ignore_index=True), capacities)


def knees(sweep: pd.DataFrame | None, target: float = DEFAULT_TARGET) -> pd.DataFrame:
    """Per arm: the goodput knee (`capacity.goodput_knee`: the highest rate that
    keeps at least `target` of the SLO attainment of light load, its lowest
    rate) and whether the sweep passed it (False: the knee is at or beyond the
    highest rate tried)."""
    rows = []
    for arm, g in (sweep.groupby("arm") if sweep is not None else []):
        knee, reached = goodput_knee(g.rate, g.slo_met_fraction, target)
        rows.append({"arm": arm, "knee_rate": knee if knee is not None else math.nan,
                     "passed_the_knee": reached, "rates": list(g.rate)})
    return pd.DataFrame(rows, columns=["arm", "knee_rate", "passed_the_knee", "rates"]
                        ).set_index("arm")


def findings(sweep: pd.DataFrame | None, chosen: Sequence[str],
             requests: pd.DataFrame | None = None,
             capacities: Mapping[str, Capacity] | None = None,
             target: float = DEFAULT_TARGET) -> list[dict[str, Any]]:
    """`Results.add_finding` arguments, baseline -> combined, none unless both
    arms ran: the goodput knee (with the bootstrap interval of the knees'
    ratio, from `requests`' per-request `slo_met`), and, when measured, the
    saturation throughput and the one-at-a-time latency of the capacity probe.
    The mechanism cites the combined arm's prefix-cache hit rate and
    speculative acceptance over the sweep."""
    if sweep is None or set(sweep.arm) != {BASELINE, COMBINED}:
        return []
    k = knees(sweep, target)
    c = sweep[sweep.arm == COMBINED]
    why = (f"combined = {list(chosen)}; prefix-cache hit rate "
           f"{c.prefix_cache_hit_rate.fillna(0).mean():.0%}, spec acceptance "
           f"{c.spec_acceptance.astype(float).fillna(0).mean():.0%} over the sweep")
    claim = "the checklist's techniques combine"
    extra: dict[str, Any] = {}
    if requests is not None and "slo_met" in requests:
        per = {arm: {r: g.slo_met.tolist() for r, g in requests[requests.arm == arm].groupby("rate")}
               for arm in (BASELINE, COMBINED)}
        ratio, lo, hi = knee_ratio_ci(per[BASELINE], per[COMBINED], target=target)
        extra = {"knee_ratio": ratio, "knee_ratio_ci95": [lo, hi]}
        if not math.isfinite(ratio):
            why += "; knee ratio undefined (an arm has no knee)"
        elif not math.isfinite(lo):
            why += (f"; knee ratio {ratio:.2f}x (no 95% CI: under half the resamples "
                    "define both knees)")
        else:
            why += f"; knee ratio {ratio:.2f}x (95% CI {lo:.2f}-{hi:.2f})"
    bound = [a for a in (BASELINE, COMBINED) if not k.loc[a, "passed_the_knee"]]
    if bound:
        why += f"; {' and '.join(bound)}: every rate met the SLO, the knee is a lower bound"
    slo = SLO()

    def lightest(a: str) -> str:
        g = sweep[sweep.arm == a].sort_values("rate")
        one_at_a_time = "load" in g and g.load.iloc[0] == "synchronous"
        return (f"{'sent one at a time' if one_at_a_time else 'at its lightest rate'} "
                f"({g.rate.iloc[0]:g} req/s)")

    kneeless = [f"none of the {a} arm's requests {lightest(a)} met the SLO (TTFT <= "
                f"{slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1e3:g} ms)" for a in (BASELINE, COMBINED)
                if math.isnan(k.loc[a, "knee_rate"])]
    extra_missing = ({"why_missing": "; ".join(kneeless) + ": no knee to compare"}
                     if kneeless else {})
    out = [{"technique": "combined configuration",
            "metric": f"goodput knee (req/s): highest rate keeping >= {target:.0%} of the "
                      "light-load SLO attainment, mixed workload",
            "baseline": k.loc[BASELINE, "knee_rate"], "treated": k.loc[COMBINED, "knee_rate"],
            "article_claim": claim, "mechanism": why,
            "knee_passed": {a: bool(k.loc[a, "passed_the_knee"]) for a in (BASELINE, COMBINED)},
            **extra, **extra_missing}]
    if capacities and {BASELINE, COMBINED} <= set(capacities):
        b, t = capacities[BASELINE], capacities[COMBINED]
        out += [{"technique": "combined configuration",
                 "metric": f"saturation throughput (req/s), {b.concurrency} in flight, "
                           "mixed workload", "baseline": b.max_rate, "treated": t.max_rate,
                 "article_claim": claim,
                 "mechanism": f"capacity probe: {b.requests} and {t.requests} requests"},
                {"technique": "combined configuration",
                 "metric": "one request at a time: E2E median (ms), mixed workload",
                 "baseline": b.sync_e2e_s * 1e3, "treated": t.sync_e2e_s * 1e3,
                 "article_claim": claim, "mechanism": why}]
    return out


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
    from matplotlib.patches import Patch
    dots = [Line2D([], [], marker="o", ls="", color=c, label=k) for k, c in colors.items()]
    ax.legend(handles=[Patch(color="#c7d7ee", label="article's claim"), *dots,
                       Line2D([], [], marker="o", ls="", color="#c0392b", label="not reproduced")],
              loc="lower right", fontsize=8)
    ax2 = fig.add_subplot(grid[1, 0])
    knee = knees(sweep) if len(sweep) and "slo_met_fraction" in sweep else pd.DataFrame()
    palette = dict(zip(sorted(set(sweep.arm)), sns.color_palette(n_colors=max(1, sweep.arm.nunique()))))
    for arm, g in sweep.groupby("arm"):
        ax2.plot(g.rate, g.goodput, "o-", color=palette[arm], label=arm)
        sync = g[g.load == "synchronous"] if "load" in g else g.iloc[:0]
        if len(sync):  # the capacity probe's run: requests one at a time, not Poisson
            ax2.plot(sync.rate, sync.goodput, "s", ms=10, mfc="white", color=palette[arm],
                     label=f"{arm}: one at a time")
        k = knee.knee_rate.get(arm, np.nan) if len(knee) else np.nan
        if np.isfinite(k):
            more = "" if knee.loc[arm, "passed_the_knee"] else " (or more)"
            ax2.axvline(k, color=palette[arm], ls="--", lw=1,
                        label=f"{arm} knee {k:.2g} req/s{more}")
    if len(sweep):
        top = float(sweep.rate.max())
        ax2.plot([0, top], [0, top], ls=":", color="#888888", label="all requests within SLO")
        ax2.legend(fontsize=8)
    ax2.set_xlabel("offered load (requests/s)")
    ax2.set_ylabel("goodput (requests/s within SLO)")
    ax2.set_title("Goodput vs request rate (SLO: TTFT ≤ 2 s, TPOT ≤ 50 ms); dashed: knees")
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


__all__ = ["BASELINE", "CHUNKED_PREFILL", "COMBINED", "TECHNIQUE_FLAGS", "baseline_flags",
           "checklist_table", "chunk_budget", "technique_flags",
           "arm_capacity", "chosen_techniques", "combined_flags", "explore", "findings",
           "findings_source", "knees",
           "goodput_sweep", "mixed_workload", "plan", "summary_figure", "sweep_arms"]
