"""Experiments of `09_priority_scheduling`: interactive chat requests mixed
with long batch requests, served first-come-first-served, with vLLM's
`--scheduling-policy priority`, and with a client-side off-peak admission
policy (`lab_utils.admission.OffPeakAdmission`).

Two engines (`plan`), the same batch slots in both: `fcfs` (vLLM's default
policy) and `priority` (`scheduling_policy="priority"`, the one knob). The
measured arms run on them:
- `interactive alone` (FCFS engine): the interactive requests with no batch
  traffic (what "served at once" looks like on this engine);
- `fcfs`: both classes, vLLM's default policy;
- `equal priority` and `priority` (priority engine): the same requests with
  `priority` set, all 0 (the same-engine control) and per class (interactive
  0, batch 1); in vLLM a LOWER value is served first (`vllm/v1/request.py`,
  `Request.__lt__`, and `PriorityRequestQueue` in
  `vllm/v1/core/sched/request_queue.py`);
- `admission`: the FCFS engine again, with batch requests held by the client
  until interactive traffic is off-peak (a client change, not another engine).

The mechanism is read from vLLM's /metrics during each arm: the waiting and
running gauges (sampled every `sample_every_s`) and the preemption counter.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..admission import (
    BATCH,
    INTERACTIVE,
    OffPeakAdmission,
    ScheduledRun,
    run_schedule_async,
)
from ..capacity import Capacity, cache_path, measure_capacity
from ..client import Client, RequestSpec, run_sync
from ..counters import GaugeSampler, delta, scrape
from ..figures.priority_scheduling import plot_queue, plot_timelines
from ..metrics import SLO, summarize
from ..arms import Arm as EngineArm
from ..arms import Plan
from ..results import Results
from ..vllm_code import vllm_source
from ..workloads import WARM_UP_RAMP, Schedule, chat, chat_questions, warm_up

#: vLLM serves the LOWER priority value first.
INTERACTIVE_PRIORITY, BATCH_PRIORITY = 0, 1
BATCH_PROMPT = ("Write a detailed report of several paragraphs that answers this question "
                "thoroughly, with background, examples and a summary: {question}")


# --------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------

def peak_arrivals(n: int, peak_s: float, seed: int = 0) -> list[float]:
    """`n` arrival times of a Poisson process observed during a peak of
    `peak_s` seconds: given the count, Poisson arrivals are independent and
    uniform over the window (sorted, seeded). The first arrives at 0."""
    if n < 1:
        return []
    if not peak_s > 0:
        raise ValueError(f"peak_s must be > 0 s, got {peak_s!r}")
    times = np.sort(np.random.default_rng(seed).uniform(0.0, peak_s, n))
    return [float(t) for t in times - times[0]]


def mixed_workload(*, interactive: int = 12, peak_s: float = 8.0,
                   interactive_tokens: tuple[int, int] = (16, 32), batch: int = 8,
                   batch_tokens: int = 96, batch_at_s: float = 1.0, batch_spread_s: float = 0.5,
                   seed: int = 0) -> Schedule:
    """`interactive` short chat requests arriving at random (Poisson) during a
    peak of `peak_s` seconds, and a batch job of `batch` long requests
    submitted between `batch_at_s` and `batch_at_s + batch_spread_s`, during
    the peak. After the peak no interactive request arrives (off-peak). Every
    request produces exactly its `max_tokens` (`ignore_eos`), so every arm
    does the same work; interactive lengths are drawn uniformly from
    `interactive_tokens`. No priorities are set (see `with_priorities`)."""
    lo, hi = interactive_tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"interactive_tokens must be (lo, hi) with 1 <= lo <= hi, got "
                         f"{interactive_tokens!r}")
    rng = random.Random(seed)
    questions = [q["question"] for q in chat_questions()]
    rng.shuffle(questions)
    batch_q, inter_q = questions[:batch], questions[batch:]
    specs, offsets = [], []
    for i in range(batch):
        specs.append(RequestSpec(messages=chat(BATCH_PROMPT.format(question=batch_q[i % len(batch_q)])),
                                 max_tokens=batch_tokens, tag=BATCH, ignore_eos=True))
        offsets.append(batch_at_s + batch_spread_s * i / max(batch - 1, 1))
    for i, at in enumerate(peak_arrivals(interactive, peak_s, seed)):
        specs.append(RequestSpec(messages=chat(inter_q[i % len(inter_q)]),
                                 max_tokens=rng.randint(lo, hi), tag=INTERACTIVE,
                                 ignore_eos=True))
        offsets.append(at)
    return Schedule(specs, offsets)


def with_priorities(workload: Schedule, interactive: int | None = INTERACTIVE_PRIORITY,
                    batch: int | None = BATCH_PRIORITY) -> Schedule:
    """The same requests with vLLM's `priority` per class (lower is served first)."""
    return workload.with_priority({INTERACTIVE: interactive, BATCH: batch})


def slot_demand(workload: Schedule, service_s: dict[str, float], slots: int,
                window_s: float | None = None) -> float:
    """Offered load: slot-seconds of work the requests arriving in the first
    `window_s` s ask for, over the slot-seconds available (> 1 = a queue must
    form). `service_s` is the measured time of one request per class."""
    window_s = window_s or max(workload.offsets, default=0.0) or 1.0
    demand = sum(service_s.get(s.tag, 0.0) for s, at in zip(workload.specs, workload.offsets)
                 if at <= window_s)
    return demand / (slots * window_s)


# --------------------------------------------------------------------------
# The peak, placed from what the engine measured
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class PeakLoad:
    """How long the peak lasts and the admission window, from the engine's
    measured capacity for interactive requests: the interactive requests
    arrive at `interactive_load` x the rate the engine serves with its slots
    full, so the batch job and the peak contend for the slots in the same
    proportion on a slow CPU, a fast CPU and a GPU. Explicit values are used
    as given."""
    peak_s: float
    window_s: float
    interactive: int
    capacity: Capacity | None = None

    @property
    def rate(self) -> float:
        """Interactive arrivals per second during the peak."""
        return self.interactive / self.peak_s if self.peak_s > 0 else math.nan

    @property
    def share(self) -> float | None:
        """The interactive rate over the saturated throughput."""
        cap = self.capacity
        return self.rate / cap.max_rate if cap and cap.max_rate > 0 else None

    def describe(self) -> str:
        text = (f"{self.interactive} interactive requests in a {self.peak_s:.1f} s peak "
                f"({self.rate:.3g} req/s")
        if self.share is not None:
            text += (f" = {self.share:.2f} x the {self.capacity.max_rate:.3g} req/s the engine "
                     f"served with {self.capacity.concurrency} in flight")
        return text + f"); off-peak after {self.window_s:.1f} s without an interactive arrival"


#: The admission window, in mean gaps between interactive arrivals, when not given.
WINDOW_GAPS = 4.5


def place_peak(capacity: Capacity | None, *, interactive: int, interactive_load: float,
               peak_s: float = 0.0, window_s: float = 0.0) -> PeakLoad:
    """The peak (pure): `peak_s` > 0 is used as given, else the interactive
    requests arrive at `interactive_load` x `capacity.max_rate`; the admission
    window `window_s` > 0 as given, else `WINDOW_GAPS` mean arrival gaps."""
    if peak_s <= 0:
        if capacity is None or not capacity.max_rate > 0 or not interactive_load > 0:
            raise ValueError("no peak length: give peak_s > 0, or interactive_load > 0 and a "
                             "measured capacity")
        peak_s = float(f"{interactive / capacity.fraction(interactive_load):.3g}")
    if window_s <= 0:
        window_s = round(WINDOW_GAPS * peak_s / max(interactive, 1), 1)
    return PeakLoad(float(peak_s), float(window_s), int(interactive), capacity)


def capacity_concurrency(max_num_seqs: int) -> int:
    """Requests in flight for the saturation run: the engine's slots (vLLM's
    default, 0, is 128 on CPU: 16 in flight saturate a small model there)."""
    return int(max_num_seqs) if 0 < max_num_seqs <= 16 else 16


def peak_for(ctx, *, interactive: int, interactive_load: float, peak_s: float = 0.0,
             window_s: float = 0.0, max_num_seqs: int = 4,
             interactive_tokens: tuple[int, int] = (16, 32), seed: int = 0,
             budget_s: float = 45.0, progress: bool = True) -> PeakLoad:
    """The notebook's peak: the FCFS engine's capacity for interactive
    requests is measured (cached in the run's results, `lab_utils.capacity`)
    unless `peak_s` is given, and the result recorded under `load`."""
    capacity = None
    if peak_s <= 0:
        engine = warm_engine(ctx, FCFS) or warm_engine(ctx, PRIORITY)
        if engine is None:
            raise RuntimeError("neither engine of the plan can run here, so there is no "
                               "capacity to place the peak from: give peak_s > 0")
        lo, hi = interactive_tokens
        capacity = measure_capacity(
            engine, lambda n, s: mixed_workload(interactive=n, batch=0,
                                                interactive_tokens=(lo, hi),
                                                seed=seed + s).specs,
            workload=f"09 interactive chat, {lo}-{hi} output tokens",
            concurrency=capacity_concurrency(max_num_seqs), budget_s=budget_s,
            cache=cache_path(ctx.results), results=ctx.results, progress=progress)
    peak = place_peak(capacity, interactive=interactive, interactive_load=interactive_load,
                      peak_s=peak_s, window_s=window_s)
    ctx.results.data["load"] = {"peak_s": peak.peak_s, "admission_window_s": peak.window_s,
                                "interactive_rate": peak.rate, "interactive_share": peak.share,
                                "described": peak.describe()}
    ctx.results.save()
    return peak



@dataclass
class Arm:
    label: str
    engine: str
    scheduled: ScheduledRun
    counters: dict[str, Any]
    gauges: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def records(self):
        return self.scheduled.run.records

    def frame(self) -> pd.DataFrame:
        return self.scheduled.frame().assign(arm=self.label)


def run_arm(engine, workload: Schedule, *, label: str, policy=None,
            results: Results | None = None, slo: SLO | None = None,
            sample_every_s: float = 0.5) -> Arm:
    """Send `workload` to `engine` (through `policy`, if given), sample the
    queue gauges meanwhile, and record the arm with per-class summaries."""
    client = Client.for_engine(engine)
    jsonl = results.records_path(label) if results else None
    if jsonl is not None and jsonl.exists():
        jsonl.unlink()
    before = scrape(engine.base_url, engine.api_key)

    with GaugeSampler(engine, sample_every_s) as gauges:
        scheduled = run_sync(run_schedule_async(client, workload.specs, workload.offsets,
                                                policy=policy, label=label, jsonl=jsonl))
    scheduled.run.counters = delta(before, scrape(engine.base_url, engine.api_key))
    arm = Arm(label, engine.label, scheduled, scheduled.run.counters, gauges.frame())
    failed = [r for r in arm.records if not r.ok]
    if results is not None:
        results.add_engine(engine)
        results.add_arm(label, scheduled.run, slo, engine=engine.label,
                        policy=getattr(policy, "describe", lambda: "none")(),
                        queue=gauges.summary(),
                        **class_summaries(arm, slo))
    if failed and len(failed) == len(arm.records):
        raise RuntimeError(f"every request of {label!r} failed; first error: {failed[0].error}")
    return arm


# --------------------------------------------------------------------------
# What each arm did, per class
# --------------------------------------------------------------------------

def class_summaries(arm: Arm, slo: SLO | None = None) -> dict[str, Any]:
    """`summarize` of the interactive records over the interactive span (first
    arrival to last finish, so goodput is per second of peak) and the batch
    job's price: when it finished and its throughput."""
    frame = arm.frame()
    out: dict[str, Any] = {}
    inter = frame[frame.tag == INTERACTIVE]
    if len(inter):
        span = float(inter.done_s.max() - inter.arrival_s.min()) if inter.ok.any() else math.nan
        recs = [r for r in arm.records if r.tag == INTERACTIVE]
        out["interactive"] = summarize(recs, span, slo)
    batch = frame[(frame.tag == BATCH)]
    if len(batch):
        ok = batch[batch.ok]
        first, last = float(batch.arrival_s.min()), float(ok.done_s.max()) if len(ok) else math.nan
        out["batch"] = {"requests": len(batch), "completed": int(batch.ok.sum()),
                        "held_s_median": float(batch.held_s.median()),
                        "completion_s_median": float((ok.done_s - ok.arrival_s).median()),
                        "job_done_s": last,
                        "output_tokens": int(ok.output_tokens.fillna(0).sum()),
                        "job_throughput_tok_s": float(ok.output_tokens.sum() / (last - first))
                        if len(ok) and last > first else math.nan}
    return out


def arm_row(arm: Arm, slo: SLO | None = None) -> dict[str, Any]:
    """One comparable row per arm (ms unless stated)."""
    s = class_summaries(arm, slo)
    i, b = s.get("interactive", {}), s.get("batch", {})
    g = arm.gauges
    return {"interactive TTFT p50": i.get("ttft_ms_median"), "interactive TTFT p90": i.get("ttft_ms_p90"),
            "interactive TTFT p99": i.get("ttft_ms_p99"), "interactive TPOT p50": i.get("tpot_ms_median"),
            "interactive SLO met (%)": 100 * i["slo_met_fraction"] if i else None,
            "interactive goodput (req/s)": i.get("goodput"),
            "batch held p50 (s)": b.get("held_s_median"),
            "batch job done at (s)": b.get("job_done_s"),
            "batch job tok/s": b.get("job_throughput_tok_s"),
            "preemptions": arm.counters.get("preemptions"),
            "max waiting (sampled)": g.requests_waiting.max() if len(g) else None,
            "mean waiting (sampled)": g.requests_waiting.mean() if len(g) else None,
            "max running (sampled)": g.requests_running.max() if len(g) else None,
            "failed": sum(1 for r in arm.records if not r.ok)}


def compare(arms: dict[str, Arm], slo: SLO | None = None) -> pd.DataFrame:
    return pd.DataFrame({label: arm_row(arm, slo) for label, arm in arms.items()}).T


# --------------------------------------------------------------------------
# The arms, ordered so each engine starts once
# --------------------------------------------------------------------------

def engine_flags(max_num_seqs: int, scheduling_policy: str | None = None) -> dict[str, Any]:
    """Technique flags of an arm: the contention knob (`max_num_seqs`, 0 =
    vLLM's default) and the scheduling policy (None = FCFS, the default)."""
    flags: dict[str, Any] = {}
    if max_num_seqs:
        flags["max_num_seqs"] = int(max_num_seqs)
    if scheduling_policy and scheduling_policy != "fcfs":
        flags["scheduling_policy"] = scheduling_policy
    return flags


#: The plan's engine arms: both measured arm groups run on one of these two.
FCFS, PRIORITY = "fcfs", "priority"


def plan(profile, params) -> Plan:
    """The notebook's two engines, both with the notebook's `max_num_seqs`
    slots (the contention knob): FCFS, vLLM's default order, and the priority
    policy. The admission and interactive-alone arms reuse the FCFS engine:
    they change what the client sends, not the server."""
    slots = int(params.get("max_num_seqs", 4))
    return Plan("09_priority_scheduling", (
        EngineArm(FCFS, engine_flags(slots), title="first come, first served (vLLM's default)"),
        EngineArm(PRIORITY, engine_flags(slots, "priority"), knob="scheduling_policy",
                  title="--scheduling-policy priority (lower value served first)")))


def warm_engine(ctx, name: str):
    """The engine of the plan's arm `name`, warmed up once with the article's
    ramp (a fresh CPU engine can stall the first time it meets a larger
    batch, and no arm should pay for that), or None if it cannot run here."""
    engine = ctx.arm(name)
    if engine is not None:
        warm_up(engine, **WARM_UP_RAMP, once=True)
    return engine


def fcfs_arm(ctx, workload: Schedule, *, label: str, policy=None,
             slo: SLO | None = None) -> dict[str, Arm]:
    """One arm on the FCFS engine (started once, reused for every FCFS arm):
    `workload` sent at its arrival times, through `policy` if given."""
    engine = warm_engine(ctx, FCFS)
    if engine is None:
        return {}
    return {label: run_arm(engine, workload, label=label, policy=policy, results=ctx.results,
                           slo=slo)}


def priority_arm(ctx, workload: Schedule, *, slo: SLO | None = None,
                 interactive_priority: int = INTERACTIVE_PRIORITY,
                 batch_priority: int = BATCH_PRIORITY, control: bool = True) -> dict[str, Arm]:
    """On the priority engine: the same workload with per-class `priority`
    (lower is served first). With `control`, first the same requests all at
    priority 0 on the same engine: ties are served in arrival order
    (`Request.__lt__`), i.e. FCFS, so the two arms differ only in the
    priorities and run back to back on one server."""
    engine = warm_engine(ctx, PRIORITY)
    if engine is None:
        return {}
    out = {}
    if control:
        out["equal priority"] = run_arm(engine, with_priorities(workload, 0, 0),
                                        label="equal priority", results=ctx.results, slo=slo)
    w = with_priorities(workload, interactive_priority, batch_priority)
    out["priority"] = run_arm(engine, w, label="priority", results=ctx.results, slo=slo)
    return out


def explore(ctx, *, max_num_seqs: int, batch: int, batch_tokens: int, interactive: int,
            peak_s: float, policy: str, window_s: float = 3.0, seed: int = 0) -> pd.DataFrame:
    """One arm with the widgets' settings (for the Explore section; nothing is
    recorded in the notebook's results). The notebook's slot count reuses its
    planned engine; another one starts an engine outside the plan."""
    w = mixed_workload(interactive=interactive, peak_s=peak_s, batch=batch,
                       batch_tokens=batch_tokens, seed=seed)
    slo = SLO(ttft_s=2.0, tpot_s=None)
    flags = engine_flags(max_num_seqs, policy if policy == "priority" else None)
    planned = ctx.plan.find(None, flags)
    engine = ctx.arm(planned) if planned else ctx.any_engine(**flags)
    if engine is None:  # ctx.arm / ctx.any_engine printed why
        return pd.DataFrame({"skipped": ["this engine cannot run on the target"]})
    warm_up(engine, **WARM_UP_RAMP, once=True)
    if policy == "priority":
        w = with_priorities(w)
    pol = OffPeakAdmission(window_s=window_s) if policy == "admission" else None
    arm = run_arm(engine, w, label=f"explore {policy}", policy=pol, slo=slo)
    return compare({policy: arm}, slo).T


CLAIM = "priority scheduling: interactive requests served at once, batch queued for off-peak"


def findings(arms: dict[str, Arm], table: pd.DataFrame) -> list[dict[str, Any]]:
    """`Results.add_finding` arguments: interactive p99 TTFT and the batch
    job's finish, FCFS against each policy, and priority against its
    same-engine control; the mechanism is vLLM's queue gauges and preemptions."""
    def evidence(label: str) -> str:
        row = table.loc[label]
        return (f"{label}: max {row['max waiting (sampled)']:.0f} requests waiting (mean "
                f"{row['mean waiting (sampled)']:.1f}) and "
                f"{row['max running (sampled)']:.0f} running (vllm:num_requests_waiting/running), "
                f"vllm:num_preemptions_total delta {arms[label].counters['preemptions']:.0f}")

    def p99(base: str, arm: str, technique: str, metric: str) -> dict[str, Any]:
        return {"technique": technique, "metric": metric,
                "baseline": table.loc[base, "interactive TTFT p99"],
                "treated": table.loc[arm, "interactive TTFT p99"], "article_claim": CLAIM,
                "mechanism": evidence(base) + "; " + evidence(arm),
                "p50": [table.loc[base, "interactive TTFT p50"],
                        table.loc[arm, "interactive TTFT p50"]]}

    out = []
    for arm in ("priority", "admission"):
        if arm in table.index and "fcfs" in table.index:
            out.append(p99("fcfs", arm, f"scheduling: {arm}",
                           f"interactive TTFT p99 (ms), fcfs -> {arm}"))
            out.append({"technique": f"scheduling: {arm} (batch price)",
                        "metric": f"batch job done at (s), fcfs -> {arm}",
                        "baseline": table.loc["fcfs", "batch job done at (s)"],
                        "treated": table.loc[arm, "batch job done at (s)"], "article_claim": CLAIM,
                        "mechanism": f"batch held by the client p50 "
                                     f"{table.loc[arm, 'batch held p50 (s)']:.1f} s; "
                                     + evidence(arm)})
    if {"equal priority", "priority"} <= set(table.index):
        out.append(p99("equal priority", "priority", "scheduling: priority (same engine)",
                       "interactive TTFT p99 (ms), equal -> class priorities"))
    return out


__all__ = [
    "BATCH",
    "BATCH_PRIORITY",
    "CLAIM",
    "FCFS",
    "INTERACTIVE",
    "INTERACTIVE_PRIORITY",
    "PRIORITY",
    "Arm",
    "PeakLoad",
    "WINDOW_GAPS",
    "arm_row",
    "capacity_concurrency",
    "class_summaries",
    "compare",
    "engine_flags",
    "explore",
    "fcfs_arm",
    "findings",
    "mixed_workload",
    "with_priorities",
    "peak_for",
    "place_peak",
    "plan",
    "plot_queue",
    "plot_timelines",
    "priority_arm",
    "run_arm",
    "slot_demand",
    "vllm_source",
    "warm_engine",
]
