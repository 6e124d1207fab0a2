"""Experiments of `03_prompt_length_and_warmup`: does a shorter system prompt
lower TTFT (with the prefix cache off and on), does it keep the behaviour the
prompt asks for, and what does the first request after a server start cost
(cold) against later ones (warm), with and without the article's warm-up
routine (`warm_up`: one `max_tokens=1` request, then pre-filling prefixes).

vLLM caches whole KV blocks only (`block_size` tokens, 128 on the CPU build),
so a prefix that fills less than one block can never be a prefix-cache hit:
`prefix_blocks` and the per-request `cached_tokens` make that visible.
"""
from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd

from .. import arms
from ..client import Load, RequestSpec, Run
from ..counters import block_size_of, prefix_caching_of
from ..errors import ConfigError
from ..metrics import summarize
from ..results import Results, measure
from ..vllm_logs import latest_start, log_after_startup, startup_events
from ..workloads import chat, chat_questions, system_prompts

#: The notebook's two engines (`plan`): vLLM's prefix cache off and on.
CACHE_OFF, CACHE_ON = "cache off", "cache on"

#: System prompts by name: the dataset's verbose and compact forms, or none.
PROMPT_NAMES = ("long", "short", "none")

#: The system prompt of the cold-start requests: the article's own warm-up
#: prefix, so the warm-up routine pre-fills exactly what the first user sends.
COLD_SYSTEM = "You are a professional assistant."

_QUALITY_COLUMNS = ["check", "question", "expect_any", "system_prompt", "answer", "passed",
                    "output_tokens", "finish_reason"]
_PROMPT_COLUMNS = ["system_prompt", "prefix_caching", "question", "prompt_tokens",
                   "cached_tokens", "output_tokens", "ttft_ms", "e2e_ms", "tpot_ms", "ok"]


def plan(profile, params) -> arms.Plan:
    """Two engines that differ in `enable_prefix_caching`: off first (the
    baseline, a server that recomputes every prompt: section 1), then on,
    vLLM's default, said explicitly so the two command lines differ in that
    one flag. The cold-start experiment starts the "on" arm afresh
    `fresh_starts` times (`fresh_engine`): the same engine, a new process."""
    return arms.Plan("03_prompt_length_and_warmup", (
        arms.Arm(CACHE_OFF, {"enable_prefix_caching": False}, fresh=True,
                 title="prefix cache off: every request prefills its whole prompt"),
        arms.Arm(CACHE_ON, {"enable_prefix_caching": True}, knob="enable_prefix_caching",
                 fresh=True, title="prefix cache on (vLLM's default)")))


# --------------------------------------------------------------------------
# Pure helpers (unit-tested without a server)
# --------------------------------------------------------------------------

def system_prompt_text(name: str) -> str | None:
    """The text of system prompt `name` ("long", "short") or None for "none"."""
    if name not in PROMPT_NAMES:
        raise ValueError(f"unknown system prompt {name!r}; choose from {PROMPT_NAMES}")
    return None if name == "none" else system_prompts()[name]


def interleaved_specs(names: Sequence[str], n_questions: int, *, max_tokens: int = 16,
                      first_question: int = 0) -> list[RequestSpec]:
    """`n_questions` chat questions, each asked once with every system prompt
    in `names`, alternating (q1/long, q1/short, q2/long, ...) so that a load
    change on a shared machine hits every arm alike. Tag = prompt name."""
    if n_questions < 1:
        raise ValueError(f"n_questions must be >= 1, got {n_questions!r}")
    qs = chat_questions()
    specs = []
    for i in range(n_questions):
        q = qs[(first_question + i) % len(qs)]["question"]
        for name in names:
            specs.append(RequestSpec(messages=chat(q, system_prompt_text(name)),
                                     max_tokens=max_tokens, tag=name))
    return specs


def check_passed(answer: str, expect_any: Iterable[str]) -> bool:
    """The dataset's rule: the lower-cased answer contains one expected string."""
    text = (answer or "").lower()
    return any(e.lower() in text for e in expect_any)


def prefix_blocks(prompt_tokens: int | None, block_size: int | None) -> int | None:
    """Whole KV blocks a prompt fills: the most of it the prefix cache can hold."""
    if prompt_tokens is None or not block_size:
        return None
    return int(prompt_tokens) // int(block_size)


def side_by_side(frame: pd.DataFrame) -> pd.DataFrame:
    """Quality checks wide: one row per check, answer and pass per prompt."""
    if frame.empty:
        return frame
    wide = frame.pivot_table(index=["check", "question"], columns="system_prompt",
                             values=["answer", "passed"], aggfunc="first")
    out = pd.DataFrame(index=wide.index)
    for name in dict.fromkeys(frame.system_prompt):
        out[f"{name}: pass"] = wide[("passed", name)].map({True: "PASS", False: "fail"})
        out[f"{name}: answer"] = wide[("answer", name)]
    return out.reset_index()


def summary_by(frame: pd.DataFrame, by: Sequence[str],
               metrics: Sequence[str] = ("ttft_ms", "e2e_ms")) -> pd.DataFrame:
    """Median, p90, p99 of each metric per group, with request counts and the
    median prompt and cached tokens (the mechanism next to the latency)."""
    if frame.empty:
        return pd.DataFrame()
    ok = frame[frame["ok"].astype(bool)] if "ok" in frame else frame
    g = ok.groupby(list(by), sort=False)
    out = g.size().rename("requests").to_frame()
    for col in ("prompt_tokens", "cached_tokens"):
        if col in ok:
            out[f"{col}_median"] = g[col].median()
    for m in metrics:
        out[f"{m}_median"] = g[m].median()
        out[f"{m}_p90"] = g[m].quantile(0.9)
        out[f"{m}_p99"] = g[m].quantile(0.99)
    return out


# --------------------------------------------------------------------------
# Shorter input: TTFT and total latency per system prompt and cache setting
# --------------------------------------------------------------------------

def fresh_engine(ctx, arm: str):
    """A newly started server of the plan's `arm`: every server of the
    notebook is stopped first, so it is a new process that has served
    nothing; its launch and ready times go to `engine.info["launched_at"]` /
    `["ready_at"]` (ISO text). None (noted) when the target cannot serve it."""
    if ctx.plan is not None and not ctx.plan.arm(arm).fresh:
        raise ConfigError(f"arm {arm!r} of {ctx.name} is not declared fresh=True: "
                          "the run's broker could lend it an engine that has served")
    ctx.engines.close()
    launched = _dt.datetime.now()
    engine = ctx.arm(arm)  # a fresh arm: never an engine the run's broker lends
    if engine is not None:
        engine.info["launched_at"] = launched.isoformat(timespec="seconds")
        engine.info["ready_at"] = _dt.datetime.now().isoformat(timespec="seconds")
    return engine


def prompt_length_arm(ctx, arm: str, n_questions: int, *,
                      prompts: Sequence[str] = ("long", "short"), max_tokens: int = 16,
                      results: Results | None = None, progress: bool = True) -> pd.DataFrame:
    """Sequential requests, the same questions with each system prompt in turn,
    on the engine of the plan's `arm` (empty, and noted, when the target
    cannot serve it). One row per request."""
    engine = ctx.arm(arm)
    if engine is None:
        return pd.DataFrame(columns=_PROMPT_COLUMNS)
    specs = interleaved_specs(prompts, n_questions, max_tokens=max_tokens)
    state = "on" if prefix_caching_of(engine) else "off"  # what the server says it runs with
    label = f"system prompt {'/'.join(prompts)}, prefix caching {state}"
    run = measure(engine, specs, Load.sequential(), label=label, results=results,
                  progress=progress)
    if results is not None:  # the arm mixes prompts: add a summary per prompt
        results.data["arms"][label]["by_system_prompt"] = {
            name: summarize([r for r in run.records if r.tag == name], run.duration_s)
            for name in prompts}
        results.save()
    frame = run.frame()
    questions = [s.messages[-1]["content"] for s in specs]
    frame = frame.assign(system_prompt=frame.tag, prefix_caching=state,
                         question=[questions[i] for i in frame["index"]])
    frame.attrs["counters"] = run.counters
    frame.attrs["engine"] = engine.label
    return frame


# --------------------------------------------------------------------------
# Quality: does the shorter prompt keep the behaviour?
# --------------------------------------------------------------------------

def quality_checks(engine, prompts: Sequence[str] = ("long", "short"), *,
                   max_tokens: int = 80, results: Results | None = None,
                   progress: bool = True) -> pd.DataFrame:
    """The dataset's fixed checks, answered greedily (temperature 0) with each
    system prompt. All requests go in at once: decode steps are batched, so the
    check costs about as much as its longest answer."""
    if engine is None:
        return pd.DataFrame(columns=_QUALITY_COLUMNS)
    checks = system_prompts()["checks"]
    specs, meta = [], []
    for k, check in enumerate(checks, 1):
        for name in prompts:
            specs.append(RequestSpec(messages=chat(check["question"], system_prompt_text(name)),
                                     max_tokens=max_tokens, temperature=0.0, tag=name))
            meta.append((k, check))
    run = measure(engine, specs, Load.concurrent(len(specs)), label="quality checks",
                  results=results, progress=progress)
    rows = []
    for rec in sorted(run.records, key=lambda r: r.index):
        k, check = meta[rec.index]
        rows.append({"check": k, "question": check["question"],
                     "expect_any": ", ".join(check["expect_any"]), "system_prompt": rec.tag,
                     "answer": rec.text.strip(), "passed": rec.ok and check_passed(
                         rec.text, check["expect_any"]),
                     "output_tokens": rec.output_tokens, "finish_reason": rec.finish_reason})
    return pd.DataFrame(rows, columns=_QUALITY_COLUMNS)


# --------------------------------------------------------------------------
# Warm-up: the article's routine, and cold against warm requests
# --------------------------------------------------------------------------

def warm_up(engine, prefixes: Sequence[str], *, dummy: bool = True,
            results: Results | None = None, label: str = "warm-up routine",
            progress: bool = False) -> pd.DataFrame:
    """The article's start-up routine: one dummy `max_tokens=1` request, then
    one `max_tokens=1` request per prefix, sent as the system message so its
    tokens are exactly what a later chat request with that system prompt
    starts with. Returns one row per warm-up request: its prompt tokens, the
    whole KV blocks it fills (what the prefix cache can keep of it) and TTFT;
    `attrs["counters"]` holds the /metrics deltas of the routine."""
    specs = [RequestSpec(messages=chat("Hello"), max_tokens=1, tag="dummy")] if dummy else []
    specs += [RequestSpec(messages=[{"role": "system", "content": p}], max_tokens=1,
                          tag="prefix") for p in prefixes]
    if engine is None or not specs:
        return pd.DataFrame(columns=["step", "text", "prompt_tokens", "kv_blocks", "ttft_ms"])
    run = measure(engine, specs, Load.sequential(), label=label, results=results,
                  progress=progress)
    block = block_size_of(engine)
    rows = []
    for rec in sorted(run.records, key=lambda r: r.index):
        spec = specs[rec.index]
        text = spec.messages[-1]["content"]
        rows.append({"step": "dummy, max_tokens=1" if spec.tag == "dummy" else "pre-fill prefix",
                     "text": text if len(text) <= 60 else text[:57] + "...",
                     "prompt_tokens": rec.prompt_tokens,
                     "kv_blocks": prefix_blocks(rec.prompt_tokens, block),
                     "ttft_ms": rec.ttft * 1e3 if rec.ttft is not None else math.nan})
    frame = pd.DataFrame(rows)
    frame.attrs["counters"] = run.counters
    frame.attrs["block_size"] = block
    return frame


_REQUEST_COLUMNS = ["start", "arm", "engine", "order", "request", "ttft_ms", "e2e_ms",
                    "prompt_tokens", "cached_tokens", "server_ttft_ms", "server_queue_ms",
                    "server_prefill_ms", "prefix_cache_hits", "startup_s"]


def _server_split(counters: dict | None) -> dict[str, float]:
    """The server's own view of one request (histogram deltas of a run of one)."""
    c = counters or {}
    ms = lambda key: c[key] * 1e3 if c.get(key) is not None else math.nan  # noqa: E731
    return {"server_ttft_ms": ms("server_ttft_s_mean"),
            "server_queue_ms": ms("server_queue_s_mean"),
            "server_prefill_ms": ms("server_prefill_s_mean"),
            "prefix_cache_hits": c.get("prefix_cache_hits", math.nan)}


def measure_one_by_one(engine, specs: Sequence[RequestSpec], *, label: str,
                       results: Results | None = None) -> list[Run]:
    """Send `specs` one at a time, each as its own run with its own /metrics
    deltas (so the server's TTFT, queue and prefill histograms describe that
    request alone), and record them together as one arm."""
    runs = [measure(engine, [spec], Load.sequential(), label=label, progress=False)
            for spec in specs]
    for i, run in enumerate(runs):
        run.records[0].index = i
    if results is not None:
        keys = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens",
                "generation_tokens", "requests_success")
        total = {k: sum((run.counters or {}).get(k) or 0.0 for run in runs) for k in keys}
        combined = Run(label, "sequential x1, one /metrics delta per request",
                       [run.records[0] for run in runs], sum(run.duration_s for run in runs),
                       counters=total)
        results.add_engine(engine)
        results.add_run(combined, engine=engine.label,
                        server_per_request=[_server_split(run.counters) for run in runs])
    return runs


def first_requests(engine, warm_requests: int, *, start: int, arm: str,
                   system: str = COLD_SYSTEM, max_tokens: int = 8,
                   results: Results | None = None) -> pd.DataFrame:
    """The first user request on a fresh `engine`, then `warm_requests` more,
    one at a time, all with the same short system prompt (under one KV block,
    so the prefix cache cannot make the later ones cheaper). One row per
    request, with the server's own TTFT/queue/prefill split of it."""
    if engine is None or engine.server is None:
        if results is not None:
            results.note(f"start {start} ({arm}): skipped, the lab did not start this server, "
                         "so its first request is not a cold one")
        return pd.DataFrame(columns=_REQUEST_COLUMNS)
    qs = chat_questions()
    specs = [RequestSpec(messages=chat(qs[i % len(qs)]["question"], system),
                         max_tokens=max_tokens, tag="first" if i == 0 else "later")
             for i in range(1 + warm_requests)]
    prefix = f"start {start} ({arm})"
    runs = measure_one_by_one(engine, specs[:1], label=f"{prefix}: first request",
                              results=results)
    if warm_requests:
        runs += measure_one_by_one(engine, specs[1:], results=results,
                                   label=f"{prefix}: next {warm_requests} requests")
    rows = []
    for order, run in enumerate(runs, 1):
        rec = run.records[0]
        rows.append({"start": start, "arm": arm, "engine": engine.label, "order": order,
                     "request": "first" if order == 1 else "later",
                     "ttft_ms": rec.ttft * 1e3 if rec.ttft is not None else math.nan,
                     "e2e_ms": rec.e2e * 1e3 if rec.e2e is not None else math.nan,
                     "prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens,
                     **_server_split(run.counters), "startup_s": engine.server.startup_s})
    return pd.DataFrame(rows, columns=_REQUEST_COLUMNS)


def startup_timeline(engine) -> pd.DataFrame:
    """`startup_events` of the engine's latest start, counted from the moment
    the notebook asked for it (`fresh_engine`), ending with its first healthy
    answer to GET /health."""
    if engine is None or engine.server is None:
        return pd.DataFrame(columns=["event", "log_time", "since_launch_s", "reported_s"])
    iso = lambda key: _dt.datetime.fromisoformat(engine.info[key]) \
        if engine.info.get(key) else None  # noqa: E731
    launched, ready = iso("launched_at"), iso("ready_at")
    log = Path(engine.server.log_path).read_text(errors="replace")
    frame = startup_events(log, launched)
    if launched and ready:
        frame.loc[len(frame)] = {"event": "healthy (GET /health answers 200)",
                                 "log_time": ready.strftime("%m-%d %H:%M:%S"),
                                 "since_launch_s": (ready - launched).total_seconds(),
                                 "reported_s": engine.server.startup_s}
    return frame


def cold_start_experiment(ctx, arm: str, fresh_starts: int, warm_requests: int,
                          prefixes: Sequence[str], *, results: Results | None = None
                          ) -> tuple[pd.DataFrame, list[pd.DataFrame], list[pd.DataFrame]]:
    """`fresh_starts` new servers of the plan's `arm`, alternating: without warm-up,
    then with `warm_up(engine, prefixes)` before the first user request.
    Returns (one row per user request, start-up timelines, warm-up frames);
    the last server is left running for the next experiments."""
    frames, timelines, warmups = [], [], []
    for i in range(1, fresh_starts + 1):
        with_warmup = i % 2 == 0
        engine = fresh_engine(ctx, arm)
        if engine is None or engine.server is None:
            (results or ctx.results).note("cold-start experiment skipped: the lab can only "
                                          "restart servers it started itself")
            break
        timelines.append(startup_timeline(engine).assign(start=i))
        if with_warmup:
            warmups.append(warm_up(engine, prefixes, results=results,
                                   label=f"start {i}: warm-up routine").assign(start=i))
        frames.append(first_requests(engine, warm_requests, start=i, results=results,
                                     arm="warm-up routine" if with_warmup else "no warm-up"))
    requests = pd.concat(frames, ignore_index=True) if frames else \
        pd.DataFrame(columns=_REQUEST_COLUMNS)
    return requests, timelines, warmups


def ttft_by_order(requests: pd.DataFrame) -> pd.DataFrame:
    """TTFT (ms) of each request after a start: rows = position, columns = start."""
    if requests.empty:
        return requests
    return requests.pivot_table(index="order", columns=["start", "arm"], values="ttft_ms")


def where_first_request_time_goes(requests: pd.DataFrame) -> pd.DataFrame:
    """Client TTFT split with the server's own histograms, per arm: the first
    request against the later ones (medians of per-request values).
    `http_and_stream_ms` is the part outside vLLM's clock (HTTP parsing,
    response streaming); `frontend_ms` is chat-template rendering, tokenizing
    and the hand-off to the engine core; `prefill_ms` is the forward pass and
    sampling of the first token; `queue_ms` the wait for a scheduler slot."""
    if requests.empty:
        return requests
    parts = requests.assign(
        http_and_stream_ms=requests.ttft_ms - requests.server_ttft_ms,
        frontend_ms=requests.server_ttft_ms - requests.server_queue_ms - requests.server_prefill_ms)
    g = parts.groupby(["arm", "request"], sort=False)
    return g.agg(requests=("ttft_ms", "size"), client_ttft_ms=("ttft_ms", "median"),
                 http_and_stream_ms=("http_and_stream_ms", "median"),
                 server_ttft_ms=("server_ttft_ms", "median"),
                 frontend_ms=("frontend_ms", "median"), queue_ms=("server_queue_ms", "median"),
                 prefill_ms=("server_prefill_ms", "median"),
                 cached_tokens=("cached_tokens", "max"))


def explore_prompt_length(ctx, prompts: Sequence[str], arm: str, n_questions: int,
                          max_tokens: int) -> pd.DataFrame:
    """What the Explore widget runs: the prompt-length requests on one arm, summarised."""
    frame = prompt_length_arm(ctx, arm, n_questions, prompts=list(prompts) or ["short"],
                              max_tokens=max_tokens, progress=True)
    return summary_by(frame, ["prefix_caching", "system_prompt"]) if not frame.empty else frame


# --------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------

def shorter_input_findings(off: pd.DataFrame, on: pd.DataFrame) -> list[dict[str, Any]]:
    """Per cache setting that ran: median TTFT and total latency with the
    512-token against the 148-token system prompt, with the prompt tokens the
    engine computed (prompt - cached) and the prefix-cache counters of the arm."""
    both = pd.concat([off, on], ignore_index=True)
    med = both.groupby(["prefix_caching", "system_prompt"])[["ttft_ms", "e2e_ms"]].median()
    tokens = both.assign(computed_tokens=both.prompt_tokens - both.cached_tokens) \
        .groupby(["prefix_caching", "system_prompt"]).computed_tokens.median()
    out = []
    for state, frame in (("off", off), ("on", on)):
        if frame.empty:
            continue
        c = frame.attrs["counters"]
        computed = (f"computed prompt tokens per request {tokens[(state, 'long')]:.0f} -> "
                    f"{tokens[(state, 'short')]:.0f}" if frame.cached_tokens.notna().any() else
                    "computed prompt tokens per request not reported (the server runs without "
                    "--enable-prompt-tokens-details)")
        evidence = (f"{computed}; vllm:prefix_cache_hits "
                    f"{c['prefix_cache_hits']:.0f} of {c['prefix_cache_queries']:.0f} queried "
                    "tokens")
        out += [dict(technique=f"shorter input (prefix cache {state})",
                     metric=f"{name} median (ms), 512- -> 148-token system prompt",
                     baseline=med.loc[(state, "long"), metric],
                     treated=med.loc[(state, "short"), metric],
                     article_claim="a shorter prompt lowers TTFT (bad: 500 tokens, good: 150)",
                     mechanism=evidence)
                for metric, name in (("ttft_ms", "TTFT"), ("e2e_ms", "total latency"))]
    return out


def quality_findings(quality: pd.DataFrame) -> list[dict[str, Any]]:
    """Quality checks passed with the long against the short prompt (none
    when the checks did not run)."""
    if quality.empty:
        return []
    passed = quality.groupby("system_prompt", sort=False).passed.sum()
    return [dict(technique="shorter input: quality",
                 metric=f"quality checks passed (of {len(quality) // 2}), long -> short prompt",
                 baseline=int(passed.get("long", 0)), treated=int(passed.get("short", 0)),
                 article_claim="(implicit) the shorter prompt keeps the intended behaviour",
                 mechanism="greedy answers of the served model; keyword checks of "
                           "system_prompts.json")]


def warm_up_findings(starts: pd.DataFrame, warmups: Sequence[pd.DataFrame],
                     prefill_real: pd.DataFrame) -> list[dict[str, Any]]:
    """The cold start (first request after a start against the later ones,
    starts without warm-up) and the article's warm-up routine (the first user
    request without and with it), from `cold_start_experiment`'s requests,
    its warm-up frames and the pre-fill of the real system prompts."""
    out = []
    cold = starts[starts.arm.str.startswith("no warm-up")] if len(starts) else starts
    if not cold.empty:
        first, later = cold[cold.request == "first"], cold[cold.request == "later"]
        out.append(dict(
            technique="warm-up: cold start",
            metric="TTFT median (ms), first request after a start -> later requests",
            baseline=first.ttft_ms.median(), treated=later.ttft_ms.median(),
            article_claim="the first request after start pays a cold-start penalty",
            mechanism=f"{cold.start.nunique()} fresh starts; server-side prefill "
                      f"{first.server_prefill_ms.median():.0f} -> "
                      f"{later.server_prefill_ms.median():.0f} ms, frontend (template, "
                      f"tokenizer) {(first.server_ttft_ms - first.server_prefill_ms).median():.0f}"
                      f" -> {(later.server_ttft_ms - later.server_prefill_ms).median():.0f} ms"))
    firsts = starts[starts.request == "first"].groupby("arm") if len(starts) else None
    if warmups and firsts is not None and {"no warm-up", "warm-up routine"} <= set(firsts.groups):
        ttft, cached = firsts.ttft_ms.median(), firsts.cached_tokens.max()
        last = warmups[-1]
        out.append(dict(
            technique="warm-up routine",
            metric="first user request TTFT (ms), no warm-up -> article's warm-up routine",
            baseline=ttft["no warm-up"], treated=ttft["warm-up routine"],
            article_claim="warming up at start removes the cold-start penalty",
            mechanism=f"first user request cached_tokens {cached['no warm-up']:.0f} -> "
                      f"{cached['warm-up routine']:.0f}: the article's prefixes fill "
                      f"{last.kv_blocks.max()} whole {last.attrs['block_size']}-token KV blocks "
                      f"(prefix-cache hits {last.attrs['counters']['prefix_cache_hits']:.0f}); "
                      f"the full system prompts fill {prefill_real.kv_blocks.tolist()} "
                      "(long, short)"))
    return out


def findings(off: pd.DataFrame, on: pd.DataFrame, quality: pd.DataFrame, starts: pd.DataFrame,
             warmups: Sequence[pd.DataFrame], prefill_real: pd.DataFrame) -> list[dict[str, Any]]:
    """The notebook's findings, in its order: shorter input (cache off, on),
    quality, cold start, warm-up routine. A part whose arm did not run here
    gives none."""
    return (shorter_input_findings(off, on) + quality_findings(quality)
            + warm_up_findings(starts, warmups, prefill_real))


__all__ = ["CACHE_OFF", "CACHE_ON", "PROMPT_NAMES", "COLD_SYSTEM", "system_prompt_text", "interleaved_specs",
           "check_passed", "prefix_blocks", "block_size_of", "prefix_caching_of",
           "latest_start", "startup_events", "log_after_startup", "side_by_side", "summary_by",
           "prompt_length_arm", "quality_checks", "warm_up", "fresh_engine", "first_requests",
           "cold_start_experiment", "where_first_request_time_goes", "explore_prompt_length",
           "findings", "measure_one_by_one", "plan", "quality_findings",
           "shorter_input_findings", "startup_timeline", "ttft_by_order", "warm_up_findings"]
