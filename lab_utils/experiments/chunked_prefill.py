"""Experiments of `01_chunked_prefill`: does splitting a long prompt's prefill
into chunks stop it from blocking short chat requests?

The workload is a seeded stream of short chat requests with a few long-prompt
requests landing among them (`mixed_workload`). Every arm runs the same
schedule against one engine: chunked prefill off (a long prompt is prefilled
in one engine step), or on with a sweep of `max_num_batched_tokens` (the token
budget of one engine step, which caps the chunk size). Per arm we report the
short requests' TTFT, the long requests' TTFT, the *decode stall* (the inter-
token gaps of short requests that were already streaming when a long prompt
arrived) and throughput, and confirm the mechanism with vLLM's own counters:
the server's own TTFT/ITL/queue/prefill histograms (/metrics deltas) and the
engine steps the server logs with `--enable-logging-iteration-details` (prefill
tokens and time of every step). `vllm:iteration_tokens_total` is no help here:
vLLM adds a prompt's tokens to it in the step that emits the first token, so a
chunked 1,536-token prefill still shows up as one 1,536-token "step".

`plan` lists the engines (off first, then the budgets); the findings compare
off with the smallest budget (`findings`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .. import arms
from ..capacity import cache_path, measure_capacity
from ..client import Client, Load, RequestRecord, RequestSpec, Run
from ..counters import GaugeSampler
from ..engine_steps import StepLog, parse_iteration_log, step_stats
from ..figures.chunked_prefill import plot_steps, plot_sweep
from ..host import host_load
from ..interference import LONG, SHORT, PlacedLoad, mixed_schedule, place_load
from ..metrics import arrived_while_waiting, decode_stall, ms, percentile
from ..results import Results, measure
from ..vllm_code import vllm_source
from ..workloads import Schedule, chat_specs, synthetic_specs, tokenizer_for

#: Prompt tokens of a long request unless the notebook says otherwise.
LONG_PROMPT_TOKENS = 1536

# Every call draws new long-prompt text, so the prefix cache (on by default in
# V1) never serves a long prompt from an earlier arm and hides its prefill.
_fresh = itertools.count(1)


# --------------------------------------------------------------------------
# The workload: a seeded schedule of short and long requests
# --------------------------------------------------------------------------

def mixed_workload(engine, *, n_short: int = 12, short_rate: float = 1.5,
                   long_at: Sequence[float] = (1.5, 6.0, 10.5),
                   long_prompt_tokens: int = LONG_PROMPT_TOKENS,
                   short_output_tokens: int = 32, long_output_tokens: int = 8,
                   seed: int = 0) -> Schedule:
    """Short chat requests (chat_questions.jsonl, exactly `short_output_tokens`
    output tokens each) and long completions requests of exactly
    `long_prompt_tokens` prompt tokens (fresh text every call), on the
    deterministic schedule of `mixed_schedule`."""
    schedule = mixed_schedule(n_short, short_rate, long_at, seed=seed)
    n_s = sum(tag == SHORT for _, tag in schedule)
    n_l = len(schedule) - n_s
    shorts = iter(chat_specs(n_s, max_tokens=short_output_tokens, seed=seed, tag=SHORT,
                             ignore_eos=True))
    longs = iter(synthetic_specs(tokenizer_for(engine), n_l, int(long_prompt_tokens),
                                 max_tokens=long_output_tokens, tag=LONG,
                                 seed=next(_fresh) * 7919 + seed) if n_l else [])
    specs = [next(shorts) if tag == SHORT else next(longs) for _, tag in schedule]
    desc = (f"{n_s} short chat requests ({short_rate:g}/s Poisson, seed {seed}, "
            f"{short_output_tokens} output tokens) + {n_l} long requests of "
            f"{long_prompt_tokens} prompt tokens at {list(long_at)} s")
    return Schedule(specs, [t for t, _ in schedule], desc)


# --------------------------------------------------------------------------
# The load, placed from what the engine measured
# --------------------------------------------------------------------------

def load_for(ctx, *, short_load: float, long_requests: int, long_spacing: float,
             short_rate: float = 0.0, long_at: Sequence[float] = (), n_short: int = 0,
             short_output_tokens: int = 32, long_prompt_tokens: int = LONG_PROMPT_TOKENS,
             long_output_tokens: int = 8, seed: int = 0, budget_s: float = 60.0,
             progress: bool = True) -> PlacedLoad:
    """The notebook's load (`place_load`), recorded in the results. Unless
    every value is given explicitly, it is measured first on the plan's first
    arm the target can serve (the off arm on a local profile; the sweep then
    reuses that engine), after one unmeasured request of each shape, and
    cached in the run's results (`lab_utils.capacity`): the short requests'
    capacity (one at a time, then 8 in flight) and a long request's latency
    alone (three one at a time, then one more)."""
    short = long = None
    if not (short_rate > 0 and (long_at or long_requests == 0)):
        engine = next((e for e in map(ctx.arm, ctx.plan.names) if e is not None), None)
        if engine is None:
            raise RuntimeError("no arm of the plan can run here, so no capacity to place "
                               "the load from (see the skipped arms above)")
        _warm_up(engine, long_prompt_tokens)
        common = dict(budget_s=budget_s, cache=cache_path(ctx.results), results=ctx.results,
                      progress=progress)
        short = measure_capacity(
            engine, lambda n, s: chat_specs(n, max_tokens=short_output_tokens, seed=seed + s,
                                            tag=SHORT, ignore_eos=True),
            workload=f"01 short chat requests, {short_output_tokens} output tokens", **common)
        tok = tokenizer_for(engine)
        long = measure_capacity(
            engine, lambda n, s: synthetic_specs(tok, n, int(long_prompt_tokens),
                                                 max_tokens=long_output_tokens, tag=LONG,
                                                 seed=next(_fresh) * 7919 + s),
            workload=f"01 long prompt, {long_prompt_tokens} tokens", sequential=3, requests=1,
            concurrency=1, **common)
    placed = place_load(short, long.sync_e2e_s if long else None, short_load=short_load,
                        long_requests=long_requests, long_spacing=long_spacing,
                        short_rate=short_rate, long_at=long_at, n_short=n_short)
    ctx.results.data["load"] = {**placed.workload(), "short_share": placed.short_share,
                                "long_solo_s": placed.long_solo_s,
                                "short_load": short_load if short_rate <= 0 else None,
                                "long_spacing": long_spacing if not long_at else None,
                                "described": placed.describe()}
    ctx.results.save()
    return placed


# --------------------------------------------------------------------------
# The plan: the engines of the sweep, and the one change each one makes
# --------------------------------------------------------------------------

def arm_flags(chunked: bool, budget: int | None, max_model_len: int | None, *,
              threshold: int = 0, log_steps: bool = True) -> dict[str, Any]:
    """Engine flags of one arm.

    With chunked prefill off, vLLM requires max_num_batched_tokens >=
    max_model_len (SchedulerConfig.verify_max_model_len) and, left unset,
    picks max(max_model_len, its default), so the off arm asks for exactly
    max_model_len. `threshold` > 0 adds --long-prefill-token-threshold (chunked
    arms only). `log_steps` adds --enable-logging-iteration-details (the same in
    every arm): the server then logs every engine step."""
    flags: dict[str, Any] = {"enable_chunked_prefill": bool(chunked)}
    if chunked:
        if budget:
            flags["max_num_batched_tokens"] = int(budget)
        if threshold:
            flags["long_prefill_token_threshold"] = int(threshold)
    else:
        if threshold:
            raise ValueError("long_prefill_token_threshold only applies with chunked prefill on")
        if budget or max_model_len:
            need = int(max_model_len or 0)
            if budget and need and budget < need:
                raise ValueError(f"with chunked prefill off, max_num_batched_tokens ({budget}) "
                                 f"must be >= max_model_len ({need}); vLLM refuses to start "
                                 "otherwise")
            flags["max_num_batched_tokens"] = int(budget or need)
    if log_steps:
        flags["enable_logging_iteration_details"] = True
    return flags


def arm_label(chunked: bool, budget: int | None, threshold: int = 0) -> str:
    if not chunked:
        return f"off (budget {budget})" if budget else "off"
    label = f"on, budget {budget}" if budget else "on (default budget)"
    return label + (f", threshold {threshold}" if threshold else "")


def sweep_plan(budgets: Sequence[int], *, include_off: bool = True,
               threshold: int = 0) -> list[tuple[bool, int | None, int]]:
    """(chunked, budget, threshold) per arm: off first, then the budgets in
    ascending order, then (if `threshold`) the smallest budget with
    --long-prefill-token-threshold. Duplicates are dropped."""
    plan: list[tuple[bool, int | None, int]] = [(False, None, 0)] if include_off else []
    for b in sorted({int(b) for b in budgets}):
        if b < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {b}")
        plan.append((True, b, 0))
    if threshold:
        if not budgets:
            raise ValueError("a long_prefill_token_threshold arm needs at least one budget")
        plan.append((True, min(int(b) for b in budgets), int(threshold)))
    return plan


def sweep_arm(profile, chunked: bool, budget: int | None, threshold: int = 0) -> arms.Arm:
    """The engine of one setting on `profile`, named by its label (the
    results' arm key). The step log flag is left out on a remote profile: the
    lab cannot read that server's log."""
    flags = arm_flags(chunked, budget, profile.engine.get("max_model_len"), threshold=threshold,
                      log_steps=not profile.is_remote)
    budget = flags.get("max_num_batched_tokens")
    if not chunked:
        title = "chunked prefill off: a long prompt is prefilled in one engine step"
    else:
        title = f"chunked prefill on: at most {budget or 'the default'} tokens per engine step"
        if threshold:
            title += f", a long prompt's chunk capped at {threshold} while others wait"
    return arms.Arm(arm_label(chunked, budget, threshold), flags, title=title)


#: The one arm of a remote run without mapped servers: the server as it runs.
SERVER_ARM = arms.Arm("server", title="the remote server as it runs (its chunked-prefill "
                      "setting and budget are not readable from outside)")


def remote_arms_mapped(*declared: arms.Arm) -> bool:
    """Whether LAB_REMOTE_ARMS maps any of these arms to a server of its own."""
    from ..remote import mapped_arms
    mapped = mapped_arms()
    return any(a.key in mapped for a in declared)


def plan(profile, params) -> arms.Plan:
    """Chunked prefill off (the baseline), then on at each budget of
    `params["budgets"]`, then, with `long_prefill_threshold` > 0, the
    smallest budget with --long-prefill-token-threshold (`sweep_plan`).

    Every chunked arm is compared with off. Below max_model_len its budget
    and chunking change together: vLLM refuses chunked prefill off with
    max_num_batched_tokens < max_model_len (SchedulerConfig.verify_max_model_len),
    so no unchunked engine runs at the chunked arm's budget, and the knob is
    that pair of flags. The threshold arm is compared with the smallest
    budget, in which it changes only the threshold."""
    sweep = sweep_plan(params.get("budgets") or (),
                       threshold=int(params.get("long_prefill_threshold") or 0))
    off, *chunked = [sweep_arm(profile, *setting) for setting in sweep]
    if profile.is_remote and not remote_arms_mapped(off, *chunked):
        return arms.Plan("01_chunked_prefill", (SERVER_ARM,), notes=(
            "a remote server tells neither whether it chunks prefills nor its budget "
            "(max_num_batched_tokens), so no arm of the sweep can be placed on it: the mixed "
            "workload runs on the server as it is, and nothing is compared (map other "
            "servers to the sweep's arms with LAB_REMOTE_ARMS to compare)",))
    out, smallest = [off], None
    for a in chunked:
        if "long_prefill_token_threshold" in a.flags:
            out.append(dataclasses.replace(a, reference=smallest.name,
                                           knob="long_prefill_token_threshold"))
            continue
        same_budget = a.flags.get("max_num_batched_tokens") == off.flags.get(
            "max_num_batched_tokens")
        out.append(dataclasses.replace(a, knob="enable_chunked_prefill" if same_budget else
                                       ("enable_chunked_prefill", "max_num_batched_tokens")))
        smallest = smallest or a  # sweep_plan lists the budgets in ascending order
    return arms.Plan("01_chunked_prefill", tuple(out))


# --------------------------------------------------------------------------
# One arm, and the sweep
# --------------------------------------------------------------------------

@dataclass
class ArmRun:
    """What one arm measured: its requests and the engine steps it logged."""
    label: str
    chunked: bool | None               # None: not known (a remote server as it runs)
    budget: int | None                 # max_num_batched_tokens (None = server default)
    run: Run
    threshold: int = 0                 # long_prefill_token_threshold (0 = none)
    steps: pd.DataFrame = field(default_factory=lambda: parse_iteration_log(""))
    host_load: float = math.nan        # 1-minute load average around the run
    queue: dict[str, Any] = field(default_factory=dict)   # GaugeSampler.summary()

    @property
    def records(self) -> list[RequestRecord]:
        return self.run.records


def arm_row(arm: ArmRun) -> dict[str, Any]:
    """One table row: the latencies the notebook compares, the server's own
    histograms (/metrics deltas) and what its engine steps did."""
    recs = [r for r in arm.records if r.ok]
    short = [r for r in recs if r.tag == SHORT]
    long = [r for r in recs if r.tag == LONG]
    c = arm.run.counters or {}
    out_tokens = sum(r.output_tokens or 0 for r in recs)
    return {"arm": arm.label, "chunked_prefill": arm.chunked, "max_num_batched_tokens": arm.budget,
            "long_prefill_token_threshold": arm.threshold,
            "short_ttft_ms_p50": percentile([r.ttft * 1e3 for r in short], 50),
            "short_ttft_ms_p99": percentile([r.ttft * 1e3 for r in short], 99),
            "long_ttft_ms_median": percentile([r.ttft * 1e3 for r in long], 50),
            "long_ttft_ms_max": percentile([r.ttft * 1e3 for r in long], 100),
            "blocked_short_ttft_ms_median": percentile(
                [r.ttft * 1e3 for r in arrived_while_waiting(arm.records, SHORT, LONG)], 50),
            **decode_stall(arm.records, SHORT, LONG),
            "short_itl_ms_p50": percentile([g * 1e3 for r in short for g in r.itl], 50),
            "output_tok_s": out_tokens / arm.run.duration_s if arm.run.duration_s else math.nan,
            "duration_s": arm.run.duration_s,
            "failed": sum(not r.ok for r in arm.records),
            "server_ttft_ms_p99": ms(c.get("server_ttft_s_p99")),
            "server_itl_ms_p99": ms(c.get("server_itl_s_p99")),
            "server_queue_ms_mean": ms(c.get("server_queue_s_mean")),
            "server_prefill_ms_mean": ms(c.get("server_prefill_s_mean")),
            "prefix_cache_hits": c.get("prefix_cache_hits"),
            "host_load_1m": arm.host_load,
            "waiting_max": _nan_if_none(arm.queue.get("waiting_max")),
            "waiting_mean": _nan_if_none(arm.queue.get("waiting_mean")),
            **step_stats(arm.steps)}


def _nan_if_none(value: float | None) -> float:
    """A gauge summary's value for the table (None: no sample was taken)."""
    return math.nan if value is None else float(value)


def sweep_table(runs: Mapping[str, ArmRun]) -> pd.DataFrame:
    """One `arm_row` per arm run; with none (every arm skipped) an empty table
    that still has the columns the notebook's later cells index."""
    columns = list(arm_row(ArmRun("", False, None, Run("", "", [], 0.0))))
    return pd.DataFrame([arm_row(a) for a in runs.values()], columns=columns).set_index("arm")


def _warm_up(engine, long_prompt_tokens: int = 0) -> None:
    """One short and one long request first, not measured: the first pass of a
    shape through a fresh engine pays one-time costs that would land on
    whichever arm (or measurement) happens to meet it first."""
    warm = [chat_specs(1, max_tokens=4, seed=99)[0]]
    if long_prompt_tokens:
        warm += synthetic_specs(tokenizer_for(engine), 1, int(long_prompt_tokens),
                                max_tokens=1, seed=next(_fresh) * 7919 + 1, tag="warm-up")
    Client.for_engine(engine).run(warm, Load.sequential(), progress=False)


def run_arm(engine, workload: Schedule, arm: arms.Arm, *, long_prompt_tokens: int = 0,
            results: Results | None = None, progress: bool = True) -> ArmRun:
    """Send the workload once on `engine`, the engine of `arm`; keep the
    counter deltas (in `run.counters`) and the engine steps the server logged
    meanwhile."""
    _warm_up(engine, long_prompt_tokens if workload.count(LONG) else 0)
    log = StepLog(engine).start()
    load_before = host_load()
    with GaugeSampler(engine, interval_s=0.25) as gauges:
        run = measure(engine, workload.specs, workload.load, label=arm.name, results=results,
                      progress=progress, workload=workload.description)
    flags = arm.flags
    chunked = flags.get("enable_chunked_prefill")
    out = ArmRun(arm.name, None if chunked is None else bool(chunked),
                 flags.get("max_num_batched_tokens"), run,
                 int(flags.get("long_prefill_token_threshold", 0)), log.read(),
                 (load_before + host_load()) / 2, gauges.summary())
    if results is not None:
        results.data["arms"][arm.name].update(engine_steps=step_stats(out.steps),
                                              host_load_1m=out.host_load, queue=out.queue)
        results.save()
    return out


def chunked_prefill_sweep(ctx, names: Sequence[str] | None = None, *, progress: bool = True,
                          **workload_kw: Any) -> tuple[pd.DataFrame, dict[str, ArmRun]]:
    """Run the same mixed workload (`mixed_workload(**workload_kw)`) on each
    arm of the notebook's plan (or the arms `names`), one engine at a time, in
    the plan's order. An arm the target cannot serve is skipped with a note
    (`ctx.arm`). Returns the table (one row per arm) and {arm: ArmRun}."""
    long_tokens = workload_kw.get("long_prompt_tokens", LONG_PROMPT_TOKENS)

    def one(arm: arms.Arm, engine) -> ArmRun:
        return run_arm(engine, mixed_workload(engine, **workload_kw), arm, results=ctx.results,
                       long_prompt_tokens=long_tokens, progress=progress)
    runs = arms.run(ctx, names or ctx.plan.names, one)
    return sweep_table(runs), runs


def explore_arm(ctx, budget: int, threshold: int = 0, **workload_kw: Any) -> pd.DataFrame:
    """One arm on demand (the notebook's Explore widgets): `budget` 0 means
    chunked prefill off; `threshold` > 0 adds --long-prefill-token-threshold.
    A setting the plan declares runs as that arm, any other on an engine
    outside the plan (`ctx.any_engine`)."""
    chunked = budget > 0
    a = sweep_arm(ctx.profile, chunked, int(budget) if chunked else None,
                  int(threshold) if chunked else 0)
    declared = ctx.plan.find(a.role, a.flags, a.env)
    engine = ctx.arm(declared) if declared is not None else ctx.any_engine(**dict(a.flags))
    if engine is None:
        return sweep_table({})
    run = run_arm(engine, mixed_workload(engine, **workload_kw), declared or a,
                  long_prompt_tokens=workload_kw.get("long_prompt_tokens", LONG_PROMPT_TOKENS),
                  results=ctx.results)
    return sweep_table({a.name: run})[SUMMARY_COLUMNS + MECHANISM_COLUMNS].astype(float).T


# --------------------------------------------------------------------------
# Reading the sweep: the headline pair, the findings, this run in words
# --------------------------------------------------------------------------

def headline_arms(table: pd.DataFrame) -> tuple[str | None, str | None]:
    """The two arms the findings compare: chunked prefill off, and on at the
    smallest budget without a long-prefill threshold (None when not run)."""
    if table.empty or "chunked_prefill" not in table:
        return None, None
    thr = table.get("long_prefill_token_threshold", pd.Series(0, index=table.index)).fillna(0)
    off = table[table.chunked_prefill.eq(False)]
    on = table[table.chunked_prefill.eq(True) & (thr == 0)].sort_values("max_num_batched_tokens")
    return (off.index[0] if len(off) else None), (on.index[0] if len(on) else None)


def headline_rows(table: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """The table rows of `headline_arms` (off, on), or an error naming what is missing."""
    off, on = headline_arms(table)
    if off is None or on is None:
        raise RuntimeError("the findings compare chunked prefill off with on; this run has "
                           f"off={off!r}, on={on!r} (skipped arms are listed in the results' "
                           "notes)")
    return table.loc[off], table.loc[on]


def findings(table: pd.DataFrame) -> list[dict[str, Any]]:
    """The notebook's findings, off against on at the smallest budget
    (`headline_rows`): short-request TTFT p99 (the checklist's row), the decode
    stall, long-request TTFT and the engine's throughput while busy, each with
    the server's step log and histograms as its mechanism."""
    off, on = headline_arms(table)
    if off is None or on is None:
        return []  # nothing to compare (the skipped arms are in the results' notes)
    b, t = headline_rows(table)
    steps = (f"largest prefill per engine step {b.max_prefill_tokens_per_step:.0f} -> "
             f"{t.max_prefill_tokens_per_step:.0f} tokens, longest step {b.max_step_ms:.0f} -> "
             f"{t.max_step_ms:.0f} ms (server step log)")
    return [
        dict(technique="chunked prefill", metric=f"short-request TTFT p99 (ms), off -> {on}",
             baseline=b.short_ttft_ms_p99, treated=t.short_ttft_ms_p99,
             article_claim="TTFT -30-50% (--enable-chunked-prefill --max-num-batched-tokens 4096)",
             checklist="chunked prefill:ttft",
             mechanism=f"{steps}; short requests sent during a long prefill: median TTFT "
                       f"{b.blocked_short_ttft_ms_median:.0f} -> "
                       f"{t.blocked_short_ttft_ms_median:.0f} ms; "
                       f"vllm:time_to_first_token_seconds p99 {b.server_ttft_ms_p99:.0f} -> "
                       f"{t.server_ttft_ms_p99:.0f} ms; vllm:num_requests_waiting max "
                       f"{b.waiting_max:.0f} -> {t.waiting_max:.0f} (mean {b.waiting_mean:.2f}"
                       f" -> {t.waiting_mean:.2f}, sampled every 0.25 s)"),
        dict(technique="chunked prefill",
             metric="decode stall: max ITL (ms) of short requests streaming when a long prompt "
                    f"arrived, off -> {on}",
             baseline=b.stall_itl_ms_max, treated=t.stall_itl_ms_max,
             article_claim="long prompts stop blocking short requests",
             mechanism=f"{steps}; vllm:inter_token_latency_seconds p99 "
                       f"{b.server_itl_ms_p99:.0f} -> {t.server_itl_ms_p99:.0f} ms"),
        dict(technique="chunked prefill", metric=f"long-request TTFT median (ms), off -> {on}",
             baseline=b.long_ttft_ms_median, treated=t.long_ttft_ms_median,
             article_claim="(not stated; the usual cost of chunking is a slower long prefill)",
             mechanism=f"prefill steps {b.prefill_steps:.0f} -> {t.prefill_steps:.0f}; "
                       f"vllm:request_prefill_time_seconds mean {b.server_prefill_ms_mean:.0f} "
                       f"-> {t.server_prefill_ms_mean:.0f} ms"),
        dict(technique="chunked prefill",
             metric=f"engine throughput while busy (tokens/s), off -> {on}",
             baseline=b.tokens_per_busy_s, treated=t.tokens_per_busy_s,
             article_claim="(not stated)",
             mechanism=f"engine steps {b.engine_steps:.0f} -> {t.engine_steps:.0f}; output "
                       f"{b.output_tok_s:.1f} -> {t.output_tok_s:.1f} tok/s over a fixed "
                       "arrival schedule"),
    ]


def arm_notes(table: pd.DataFrame) -> list[str]:
    """One line per arm for the results' notes: stall, short and long TTFT."""
    return [f"{label}: stall max ITL {row.stall_itl_ms_max:.0f} ms, short TTFT p99 "
            f"{row.short_ttft_ms_p99:.0f} ms, long TTFT {row.long_ttft_ms_median:.0f} ms"
            for label, row in table.iterrows()]


def _change(before: float, after: float) -> str:
    pct = (after - before) / before * 100 if before else float("nan")
    return f"{before:,.0f} → {after:,.0f} ms ({pct:+.0f}%)"


def run_summary(table: pd.DataFrame) -> str:
    """`this_run` of the headline pair, or what was measured without one."""
    off, on = headline_arms(table)
    if off is not None and on is not None:
        return this_run(*headline_rows(table), on)
    if table.empty:
        return "No arm ran here, so there is nothing to compare (see the skipped arms above)."
    lines = [f"- **{label}**: short-request TTFT p99 {row.short_ttft_ms_p99:,.0f} ms; decode "
             f"stall (max ITL of requests streaming when a long prompt arrived) "
             f"{row.stall_itl_ms_max:,.0f} ms; long-request TTFT {row.long_ttft_ms_median:,.0f} ms"
             for label, row in table.iterrows()]
    return ("In this run nothing is compared (chunked prefill off and on did not both run): "
            "what each arm measured.\n\n" + "\n".join(lines))


def this_run(b: pd.Series, t: pd.Series, label: str) -> str:
    """What this run measured, off against `label`, as Markdown sentences whose
    directions are read from the numbers (the notebook's conclusions cite it)."""
    def way(before: float, after: float, less: str, more: str) -> str:
        return less if after < before else more
    lines = [
        f"- **Decode stall** (largest gap between tokens of requests streaming when a long "
        f"prompt landed): {_change(b.stall_itl_ms_max, t.stall_itl_ms_max)}; the largest "
        f"prefill in one engine step {b.max_prefill_tokens_per_step:,.0f} → "
        f"{t.max_prefill_tokens_per_step:,.0f} tokens.",
        f"- **Short-request TTFT p99**: {_change(b.short_ttft_ms_p99, t.short_ttft_ms_p99)}, "
        + way(b.short_ttft_ms_p99, t.short_ttft_ms_p99, "better with chunking", "worse with "
              "chunking") + f"; short requests sent during a long prefill waited "
        f"{_change(b.blocked_short_ttft_ms_median, t.blocked_short_ttft_ms_median)} (median).",
        f"- **Long-request TTFT**: {_change(b.long_ttft_ms_median, t.long_ttft_ms_median)}: the "
        "long prompts " + way(b.long_ttft_ms_median, t.long_ttft_ms_median, "gained", "paid")
        + f"; engine throughput while busy {b.tokens_per_busy_s:,.0f} → "
        f"{t.tokens_per_busy_s:,.0f} tokens/s.",
        f"- **vLLM's waiting queue** (`vllm:num_requests_waiting`, sampled every 0.25 s): at "
        f"most {b.waiting_max:.0f} → {t.waiting_max:.0f} requests, "
        f"{b.waiting_mean:.2f} → {t.waiting_mean:.2f} on average.",
    ]
    return f"In this run (off → {label}):\n\n" + "\n".join(lines)


#: The columns the notebook shows first (the rest of `arm_row` is mechanism).
SUMMARY_COLUMNS = ["short_ttft_ms_p50", "short_ttft_ms_p99", "blocked_short_ttft_ms_median",
                   "long_ttft_ms_median", "stall_itl_ms_max", "stall_itl_ms_p99",
                   "stalled_requests", "stalled_e2e_ms_median", "output_tok_s", "duration_s",
                   "host_load_1m"]
MECHANISM_COLUMNS = ["max_prefill_tokens_per_step", "max_step_ms", "prefill_steps",
                     "engine_steps", "tokens_per_busy_s", "server_ttft_ms_p99",
                     "server_itl_ms_p99", "server_queue_ms_mean", "server_prefill_ms_mean",
                     "waiting_max", "waiting_mean", "prefix_cache_hits"]

__all__ = ["ArmRun", "MECHANISM_COLUMNS", "PlacedLoad", "SUMMARY_COLUMNS", "StepLog",
           "arm_flags", "arm_label", "arm_notes", "arm_row", "chunked_prefill_sweep",
           "SERVER_ARM", "explore_arm", "findings", "remote_arms_mapped", "run_summary", "load_for", "place_load", "headline_arms", "headline_rows", "mixed_schedule", "mixed_workload",
           "parse_iteration_log", "plan", "plot_steps", "plot_sweep", "run_arm", "step_stats",
           "sweep_arm", "sweep_plan", "sweep_table", "this_run", "vllm_source"]
