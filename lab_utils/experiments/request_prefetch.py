"""Experiments of `10_request_prefetch`: the article's `RequestPrefetcher`
(predict the two likeliest queries while the user types, generate them ahead,
cache them for 30 s) against the same users without prefetching, with other
users sending chat requests to the same engine meanwhile.

An arm replays typing sessions from `datasets/typing_sessions.jsonl`
(sessions start as a seeded Poisson process; keystrokes at their recorded
times) and, concurrently, background users (seeded Poisson chat requests
through `Client.run_async`). Only the prefetcher changes between the arms
(`enabled=True/False`); the sessions, their timing, the background requests
and the engine (the plan's one baseline arm: prefetching is client-side) are
the same.

Measured per arm:
- per session: hit (answer complete in the cache at Enter), in-flight hit
  (its prefetch was still running: the user waits for the rest) or miss (the
  query is sent at Enter), and the user-seen latency to the first text and to
  the whole answer;
- the cost: prefetches made, tokens generated that no user received, and the
  server's own `vllm:generation_tokens_total` / `vllm:request_success_total`
  deltas (the extra work, as the engine counted it);
- the background users' TTFT and TPOT (what prefetching does to others).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from ..admission import client_session
from ..arms import Arm, Plan
from ..client import Client, Load, RequestRecord, Run, run_sync
from ..counters import delta, scrape
from ..metrics import SLO, percentile_stats, summarize
from ..prefetch import (
    QueryPredictor,
    RequestPrefetcher,
    Served,
    TTLCache,
    TypingSession,
    retime,
    typing_sessions,
)
from ..results import Results
from ..workloads import WARM_UP_RAMP, chat_specs, warm_up

WITH, WITHOUT = "with prefetch", "without prefetch"


def plan(profile, params) -> Plan:
    """One engine, the profile's own flags: the prefetcher is a client, so
    the with and without arms send to the same server."""
    return Plan("10_request_prefetch", (Arm(
        "baseline", title="the profile's engine flags (prefetching is client-side)"),))


@dataclass
class PrefetchArm:
    label: str
    sessions: list[TypingSession]
    starts: list[float]
    served: list[Served]
    cost: dict[str, float]
    background: Run
    records: list[RequestRecord]          # prefetches and misses of the typing users
    counters: dict[str, Any]
    duration_s: float
    settings: dict[str, Any] = field(default_factory=dict)
    rounds: list[PrefetchArm] = field(default_factory=list)   # what `merge` pooled

    def outcomes(self) -> pd.DataFrame:
        """One row per typing session."""
        return pd.DataFrame([{"arm": self.label, "session": s.id, "query": s.query,
                              "in_log": s.in_log, "start_s": st, "enter_s": st + s.enter_ms / 1e3,
                              "outcome": v.outcome, "first_ms": v.first_ms, "full_ms": v.full_ms,
                              "output_tokens": v.output_tokens}
                             for s, st, v in zip(self.sessions, self.starts, self.served)])

    def background_frame(self) -> pd.DataFrame:
        return self.background.frame().assign(arm=self.label)


def session_starts(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seeded Poisson start times (s) of `n` typing sessions at `rate` per s."""
    return Load.poisson(rate, seed=seed).arrival_offsets(n) or []


async def _replay(sessions: Sequence[TypingSession], starts: Sequence[float],
                  prefetcher: RequestPrefetcher, t0: float) -> list[Served]:
    async def one(session: TypingSession, start: float) -> Served:
        for at, prefix in session.prefixes():
            delay = t0 + start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prefetcher.on_keystroke(prefix)
        delay = t0 + start + session.enter_ms / 1e3 - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await prefetcher.answer(session.query)

    return list(await asyncio.gather(*(one(s, st) for s, st in zip(sessions, starts))))


def run_arm(engine, *, prefetch: bool, sessions: int = 16, first_session: int = 0,
            session_rate: float = 0.8,
            background_rate: float = 1.0, background_tokens: int = 32, answer_tokens: int = 32,
            ttl_s: float = 30.0, top_k: int = 2, min_prefix_chars: int = 3,
            max_in_flight: int = 0, typing_speed: float = 1.0, seed: int = 0,
            label: str | None = None, results: Results | None = None,
            slo: SLO | None = None, progress: bool = False) -> PrefetchArm:
    """One arm: `sessions` typing sessions from `first_session` on (typed
    `typing_speed` times faster than recorded) starting at `session_rate`/s, background chat
    users at `background_rate`/s for as long as the sessions last, and the
    prefetcher on or off. Every answer is `answer_tokens` long at most."""
    label = label or (WITH if prefetch else WITHOUT)
    chosen = [retime(s, typing_speed)
              for s in typing_sessions()[first_session:first_session + sessions]]
    starts = session_starts(len(chosen), session_rate, seed)
    span = max((st + s.enter_ms / 1e3 for s, st in zip(chosen, starts)), default=0.0)
    n_bg = max(1, math.ceil(background_rate * span))
    bg_specs = chat_specs(n_bg, max_tokens=background_tokens, seed=seed + 1, tag="background",
                          ignore_eos=True)
    bg_load = Load.poisson(background_rate, seed=seed + 1)
    client = Client.for_engine(engine)
    paths = {}
    if results is not None:
        for key in (label, f"{label} background"):
            paths[key] = results.records_path(key)
            if paths[key].exists():
                paths[key].unlink()
    typed_records: list[RequestRecord] = []
    out = open(paths[label], "a") if paths else None

    def keep(rec: RequestRecord) -> None:
        typed_records.append(rec)
        if out:
            out.write(json.dumps(rec.to_json()) + "\n")
            out.flush()

    before = scrape(engine.base_url, engine.api_key)
    t_start = time.time()

    async def go():
        async with client_session(client) as session:
            pf = RequestPrefetcher(client, session, QueryPredictor.from_log(), TTLCache(ttl_s),
                                   top_k=top_k, min_prefix_chars=min_prefix_chars,
                                   max_tokens=answer_tokens, max_in_flight=max_in_flight,
                                   enabled=prefetch, on_record=keep)
            t0 = time.perf_counter()
            served, bg = await asyncio.gather(
                _replay(chosen, starts, pf, t0),
                client.run_async(bg_specs, bg_load, label=f"{label} background",
                                 jsonl=paths.get(f"{label} background"), progress=progress))
            await pf.drain()  # prefetches still running cost tokens all the same
            return served, bg, pf.cost(), time.perf_counter() - t0

    try:
        served, bg, cost, duration = run_sync(go())
    finally:
        if out:
            out.close()
    counters = delta(before, scrape(engine.base_url, engine.api_key))
    bg.counters = counters
    settings = {"sessions": len(chosen), "first_session": first_session,
                "session_rate": session_rate,
                "background_rate": background_rate, "background_requests": n_bg,
                "answer_tokens": answer_tokens, "ttl_s": ttl_s, "top_k": top_k,
                "min_prefix_chars": min_prefix_chars, "max_in_flight": max_in_flight,
                "typing_speed": typing_speed, "seed": seed, "t_start": t_start}
    arm = PrefetchArm(label, chosen, starts, served, cost, bg, typed_records, counters,
                      duration, settings)
    if results is not None:
        results.add_engine(engine)
        results.add_arm(f"{label} background", bg, slo, engine=engine.label, prefetch=prefetch)
        typed = Run(label, f"{len(chosen)} typing sessions at {session_rate:g}/s", typed_records,
                    duration, counters)
        results.add_arm(label, typed, slo, engine=engine.label, prefetch=prefetch,
                        settings=settings, cost=cost, outcomes=outcome_summary(arm))
    return arm


def merge(arms: Sequence[PrefetchArm]) -> PrefetchArm:
    """The rounds of one arm as one: sessions, records and costs pooled
    (session start times stay relative to their own round)."""
    first = arms[0]
    cost = {k: sum(a.cost[k] for a in arms) for k in first.cost}
    counters = {k: sum(a.counters[k] or 0 for a in arms) for k in ("generation_tokens",
                                                                  "prompt_tokens",
                                                                  "requests_success",
                                                                  "preemptions")}
    bg = Run(f"{first.label} background", first.background.load,
             [r for a in arms for r in a.background.records],
             sum(a.background.duration_s for a in arms))
    return PrefetchArm(first.label, [x for a in arms for x in a.sessions],
                       [x for a in arms for x in a.starts], [x for a in arms for x in a.served],
                       cost, bg, [r for a in arms for r in a.records], counters,
                       sum(a.duration_s for a in arms), {**first.settings, "rounds": len(arms)},
                       rounds=list(arms))


def with_and_without(engine, *, sessions: int = 16, rounds: int = 2, results: Results | None = None,
                     slo: SLO | None = None, **kw: Any) -> dict[str, PrefetchArm]:
    """Both arms in `rounds` rounds of `sessions // rounds` sessions each, in
    ABBA order (without, with, with, without, ...), so a machine that gets
    busier or quieter during the run weighs on both arms alike. Each round of
    both arms replays the same sessions, the same start times and the same
    background requests; each prefetch round starts with an empty cache."""
    # No round pays for a fresh engine's first large batches.
    warm_up(engine, **WARM_UP_RAMP, once=True)
    per = max(1, sessions // rounds)
    seed = kw.pop("seed", 0)
    done: dict[str, list[PrefetchArm]] = {WITHOUT: [], WITH: []}
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for on in order:
            label = WITH if on else WITHOUT
            done[label].append(run_arm(engine, prefetch=on, sessions=per, first_session=r * per,
                                       seed=seed + r,
                                       label=f"{label} r{r + 1}", results=results, slo=slo, **kw))
    return {label: merge([dataclasses.replace(a, label=label) for a in arms])
            for label, arms in done.items()}


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------

def outcome_summary(arm: PrefetchArm) -> dict[str, Any]:
    """Hit rate and user-seen latency per outcome (ms)."""
    f = arm.outcomes()
    n = len(f)
    out: dict[str, Any] = {"sessions": n,
                           "hit_rate": float((f.outcome == "hit").mean()) if n else math.nan,
                           "any_hit_rate": float((f.outcome != "miss").mean()) if n else math.nan}
    for outcome, g in f.groupby("outcome"):
        out[outcome] = {"sessions": len(g),
                        "first_ms": percentile_stats(g.first_ms, scale=1.0),
                        "full_ms": percentile_stats(g.full_ms, scale=1.0)}
    return out


def outcome_table(arms: Sequence[PrefetchArm]) -> pd.DataFrame:
    """Sessions, share, and user-seen latency (p50/p90, ms) per arm and outcome."""
    rows = []
    for arm in arms:
        f = arm.outcomes()
        for outcome, g in f.groupby("outcome"):
            rows.append({"arm": arm.label, "outcome": outcome, "sessions": len(g),
                         "share (%)": 100 * len(g) / len(f),
                         "first text p50 (ms)": g.first_ms.median(),
                         "first text p90 (ms)": g.first_ms.quantile(0.9),
                         "full answer p50 (ms)": g.full_ms.median(),
                         "full answer p90 (ms)": g.full_ms.quantile(0.9)})
    return pd.DataFrame(rows).set_index(["arm", "outcome"])


def cost_table(arms: Sequence[PrefetchArm]) -> pd.DataFrame:
    """What prefetching cost: client ledger and the engine's own counters."""
    rows = {}
    for arm in arms:
        c, k = arm.cost, arm.counters
        served = len(arm.served)
        rows[arm.label] = {
            "typed queries served": served, "prefetches": c["prefetches"],
            "prefetches used": c["prefetches_used"], "prefetch tokens": c["tokens_generated"],
            "prefetch tokens used": c["tokens_used"], "prefetch tokens wasted": c["tokens_wasted"],
            "wasted tokens per served query": c["tokens_wasted"] / served if served else math.nan,
            "engine generation tokens": k["generation_tokens"],
            "engine requests": k["requests_success"],
            "engine prompt tokens": k["prompt_tokens"],
            "arm duration (s)": arm.duration_s}
    return pd.DataFrame(rows)


def background_table(arms: Sequence[PrefetchArm], slo: SLO | None = None) -> pd.DataFrame:
    """The other users' latency per arm (ms)."""
    rows = {}
    for arm in arms:
        s = summarize(arm.background.records, arm.background.duration_s, slo)
        rows[arm.label] = {"requests": s["requests"], "failed": s["failed"],
                           "TTFT p50": s["ttft_ms_median"], "TTFT p90": s["ttft_ms_p90"],
                           "TTFT p99": s["ttft_ms_p99"], "TPOT p50": s["tpot_ms_median"],
                           "TPOT p90": s["tpot_ms_p90"], "E2E p50": s["e2e_ms_median"]}
    return pd.DataFrame(rows).T


def round_table(arms: Sequence[PrefetchArm]) -> pd.DataFrame:
    """Per round (in the order they ran) and arm: the background users' latency
    and the engine's work, to see whether a difference repeats."""
    rows = []
    for arm in arms:
        for i, r in enumerate(arm.rounds or [arm]):
            s = summarize(r.background.records, r.background.duration_s)
            rows.append({"round": i + 1, "arm": arm.label, "started": r.settings.get("t_start"),
                         "background TTFT p50": s["ttft_ms_median"],
                         "background TTFT p90": s["ttft_ms_p90"],
                         "background TPOT p50": s["tpot_ms_median"],
                         "engine generation tokens": r.counters["generation_tokens"],
                         "engine requests": r.counters["requests_success"],
                         "hits": sum(v.outcome == "hit" for v in r.served)})
    return (pd.DataFrame(rows).sort_values(["round", "started"]).drop(columns="started")
            .set_index(["round", "arm"]))


def prefetch_replay_counts(sessions: Sequence[TypingSession], predictor: QueryPredictor, *,
                           top_k: int = 2, min_prefix_chars: int = 3) -> pd.DataFrame:
    """Without an engine: per session, the keystroke at which its query first
    enters the top-k prediction, the lead time that leaves before Enter, and
    the distinct queries predicted along the way (an upper bound on the
    prefetches one user alone would cause)."""
    from ..prefetch import normalize
    rows = []
    for s in sessions:
        key, seen, first = normalize(s.query), set(), None
        for i, (at, prefix) in enumerate(s.prefixes()):
            if len(prefix.strip()) < min_prefix_chars:
                continue
            preds = predictor.predict(prefix, top_k)
            seen.update(preds)
            if first is None and key in preds:
                first = (i + 1, s.enter_ms / 1e3 - at)
        rows.append({"session": s.id, "query": s.query, "in_log": s.in_log,
                     "predicted at char": first[0] if first else None,
                     "lead before Enter (s)": first[1] if first else None,
                     "queries predicted": len(seen)})
    return pd.DataFrame(rows)


def summary_row(arm: PrefetchArm, slo: SLO | None = None) -> dict[str, float]:
    """The numbers the findings use, for one arm."""
    f = arm.outcomes()
    bg = summarize(arm.background.records, arm.background.duration_s, slo)
    served = len(f)
    return {"sessions": served, "hit (%)": 100 * (f.outcome == "hit").mean(),
            "in-flight hit (%)": 100 * (f.outcome == "in-flight hit").mean(),
            "miss (%)": 100 * (f.outcome == "miss").mean(),
            "first text p50 (ms)": f.first_ms.median(), "full answer p50 (ms)": f.full_ms.median(),
            "full answer p90 (ms)": f.full_ms.quantile(0.9),
            "prefetches": arm.cost["prefetches"],
            "wasted tokens per served query": arm.cost["tokens_wasted"] / served if served else math.nan,
            "engine generation tokens": arm.counters["generation_tokens"],
            "background TTFT p50 (ms)": bg["ttft_ms_median"],
            "background TTFT p99 (ms)": bg["ttft_ms_p99"],
            "background TPOT p50 (ms)": bg["tpot_ms_median"]}


CLAIM = ("request prefetch: predict the 2 likeliest queries while typing, generate ahead, "
         "cache 30 s")


def findings(without: PrefetchArm, with_: PrefetchArm) -> list[dict[str, Any]]:
    """`Results.add_finding` arguments: hit rate, latency after Enter, wasted
    tokens and the other users' TTFT, with the engine's counters as mechanism."""
    a, b = summary_row(without), summary_row(with_)
    work = (f"vllm:generation_tokens_total {a['engine generation tokens']:.0f} -> "
            f"{b['engine generation tokens']:.0f}, vllm:request_success_total "
            f"{without.counters['requests_success']:.0f} -> {with_.counters['requests_success']:.0f}")
    hit = with_.outcomes().query("outcome == 'hit'").full_ms.median()
    out = [
        {"technique": "request prefetch: hit rate", "metric": "sessions answered from the cache (%)",
         "baseline": a["hit (%)"], "treated": b["hit (%)"],
         "mechanism": f"{with_.cost['prefetches']} prefetches, {with_.cost['prefetches_used']} used; "
                      f"in-flight hits {b['in-flight hit (%)']:.0f}%, misses {b['miss (%)']:.0f}%"},
        {"technique": "request prefetch: user latency",
         "metric": "full answer after Enter p50 (ms), no prefetch -> hit",
         "baseline": a["full answer p50 (ms)"], "treated": hit,
         "mechanism": f"a hit is a TTLCache lookup; all sessions p50 "
                      f"{a['full answer p50 (ms)']:.0f} -> {b['full answer p50 (ms)']:.0f} ms"},
        {"technique": "request prefetch: cost", "metric": "prefetched tokens nobody used, per served query",
         "baseline": 0.0, "treated": b["wasted tokens per served query"], "mechanism": work}]
    for stat in ("p50", "p99"):
        out.append({"technique": f"request prefetch: other users ({stat})",
                    "metric": f"background TTFT {stat} (ms)",
                    "baseline": a[f"background TTFT {stat} (ms)"],
                    "treated": b[f"background TTFT {stat} (ms)"],
                    "mechanism": work + f"; background TPOT p50 {a['background TPOT p50 (ms)']:.0f}"
                                        f" -> {b['background TPOT p50 (ms)']:.0f} ms"})
    return [{**f, "article_claim": CLAIM} for f in out]


def explore(engine, baseline: PrefetchArm | None = None, **settings: Any) -> pd.DataFrame:
    """One prefetch arm with the widgets' settings (not recorded), next to
    the notebook's no-prefetch arm if given."""
    arm = run_arm(engine, prefetch=True, label="explore", **settings)
    rows = {"explore (with prefetch)": summary_row(arm)}
    if baseline is not None:
        rows[f"notebook run ({baseline.label})"] = summary_row(baseline)
    return pd.DataFrame(rows).round(1)


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------

def plot_query_log(log: Sequence[dict], title: str = "The query log: a few queries are most of it"):
    """Count against popularity rank on log-log axes (a straight line is Zipf's law)."""
    import matplotlib.pyplot as plt
    counts = sorted((r["count"] for r in log), reverse=True)
    total = sum(counts)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.loglog(range(1, len(counts) + 1), counts, "o", ms=3, label="logged queries")
    ax1.set_xlabel("popularity rank")
    ax1.set_ylabel("times asked in the log")
    ax1.legend()
    share = [sum(counts[:k]) / total * 100 for k in range(1, len(counts) + 1)]
    ax2.plot(range(1, len(counts) + 1), share, label="cumulative share")
    ax2.set_xlabel("top-k queries")
    ax2.set_ylabel("share of all log entries (%)")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig

def plot_user_latency(arms: Sequence[PrefetchArm], title: str = "What the typing user waits for"):
    """Enter -> first text and Enter -> full answer per outcome (log scale:
    a cache hit takes microseconds, a miss hundreds of milliseconds)."""
    import matplotlib.pyplot as plt
    import seaborn as sns
    f = pd.concat([a.outcomes() for a in arms], ignore_index=True)
    f["group"] = f.arm + ": " + f.outcome
    long = f.melt(id_vars=["group"], value_vars=["first_ms", "full_ms"], var_name="until",
                  value_name="ms")
    long["until"] = long["until"].map({"first_ms": "first text", "full_ms": "full answer"})
    long["ms"] = long["ms"].clip(lower=1e-3)  # a log axis cannot show 0
    fig, ax = plt.subplots(figsize=(9, 4))
    sns.stripplot(data=long, x="group", y="ms", hue="until", dodge=True, ax=ax, size=5, alpha=0.7)
    ax.set_yscale("log")
    ax.set_xlabel("arm: outcome at Enter")
    ax.set_ylabel("latency after Enter (ms, log scale)")
    ax.tick_params(axis="x", rotation=15)
    ax.legend(title="until")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


__all__ = [
    "CLAIM",
    "WITH",
    "WITHOUT",
    "PrefetchArm",
    "background_table",
    "cost_table",
    "explore",
    "findings",
    "merge",
    "outcome_summary",
    "outcome_table",
    "plan",
    "plot_query_log",
    "plot_user_latency",
    "prefetch_replay_counts",
    "round_table",
    "run_arm",
    "session_starts",
    "summary_row",
    "with_and_without",
]
