"""Experiments of `11_model_tiering`: the same mixed workload served by the
large model only, by the small model only, and routed per request by
`lab_utils.tiering.Router`; answer quality of both tiers and of the routed
mix on datasets/quality_questions.jsonl.

Tiers are two engines of the profile running side by side (`plan`: two arms
alive together): the main model (large) and the profile's `small` role. On
the `cpu` profile the small tier is the embedded model's W8A8-INT8 copy built
by `lab_utils.quantize` (the only smaller derivative that still answers: cut
copies lose nearly every answer), in the dtype this machine's probe runs it in
(`small_tier_flags`); on `gpu` it is Qwen2.5-1.5B-Instruct beside
Qwen2.5-7B-Instruct; on `remote` map a second server to the `small` role
(`LAB_REMOTE_ARMS`).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .. import arms
from ..arms import ROLE
from ..client import Load, RequestRecord, RequestSpec
from ..counters import delta, scrape
from ..cpu_tuning import core_shares
from ..figures.model_tiering import plot_confidence, plot_latency
from ..host import EngineCPU
from ..metrics import percentile_stats, records_frame
from ..profiles import ConfigError, Profile
from ..quality import answer_specs, answers_frame
from ..results import Results, measure
from ..tiering import LARGE, SMALL, Router, TieredClient, TierRule, confidence, tier_of
from ..workloads import (
    answer_is_correct,
    chat,
    chat_questions,
    code_edit_specs,
    quality_questions,
    tokenizer_for,
    warm_up,
)

CLAIM = "model tiering (route easy requests to a smaller model): TTFT -20-40%, TPOT -30-50%"
TIERS = (LARGE, SMALL)
ARMS = ("large only", "small only", "routed")


# --------------------------------------------------------------------------
# Engines and workload
# --------------------------------------------------------------------------

#: The profile role that serves the small tier (`[models] small = ...`).
SMALL_ROLE = "small"
BIND = "VLLM_CPU_OMP_THREADS_BIND"


def split_core_env(cores: Sequence[int] | None = None) -> dict[str, dict[str, str]]:
    """Per-tier `VLLM_CPU_OMP_THREADS_BIND` (`cpu_tuning.core_shares`): the
    large tier gets the first share of this process's cores (the extra core of
    an odd count), the small tier the rest."""
    try:
        large, small = core_shares(2, list(cores) if cores is not None else None)
    except ValueError as e:
        raise ConfigError(f"split_cores: {e}") from None
    return {LARGE: {BIND: large}, SMALL: {BIND: small}}


def tier_env(profile: Profile, split_cores: bool = False) -> dict[str, dict[str, str]]:
    """Each tier's extra server environment: none (both engines use every core,
    as vLLM does unless told otherwise), or with `split_cores` (local CPU
    engines only) each bound to its own half of the cores."""
    if not split_cores:
        return {LARGE: {}, SMALL: {}}
    if profile.device != "cpu" or profile.is_remote:
        raise ConfigError(f"split_cores binds vLLM's CPU threads ({BIND}); profile "
                          f"{profile.name!r} is not a local CPU engine: set split_cores = False")
    return split_core_env()


def small_tier_flags(profile: Profile) -> tuple[dict[str, Any], str]:
    """The small tier's dtype on a local CPU, from this machine's capability
    probe (`lab_utils.capabilities.arm_why_not`): the profile's own when its
    small model runs in it, else the other full-precision dtype where that runs
    (vLLM's INT8 GEMM on AMX takes only bfloat16 activations:
    "int8_scaled_mm_with_quant: expect A to be bfloat16 or half"), with a note
    saying so; with neither, no flags and a note of both reasons (the engine
    cell then skips the tier with them). ({}, "") off the cpu profile, or
    when no probe candidate describes the small model."""
    from ..capabilities import arm_why_not
    base = str(profile.engine.get("dtype", "float32"))
    whys = []
    for dtype in [base] + [d for d in ("float32", "bfloat16") if d != base]:
        flags = {} if dtype == base else {"dtype": dtype}
        why = arm_why_not(profile, SMALL_ROLE, flags)
        if not why:
            return flags, (f"small tier in {dtype}: its model does not run in the profile's "
                           f"{base} here ({'; '.join(whys)})" if flags else "")
        whys.append(f"{dtype}: {why}")
    return {}, "small tier: " + "; ".join(whys)


def plan(profile: Profile, params: Mapping[str, Any]) -> arms.Plan:
    """The two tiers, alive at once (the routed arm alternates between them):
    the profile's main model (large, the baseline) and its `small` role. On a
    GPU they share one device: each gets its part of the profile's
    gpu_memory_utilization, in proportion to its weights and one
    max_model_len of KV (`lab_utils.plan.memory_shares`), as vLLM refuses a
    second engine whose share exceeds the memory the first left free."""
    from ..plan import memory_shares
    env = tier_env(profile, bool(params.get("split_cores", False)))
    small_flags, note = small_tier_flags(profile)
    tiers = (arms.Arm(LARGE, env=env[LARGE], title="large tier: the profile's model"),
             arms.Arm(SMALL, role=SMALL_ROLE, env=env[SMALL], flags=small_flags,
                      title=f"small tier: the profile's {SMALL_ROLE!r} role"
                            + (f" in {small_flags['dtype']}" if small_flags else "")))
    shares = memory_shares(profile, tiers)
    # With split_cores the small tier also gets the other half of the cores,
    # on a GPU its own memory share: both tiers run at the same time, so it
    # cannot share the large one's binding or memory. Declared together.
    # On a CPU whose INT8 kernel needs bfloat16 the small tier computes in it too.
    knob = tuple(k for k, on in ((ROLE, True), ("dtype", bool(small_flags)),
                                 (arms.env_knob(BIND), bool(env[SMALL])),
                                 ("gpu_memory_utilization", bool(shares))) if on)
    return arms.Plan("11_model_tiering", tuple(
        dataclasses.replace(a, flags={**a.flags, **({"gpu_memory_utilization": shares[a.name]}
                                                    if shares else {})},
                            knob=(knob if len(knob) > 1 else knob[0]) if a.role else None)
        for a in tiers), together=((LARGE, SMALL),), notes=(note,) if note else ())


def tier_engines(ctx) -> dict[str, Any]:
    """Both tiers' engines (the plan's arms), running side by side (the plan
    keeps two alive); NotebookSkipped if this target cannot serve one of them."""
    return ctx.arms_together(TIERS, "model tiering needs both tiers")


@dataclass
class Workload:
    """The mixed requests, in arrival order, and the expected answers of the
    fact questions (None for requests that are not scored)."""
    specs: list[RequestSpec]
    expected: list[list[str] | None] = field(default_factory=list)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({"task": [s.tag for s in self.specs],
                             "max_tokens": [s.max_tokens for s in self.specs]})


def fact_specs(n: int, max_tokens: int, offset: int = 0) -> tuple[list[RequestSpec], list]:
    qs = quality_questions()
    if n > len(qs):
        raise ValueError(f"there are {len(qs)} quality questions; ask for at most that many")
    chosen = [qs[(offset + i) % len(qs)] for i in range(n)]
    return ([RequestSpec(messages=chat(q["question"]), max_tokens=max_tokens, tag="fact")
             for q in chosen], [q["answer_contains"] for q in chosen])


def mixed_workload(*, facts: int = 12, chats: int = 6, code: int = 3, fact_tokens: int = 32,
                   chat_tokens: int = 64, code_tokens: int = 96, seed: int = 0) -> Workload:
    """Short fact questions (scored), open chat questions and code edits (the
    router's "code" task), shuffled with `seed`."""
    for name, value in (("facts", facts), ("chats", chats), ("code", code)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if facts + chats + code == 0:
        raise ValueError("the workload is empty: ask for some facts, chats or code edits")
    f_specs, f_expected = fact_specs(facts, fact_tokens)
    qs = chat_questions()
    random.Random(seed).shuffle(qs)
    c_specs = [RequestSpec(messages=chat(qs[i % len(qs)]["question"]), max_tokens=chat_tokens,
                           tag="chat") for i in range(chats)]
    e_specs = code_edit_specs(code, max_tokens=code_tokens, tag="code")
    items = list(zip(f_specs, f_expected)) + [(s, None) for s in c_specs + e_specs]
    random.Random(seed).shuffle(items)
    return Workload([s for s, _ in items], [e for _, e in items])


def router_for(engine, rule: TierRule) -> Router:
    """A router that counts prompt tokens with the large model's tokenizer."""
    return Router(rule, tokenizer_for(engine).count)


def rule_from(large_tasks: Sequence[str] | str = ("code", "document"),
              max_small_prompt_tokens: int = 256, min_confidence: float = -1.0,
              probe_tokens: int = 0) -> TierRule:
    """The notebook's parameters as a rule: `probe_tokens` 0 turns the
    confidence probe off; `large_tasks` may be a comma-separated string."""
    if isinstance(large_tasks, str):
        large_tasks = tuple(t.strip() for t in large_tasks.split(",") if t.strip())
    return TierRule(large_tasks=tuple(large_tasks),
                    max_small_prompt_tokens=max_small_prompt_tokens,
                    min_confidence=float(min_confidence) if probe_tokens else None,
                    probe_tokens=probe_tokens or 8)


def routing_plan(router: Router, work: Workload) -> pd.DataFrame:
    """Where the router sends each request before anything runs (the probe,
    if any, can still move a small request to the large model)."""
    rows = []
    for i, s in enumerate(work.specs):
        d = router.route(s)
        rows.append({"request": i, "task": s.tag, "prompt_tokens": router.prompt_tokens(s),
                     "tier": d.tier, "reason": d.reason})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# Quality: every fact question on both tiers, with the probe's signal
# --------------------------------------------------------------------------

def quality_pass(engines: dict[str, Any], *, questions: int = 40, max_tokens: int = 32,
                 probe_tokens: int = 8, concurrency: int = 8, results: Results | None = None,
                 progress: bool = True) -> pd.DataFrame:
    """Each tier answers the first `questions` quality questions (greedy,
    `lab_utils.quality.answer_specs`, a few in flight: answers do not depend on
    timing) with per-token log-probs. One row per (tier, question): the
    answer, whether it is correct, and the mean log-prob of its first
    `probe_tokens` tokens (the router's confidence signal)."""
    specs = [dataclasses.replace(s, extra={"logprobs": True})
             for s in answer_specs(questions, max_tokens)]
    frames = []
    for tier in TIERS:
        run = measure(engines[tier], specs, Load.concurrent(concurrency),
                      label=f"quality/{tier}", results=results, progress=progress, tier=tier)
        frames.append(answers_frame(run.records, tier=tier).assign(
            confidence=[confidence(r.logprobs, probe_tokens) for r in run.records],
            output_tokens=[r.output_tokens for r in run.records]))
    return pd.concat(frames, ignore_index=True)


def answers_side_by_side(quality: pd.DataFrame) -> pd.DataFrame:
    wide = quality.pivot(index=["id", "question"], columns="tier",
                         values=["answer", "correct", "confidence"])
    wide.columns = [f"{v} ({t})" for v, t in wide.columns]
    return wide.reset_index()


def threshold_sweep(quality: pd.DataFrame, thresholds: Sequence[float]) -> pd.DataFrame:
    """What a probe at each threshold would do to the fact questions, composed
    from the two tiers' measured greedy answers: the share escalated to the
    large model and the share answered correctly by the mix."""
    small = quality[quality.tier == SMALL].set_index("id")
    large = quality[quality.tier == LARGE].set_index("id")
    rows = [{"threshold": "no probe", "escalated_pct": 0.0,
             "correct_pct": 100 * small.correct.mean()}]
    for t in thresholds:
        escalate = small.confidence < t
        correct = np.where(escalate, large.correct.reindex(small.index), small.correct)
        rows.append({"threshold": f"{t:g}", "escalated_pct": 100 * escalate.mean(),
                     "correct_pct": 100 * np.mean(correct)})
    rows.append({"threshold": "large only", "escalated_pct": 100.0,
                 "correct_pct": 100 * large.correct.mean()})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------
# Latency: the three arms on the mixed workload
# --------------------------------------------------------------------------

@dataclass
class Arms:
    work: Workload
    rule: TierRule
    runs: dict[str, Any]
    small_counters: dict[str, float | None] = field(default_factory=dict)

    def records(self) -> list[RequestRecord]:
        return [r for run in self.runs.values() for r in run.records]

    def frame(self) -> pd.DataFrame:
        frames = []
        for label, run in self.runs.items():
            f = records_frame(run.records)
            f["arm"] = label
            f["task"] = [self.work.specs[r.index].tag for r in run.records]
            f["tier"] = [tier_of(r) or (LARGE if label == "large only" else SMALL)
                         for r in run.records]
            f["route"] = [r.route for r in run.records]
            f["correct"] = [answer_is_correct(r.text, self.work.expected[r.index])
                            if self.work.expected[r.index] is not None else None
                            for r in run.records]
            frames.append(f)
        return pd.concat(frames, ignore_index=True)


def run_arms(engines: dict[str, Any], work: Workload, rule: TierRule, *,
             concurrency: int = 1, results: Results | None = None,
             progress: bool = True, arms: Sequence[str] = ARMS) -> Arms:
    """The workload on the large model, on the small one, and routed. Each arm
    sends the same requests with the same load; the routed arm's counters are
    read from both engines (vLLM's request and token counters show where the
    requests really went)."""
    load = Load.concurrent(concurrency) if concurrency > 1 else Load.sequential()
    warm_up(engines.values())  # neither arm pays a fresh engine's first-request cost
    runs: dict[str, Any] = {}
    small_counters: dict[str, float | None] = {}
    for label in arms:
        if label == "large only":
            runs[label] = measure(engines[LARGE], work.specs, load, label=label, results=results,
                                  progress=progress, tier=LARGE)
        elif label == "small only":
            runs[label] = measure(engines[SMALL], work.specs, load, label=label, results=results,
                                  progress=progress, tier=SMALL)
        elif label == "routed":
            client = TieredClient.for_engines(engines[SMALL], engines[LARGE],
                                              router_for(engines[LARGE], rule))
            before = scrape(engines[SMALL].base_url, engines[SMALL].api_key)
            runs[label] = measure(engines[LARGE], work.specs, load, label=label,
                                  results=results, progress=progress, client=client,
                                  rule=rule.describe())
            small_counters = delta(before, scrape(engines[SMALL].base_url,
                                                  engines[SMALL].api_key))
            runs[label].counters = {"large": runs[label].counters, "small": small_counters}
            if results is not None:
                results.data["arms"][label]["counters"] = runs[label].counters
                results.save()
        else:
            raise ValueError(f"unknown arm {label!r}; choose from {ARMS}")
    return Arms(work, rule, runs, small_counters)


def _stats(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 of the finite values (already in ms)."""
    s = percentile_stats([x for x in values if x is not None and math.isfinite(x)], scale=1.0)
    return {"p50": s["median"], "p90": s["p90"], "p99": s["p99"]}


def summary(arms: Arms) -> pd.DataFrame:
    """Per arm: TTFT and TPOT percentiles (ms), share served by each model,
    fact questions answered correctly."""
    f = arms.frame()
    rows = []
    for label, g in f.groupby("arm", sort=False):
        ok = g[g.ok]
        row = {"arm": label, "requests": len(g), "failed": int((~g.ok).sum())}
        for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
            for stat, value in _stats(ok[metric]).items():
                row[f"{metric.split('_')[0].upper()} {stat} (ms)"] = value
        row["served by small (%)"] = 100 * (g.tier == SMALL).mean()
        row["escalated (%)"] = 100 * (g.tier == f"{SMALL}->{LARGE}").mean()
        scored = g.dropna(subset=["correct"])
        row["facts correct (%)"] = 100 * scored.correct.astype(bool).mean() if len(scored) else \
            math.nan
        rows.append(row)
    return pd.DataFrame(rows).set_index("arm")


def by_task(arms: Arms) -> pd.DataFrame:
    """Median TTFT and TPOT per task and arm (ms), and the tier each task got."""
    f = arms.frame()
    f = f[f.ok]
    out = f.groupby(["task", "arm"], sort=False).agg(
        requests=("ttft_ms", "size"), ttft_ms=("ttft_ms", "median"),
        tpot_ms=("tpot_ms", "median"),
        tiers=("tier", lambda s: ", ".join(f"{k} {v}" for k, v in s.value_counts().items())))
    return out.round(1)


def mechanism(arms: Arms) -> pd.DataFrame:
    """Where the routed arm's requests went, by the router's records and by
    each engine's own counters (`vllm:request_success_total`; a probe the
    router hung up on is aborted, so it is not a success, but its tokens are
    in `vllm:generation_tokens_total`)."""
    routed = arms.runs.get("routed")
    if routed is None:
        return pd.DataFrame()
    tiers = pd.Series([tier_of(r) for r in routed.records])
    counts = {LARGE: int((tiers == LARGE).sum()), SMALL: int((tiers == SMALL).sum()),
              "escalated": int((tiers == f"{SMALL}->{LARGE}").sum())}
    large_c, small_c = routed.counters.get("large", {}), routed.counters.get("small", {})
    return pd.DataFrame([
        {"engine": "large", "router sent (answers)": counts[LARGE] + counts["escalated"],
         "vLLM requests succeeded": large_c.get("requests_success"),
         "vLLM generation tokens": large_c.get("generation_tokens"),
         "vLLM prompt tokens": large_c.get("prompt_tokens")},
        {"engine": "small", "router sent (answers)": counts[SMALL],
         "probes hung up": counts["escalated"],
         "vLLM requests succeeded": small_c.get("requests_success"),
         "vLLM generation tokens": small_c.get("generation_tokens"),
         "vLLM prompt tokens": small_c.get("prompt_tokens")},
    ]).set_index("engine")


# --------------------------------------------------------------------------
# Two engines on the same cores
# --------------------------------------------------------------------------

#: Where vLLM keeps an idle engine busy: a worker reading the shared-memory
#: message queue spins (sched_yield) for `busy_loop_s` = 1 s after its last
#: read before it sleeps on a socket.
SPIN_SOURCE = "vllm/distributed/device_communicators/shm_broadcast.py (SpinCondition.wait)"


def colocation_check(engines: dict[str, Any], *, repeats: int = 3, quiet_s: float = 2.0,
                     small_tokens: int = 16) -> pd.DataFrame:
    """The large engine's TTFT on a short chat request when the small engine
    has been idle for `quiet_s` against right after the small engine answered
    one request, and the CPU seconds the small engine's processes used in the
    second after its request (local engines only). Every request is a
    different question, so the prefix cache treats both cases alike."""
    from ..client import Client
    small_c, large_c = Client.for_engine(engines[SMALL]), Client.for_engine(engines[LARGE])
    server = getattr(engines[SMALL], "server", None)
    qs = chat_questions()
    rows = []
    for i in range(repeats):
        q = [RequestSpec(messages=chat(qs[(3 * i + k) % len(qs)]["question"]), max_tokens=4,
                         tag="probe") for k in range(3)]
        small = RequestSpec(messages=q[1].messages, max_tokens=small_tokens, tag="small")
        time.sleep(quiet_s)
        quiet = large_c.run([q[0]], progress=False).records[0]
        small_c.run([small], progress=False)
        after = large_c.run([q[2]], progress=False).records[0]
        spin = math.nan
        if server is not None and server.proc is not None:
            time.sleep(quiet_s)  # let the small engine go idle, then measure one request's tail
            small_c.run([small], progress=False)
            with EngineCPU(engines[SMALL]) as cpu:
                time.sleep(1.0)
            spin = cpu.cpu_s
        rows.append({"repeat": i, "large TTFT, small idle (ms)": quiet.ttft * 1e3,
                     "large TTFT, right after a small request (ms)": after.ttft * 1e3,
                     "small engine CPU s in the 1 s after its request": spin})
    return pd.DataFrame(rows).set_index("repeat")


# --------------------------------------------------------------------------
# Findings and plots
# --------------------------------------------------------------------------

def model_name(engine) -> str:
    """A short name for the model an engine serves (its folder or hub id)."""
    path = getattr(engine, "model_path", None) or engine.model
    return str(path).rstrip("/").split("/")[-1]


def tier_speed(arms: Arms) -> str:
    """One sentence on whether the small tier is faster than the large one in this
    run (small only against large only, TTFT and TPOT medians): tiering can only cut
    latency with a faster tier, and a quantized copy is slower where this machine's
    kernels for it are (vLLM's INT8 GEMM without AVX-512, for one). Empty when an arm is
    missing."""
    f = arms.frame()
    f = f[f.ok]
    large, small = f[f.arm == "large only"], f[f.arm == "small only"]
    if large.empty or small.empty:
        return ""
    ratios = {m: float(small[k].median() / large[k].median())
              for m, k in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))}
    parts = ", ".join(f"{m} {r:.2f}x the large tier's" for m, r in ratios.items())
    slower = [m for m, r in ratios.items() if r >= 1.0]
    if not slower:
        return f"the small tier is the faster one here: {parts} (medians, each tier alone)"
    return (f"the small tier is not faster here ({parts}; medians, each tier alone): "
            f"routing to it cannot cut {' or '.join(slower)} on this machine, whatever the "
            "rule; the engines' logs name the kernels each tier ran")


def findings(arms: Arms, quality: pd.DataFrame | None = None,
             small_model: str = "") -> list[dict[str, Any]]:
    """`Results.add_finding` arguments: the routed mix against the large model
    alone (TTFT and TPOT medians with bootstrap intervals, for the checklist),
    the small tier alone as the upper bound, and the quality price."""
    f = arms.frame()
    f = f[f.ok]
    get = {label: f[f.arm == label] for label in arms.runs}
    table = summary(arms)
    out = []
    mech = mechanism(arms)
    share = table.loc["routed", "served by small (%)"] if "routed" in table.index else math.nan
    reason = f"{share:.0f}% of requests on the small tier"
    if small_model:
        reason += f" ({small_model})"
    speed = tier_speed(arms)
    if speed.startswith("the small tier is not faster"):
        reason += f"; {speed}"
    if quality is not None and len(quality):
        pct = quality.groupby("tier").correct.mean() * 100
        reason += (f"; facts correct: small {pct.get(SMALL, math.nan):.0f}%, "
                   f"large {pct.get(LARGE, math.nan):.0f}%")
    for metric, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")):
        base = get.get("large only")
        if base is None:
            continue
        for label, tag in (("routed", f"model tiering:{metric.lower()}"), ("small only", None)):
            if label not in get:
                continue
            treated = get[label]
            out.append({
                "technique": "model tiering", "metric": f"{metric} median, {label} (ms)",
                "baseline": float(base[key].median()), "treated": float(treated[key].median()),
                "article_claim": CLAIM,
                "mechanism": (f"{share:.0f}% of requests answered by the small model; "
                              f"vLLM's request_success counters: {_served(mech)}"
                              if label == "routed" else
                              "every request on the small model" + (f"; {speed}" if speed else "")),
                "samples": (base[key].tolist(), treated[key].tolist()),
                **({"checklist": tag, "reason": reason} if tag else {})})
    if quality is not None and len(quality):
        by_tier = quality.groupby("tier").correct.mean() * 100
        routed_correct = table.loc["routed", "facts correct (%)"] if "routed" in table.index \
            else math.nan
        out.append({"technique": "model tiering", "metric": "fact questions correct (%)",
                    "baseline": float(by_tier.get(LARGE, math.nan)),
                    "treated": float(by_tier.get(SMALL, math.nan)),
                    "article_claim": CLAIM + " (the article names no quality cost)",
                    "mechanism": f"{int(quality.groupby('tier').size().iloc[0])} questions per "
                                 f"tier, greedy; the routed mix's scored facts: "
                                 f"{routed_correct:.0f}% correct"})
    return out


def _served(mech: pd.DataFrame) -> str:
    if mech.empty:
        return "not read"
    return ", ".join(f"{engine} {value:.0f}" if value is not None and math.isfinite(value)
                     else f"{engine} n/a"
                     for engine, value in mech["vLLM requests succeeded"].items())


def explore(engines: dict[str, Any], work: Workload, baseline: Arms, **rule_kw: Any):
    """Re-run the routed arm with another rule and show it beside the
    notebook's large-only and small-only arms."""
    rule = rule_from(**rule_kw)
    routed = run_arms(engines, work, rule, arms=("routed",), progress=False)
    both = Arms(work, rule, {**{k: v for k, v in baseline.runs.items() if k != "routed"},
                             "routed": routed.runs["routed"]})
    print(rule.describe())
    return summary(both).round(1)


__all__ = [
    "ARMS",
    "CLAIM",
    "Arms",
    "Workload",
    "answers_side_by_side",
    "by_task",
    "colocation_check",
    "explore",
    "fact_specs",
    "findings",
    "mechanism",
    "mixed_workload",
    "model_name",
    "plan",
    "plot_confidence",
    "plot_latency",
    "quality_pass",
    "router_for",
    "routing_plan",
    "rule_from",
    "run_arms",
    "split_core_env",
    "summary",
    "threshold_sweep",
    "tier_engines",
    "tier_env",
    "tier_speed",
]
