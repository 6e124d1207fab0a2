"""Experiments of `07_streaming`: what streaming changes for the person who
waits (perceived latency) and what it does not change (real latency), sent
straight to vLLM and through the project's streaming app (`lab_utils.app`).

One engine (the plan's baseline arm: the profile's flags; streaming needs no
engine flag) and four client arms, one knob each way: non-streaming vs
streaming (`"stream"` in the request), direct to vLLM vs through the app. The
same prompts go to every arm, one request at a time, in a rotating order so a
busy machine slows every arm alike. `lab_utils.client.Client` only streams,
so each request is timed by `lab_utils.timed_chat` (one aiohttp session,
kept alive): for a non-streamed request the first visible content arrives
with the whole body, so TTFT = E2E = time to the full body, as `vllm bench
serve` counts non-streaming backends.

Per request it measures, from the client's send:
- `ttft_ms`: first chunk with `choices` (vllm bench serve's TTFT);
- `first_content_ms`: first non-empty text the user could see;
- `first_sentence_ms`: first complete sentence (`lab_utils.perceived`, as
  the reading measures below);
- `e2e_ms`: last token chunk (streamed) or full body (non-streamed);
- reading pace: when each word became complete, the fastest reader the stream
  stays ahead of (`max_unstalled_wpm`), and how long a reader at `reading_wpm`
  words/min would wait for words that had not arrived (`reading_stall_ms`);
- vLLM's own view (its TTFT and E2E histograms, scraped around each request):
  the engine makes its first token at the same moment in both modes; only the
  delivery differs.

The figures are `lab_utils.figures.streaming`'s.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..app import AppServer, app_for, dead_upstream_app
from ..arms import Arm, Plan
from ..client import RequestRecord, Run, run_sync
from ..counters import counter_by_label, delta, parse_metrics
from ..figures.streaming import (plot_disconnect, plot_perceived_by_length, plot_reading,
                                 plot_token_arrivals)
from ..http import fetch_raw
from ..metrics import percentile_stats
from ..perceived import (READING_WPM, first_content_time, perceived_reduction_by_length,
                         reading_measures, tokens_for_reduction)
from ..results import Results
from ..sse import decode_events, pop_sse_data
from ..timed_chat import Timed, chat_session, request_body, timed_request
from ..workloads import chat, chat_specs


def plan(profile, params) -> Plan:
    """One engine, the profile's own flags: streaming is a property of each
    request (`"stream": true`), and the app is the engine's client, so the
    four arms below are client-side and share this engine."""
    return Plan("07_streaming", (Arm(
        "baseline", title="the profile's engine flags (streaming is chosen per request)"),))


#: (target, stream) of the four client arms, and their labels.
ARMS: list[tuple[str, bool]] = [("direct", False), ("direct", True), ("app", False),
                                ("app", True)]


def arm_label(target: str, stream: bool) -> str:
    return f"{target}/{'stream' if stream else 'no-stream'}"


# --------------------------------------------------------------------------
# One timed request (any arm)
# --------------------------------------------------------------------------

def _auth(engine) -> dict[str, str] | None:
    """The engine's bearer header (a remote server may want its API key)."""
    return {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else None


async def _chat(session, engine, app: AppServer | None, target: str, messages: list[dict],
                max_tokens: int, stream: bool, index: int) -> Timed:
    """One timed chat request of arm (`target`, `stream`): straight to vLLM
    (with the engine's key) or through the app (which holds the key itself)."""
    direct = target == "direct"
    url = (engine.base_url if direct else app.base_url) + "/v1/chat/completions"
    body = request_body(engine.model, messages, max_tokens, stream)
    return await timed_request(session, url, body, arm=arm_label(target, stream), index=index,
                               headers=_auth(engine) if direct else None)


async def _scrape(session, engine):
    try:
        async with session.get(engine.base_url + "/metrics", headers=_auth(engine)) as resp:
            return parse_metrics(await resp.text()) if resp.status == 200 else None
    except Exception:
        return None


def _server_view(before, after) -> dict[str, float | None]:
    """vLLM's TTFT/E2E for the one request between two scrapes (histogram means)."""
    d = delta(before, after) if before is not None and after is not None else {}
    ms = lambda key: d[key] * 1e3 if d.get(key) is not None else None  # noqa: E731
    return {"server_ttft_ms": ms("server_ttft_s_mean"), "server_e2e_ms": ms("server_e2e_s_mean")}


def _row(t: Timed, reading_wpm: float) -> dict[str, Any]:
    ms = lambda v: v * 1e3 if v is not None and not math.isnan(v) else math.nan  # noqa: E731
    seen = reading_measures(t.times, t.pieces, reading_wpm)
    return {"arm": t.arm, "target": t.arm.partition("/")[0], "stream": t.stream,
            "index": t.index, "ok": t.ok, "error": t.error, "output_tokens": t.output_tokens,
            "cached_tokens": t.cached_tokens, "headers_ms": ms(t.headers_s),
            "ttft_ms": ms(t.ttft_s), "first_content_ms": ms(seen["first_content_s"]),
            "first_sentence_ms": ms(seen["first_sentence_s"]), "e2e_ms": ms(t.e2e_s),
            "words": seen["words"], "max_unstalled_wpm": seen["max_unstalled_wpm"],
            "reading_stall_ms": ms(seen["reading_stall_s"]),
            "reading_done_ms": ms(seen["reading_done_s"]),
            "app_upstream_ttft_ms": ms(t.app_timing.get("upstream_ttft_s")),
            "app_upstream_e2e_ms": ms(t.app_timing.get("upstream_e2e_s")
                                      or t.app_timing.get("upstream_s")),
            "text": t.text}


# --------------------------------------------------------------------------
# Experiments
# --------------------------------------------------------------------------

def prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` chat requests from datasets/chat_questions.jsonl (seeded)."""
    return [spec.messages for spec in chat_specs(n, seed=seed)]


@dataclass
class ArmsResult:
    """What `compare_arms` measured: one row per request, and the requests."""
    frame: pd.DataFrame
    timed: list[Timed]

    def records(self, arm: str | None = None) -> list[RequestRecord]:
        """lab RequestRecords (for `lab.plots`), of one arm or all."""
        return [t.record(t.arm) for t in self.timed if arm is None or t.arm == arm]


def compare_arms(engine, app: AppServer | None, n_prompts: int = 4, max_tokens: int = 48, *,
                 arms: Sequence[tuple[str, bool]] = tuple(ARMS), reading_wpm: float = READING_WPM,
                 seed: int = 0, results: Results | None = None,
                 progress: bool = True) -> ArmsResult:
    """Every prompt through every arm (rotating order), one request at a time,
    with vLLM's /metrics scraped around each request."""
    from tqdm.auto import tqdm
    arms = [a for a in arms if a[0] == "direct" or app is not None]
    batches = prompts(n_prompts, seed)

    async def go():
        timed: list[tuple[Timed, dict]] = []
        bar = tqdm(total=len(batches) * len(arms), desc="streaming arms", disable=not progress,
                   leave=False)
        async with chat_session() as session:
            for i, messages in enumerate(batches):
                for j in range(len(arms)):
                    target, stream = arms[(i + j) % len(arms)]
                    before = await _scrape(session, engine)
                    t = await _chat(session, engine, app, target, messages, max_tokens, stream, i)
                    after = await _scrape(session, engine)
                    timed.append((t, _server_view(before, after)))
                    bar.update(1)
        bar.close()
        return timed

    t_start = time.perf_counter()
    timed = run_sync(go())
    duration = time.perf_counter() - t_start
    frame = pd.DataFrame([{**_row(t, reading_wpm), **server} for t, server in timed])
    result = ArmsResult(frame, [t for t, _ in timed])
    if results is not None:
        for label in dict.fromkeys(t.arm for t in result.timed):
            results.add_run(Run(label, "sequential x1 (arms interleaved)", result.records(label),
                                duration), engine=engine.label, max_tokens=max_tokens)
        results.add_engine(engine)
    return result


def arm_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Median and p90 per arm of what a user perceives vs the real latency."""
    cols = ["ttft_ms", "first_content_ms", "first_sentence_ms", "e2e_ms", "reading_done_ms",
            "server_ttft_ms", "server_e2e_ms"]
    ok = frame[frame.ok]
    table = ok.groupby("arm", sort=False)[cols].agg(["median", lambda s: s.quantile(0.9)])
    table.columns = [f"{c}_{'p50' if s == 'median' else 'p90'}" for c, s in table.columns]
    table["requests"] = ok.groupby("arm", sort=False).size()
    return table


def claim_check(frame: pd.DataFrame, target: str = "direct") -> dict[str, float]:
    """Both halves of "perceived latency -80% with no change to real latency",
    for one target: perceived = time to first visible content (non-streamed:
    the full body); real = time to the whole answer (E2E)."""
    ok = frame[frame.ok & (frame.target == target)]
    off, on = ok[~ok.stream], ok[ok.stream]
    perceived_off = off.first_content_ms.median()
    perceived_on = on.first_content_ms.median()
    real_off, real_on = off.e2e_ms.median(), on.e2e_ms.median()
    return {"perceived_off_ms": perceived_off, "perceived_on_ms": perceived_on,
            "perceived_change_pct": (perceived_on - perceived_off) / perceived_off * 100,
            "real_off_ms": real_off, "real_on_ms": real_on,
            "real_change_pct": (real_on - real_off) / real_off * 100,
            "real_p90_off_ms": off.e2e_ms.quantile(0.9), "real_p90_on_ms": on.e2e_ms.quantile(0.9),
            "server_e2e_off_ms": off.server_e2e_ms.median(),
            "server_e2e_on_ms": on.server_e2e_ms.median(),
            "server_ttft_off_ms": off.server_ttft_ms.median(),
            "server_ttft_on_ms": on.server_ttft_ms.median(),
            # What delivery adds on top of the engine's own time, per request:
            # robust to the engine's speed drifting between requests.
            "delivery_off_ms": (off.e2e_ms - off.server_e2e_ms).median(),
            "delivery_on_ms": (on.e2e_ms - on.server_e2e_ms).median()}


def reduction_by_length(timed: Sequence[Timed]) -> pd.DataFrame:
    """`perceived_reduction_by_length` over the streamed requests, stacked."""
    frames = []
    for t in timed:
        first = first_content_time(t.times, t.pieces)
        if not t.ok or not t.stream or first is None:
            continue
        frames.append(perceived_reduction_by_length(t.times, t.token_counts, first)
                      .assign(request=f"{t.arm}#{t.index}", arm=t.arm))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def app_overhead(engine, app: AppServer, n: int = 24, max_tokens: int = 2, *, seed: int = 1,
                 progress: bool = True) -> pd.DataFrame:
    """Short streamed requests, alternating direct and through the app. For each
    app request, what the app added: the client's TTFT (E2E) minus the TTFT
    (E2E) the app itself measured on its upstream request."""
    from tqdm.auto import tqdm
    batches = prompts(n, seed)

    async def go():
        out = []
        async with chat_session() as session:
            for i, messages in enumerate(tqdm(batches, desc="app overhead", disable=not progress,
                                              leave=False)):
                for target in (("direct", "app") if i % 2 == 0 else ("app", "direct")):
                    out.append(await _chat(session, engine, app, target, messages, max_tokens,
                                           True, i))
        return out

    rows = []
    for t in run_sync(go()):
        up_ttft, up_e2e = t.app_timing.get("upstream_ttft_s"), t.app_timing.get("upstream_e2e_s")
        row = {"target": t.arm.split("/")[0], "index": t.index, "ok": t.ok,
               "upstream_ttft_ms": up_ttft * 1e3 if up_ttft else math.nan,
               "ttft_ms": (t.ttft_s or math.nan) * 1e3, "e2e_ms": (t.e2e_s or math.nan) * 1e3}
        row["overhead_ttft_ms"] = (t.ttft_s - up_ttft) * 1e3 if t.ok and up_ttft else math.nan
        row["overhead_e2e_ms"] = (t.e2e_s - up_e2e) * 1e3 if t.ok and up_e2e else math.nan
        row["app_before_upstream_ms"] = t.app_timing.get("app_to_upstream_s", math.nan) * 1e3
        rows.append(row)
    return pd.DataFrame(rows)


def overhead_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """p50/p90/p99 (ms) of the app's added latency, and direct vs app TTFT."""
    app = frame[(frame.target == "app") & frame.ok]
    rows = {"app overhead on TTFT": percentile_stats(app.overhead_ttft_ms, scale=1.0),
            "app overhead on E2E": percentile_stats(app.overhead_e2e_ms, scale=1.0),
            "app time before its upstream send": percentile_stats(app.app_before_upstream_ms,
                                                                  scale=1.0),
            "TTFT direct": percentile_stats(frame[(frame.target == "direct") & frame.ok].ttft_ms,
                                            scale=1.0),
            "TTFT through the app": percentile_stats(app.ttft_ms, scale=1.0),
            "vLLM's TTFT as the app saw it": percentile_stats(app.upstream_ttft_ms, scale=1.0)}
    return pd.DataFrame(rows).T[["median", "p90", "p99", "mean"]]


# --------------------------------------------------------------------------
# Disconnects abort the generation
# --------------------------------------------------------------------------

def disconnect_aborts(engine, app: AppServer, *, max_tokens: int = 512, read_tokens: int = 8,
                      poll_s: float = 0.05, settle_s: float = 5.0, path: str = "/chat",
                      ) -> tuple[dict[str, Any], pd.DataFrame]:
    """Stream a long answer through the app, read `read_tokens` pieces, hang
    up, and watch vLLM's `/metrics`: `vllm:num_requests_running` should drop
    to 0 at once and `vllm:generation_tokens` stop well short of `max_tokens`.
    Returns a summary and the polled timeline."""
    import aiohttp

    metrics_url = engine.base_url + "/metrics"
    auth = _auth(engine)
    stats_before = app.stats()

    async def go():
        timeline, marks = [], {}
        async with chat_session() as session:
            async def metrics():
                async with session.get(metrics_url, headers=auth) as resp:
                    text = await resp.text()
                snap = parse_metrics(text)
                return snap, counter_by_label(text, "vllm:request_success", "finished_reason")

            before, finished_before = await metrics()
            t0 = time.perf_counter()
            stop = asyncio.Event()

            async def sample():
                snap, _ = await metrics()
                row = {"t_s": time.perf_counter() - t0,
                       "running": snap.gauges["requests_running"],
                       "generated": snap.counters["generation_tokens"]
                       - before.counters["generation_tokens"]}
                timeline.append(row)
                return row

            async def poll():
                while not stop.is_set():
                    await sample()
                    await asyncio.sleep(poll_s)

            poller = asyncio.create_task(poll())
            body = {"messages": chat("Write a long story about a lighthouse keeper."),
                    "max_tokens": max_tokens, "ignore_eos": True}
            read = 0
            async with aiohttp.ClientSession() as client:  # its own connection, closed below
                resp = await client.post(app.base_url + path, json=body)
                buffer = bytearray()
                async for raw in resp.content.iter_any():
                    buffer += raw
                    for data in pop_sse_data(buffer):
                        if data and '"content"' in data:
                            read += 1
                            marks.setdefault("first_token_s", time.perf_counter() - t0)
                    if read >= read_tokens:
                        break
                # One scrape while the stream is still open: the poller shares
                # this loop with the reader, and on a fast engine the few tokens
                # read can all arrive between two of its scrapes.
                marks["running_before_hang_up"] = (await sample())["running"]
                marks["hang_up_s"] = time.perf_counter() - t0
                resp.close()  # drops the connection mid-stream
            deadline = time.perf_counter() + settle_s
            while time.perf_counter() < deadline:
                await asyncio.sleep(poll_s)
                if timeline and timeline[-1]["t_s"] > marks["hang_up_s"] \
                        and timeline[-1]["running"] == 0:
                    await asyncio.sleep(0.3)  # a little more timeline after the drop
                    break
            stop.set()
            await poller
            after, finished_after = await metrics()
        finished = {k: v - finished_before.get(k, 0.0) for k, v in finished_after.items()}
        return before, after, finished, timeline, marks, read

    before, after, finished, timeline, marks, read = run_sync(go())
    frame = pd.DataFrame(timeline)
    hang_up = marks.get("hang_up_s", math.nan)
    drained = frame[(frame.t_s > hang_up) & (frame.running == 0)]
    stats_after = app.stats()
    generated = after.counters["generation_tokens"] - before.counters["generation_tokens"]
    summary = {"max_tokens": max_tokens, "pieces_read_before_hang_up": read,
               "hang_up_s": hang_up,
               "running_before_hang_up": marks.get("running_before_hang_up"),
               "running_zero_after_ms": (drained.t_s.min() - hang_up) * 1e3 if len(drained)
               else None,
               "generated_tokens": generated,
               "tokens_not_generated": max_tokens - generated,
               # vLLM counts a client abort in no finished_reason (its "abort"
               # label stays 0): the request never finishes, it is dropped.
               "vllm_requests_finished": sum(finished.values()),
               "app_client_disconnects": stats_after["streams"]["client_disconnects"]
               - stats_before["streams"]["client_disconnects"],
               "app_upstream_aborted": stats_after["streams"]["upstream_aborted"]
               - stats_before["streams"]["upstream_aborted"]}
    return summary, frame


# --------------------------------------------------------------------------
# Framing, and errors
# --------------------------------------------------------------------------

def framing_demo(pieces: Sequence[str]) -> pd.DataFrame:
    """The same tokens framed as the article's snippet does and as SSE requires,
    and what an SSE client makes of each."""
    from ..app import DONE, article_stream, sse_event
    article = b"".join(article_stream(pieces))
    proper = b"".join(sse_event({"content": p}) for p in pieces) + DONE
    rows = []
    for name, raw in (("article snippet", article), ("lab_utils.app /chat", proper)):
        events = decode_events(raw)
        rows.append({"framing": name, "bytes": raw.decode(), "events_dispatched": len(events),
                     "events": events})
    return pd.DataFrame(rows).set_index("framing")


def error_cases(app: AppServer, dead_app: AppServer | None = None) -> pd.DataFrame:
    """Status and message the app returns for bad requests and a dead upstream."""
    import httpx
    msgs = chat("Hi")
    cases = [
        ("body is not JSON", "/chat", {"content": b"{not json",
                                       "headers": {"Content-Type": "application/json"}}),
        ("no messages", "/chat", {"json": {"messages": []}}),
        ("max_tokens = 0", "/chat", {"json": {"messages": msgs, "max_tokens": 0}}),
        ("unknown role", "/v1/chat/completions",
         {"json": {"messages": [{"role": "robot", "content": "hi"}]}}),
        ("unknown model (vLLM's 404)", "/v1/chat/completions",
         {"json": {"model": "no-such-model", "messages": msgs}}),
        ("longer than the context (vLLM's 400)", "/chat", {"json": {"messages": msgs,
                                                                    "max_tokens": 10**6}}),
    ]
    def message(r) -> str:
        """The error's message, or what came instead (a server that accepted it)."""
        try:
            return str(r.json()["error"]["message"])[:160]
        except (ValueError, KeyError, TypeError):
            return f"(no error: {r.text[:120]})"

    rows = []
    with httpx.Client(timeout=30) as client:
        for name, path, kw in cases:
            r = client.post(app.base_url + path, **kw)
            rows.append({"case": name, "path": path, "status": r.status_code,
                         "message": message(r)})
        if dead_app is not None:
            r = client.post(dead_app.base_url + "/chat", json={"messages": msgs})
            rows.append({"case": "vLLM not running", "path": "/chat", "status": r.status_code,
                         "message": message(r)})
    return pd.DataFrame(rows).set_index("case")


# --------------------------------------------------------------------------
# The notebook's app, and Explore
# --------------------------------------------------------------------------

def explore(ctx, max_tokens: int, reading_wpm: float, n_prompts: int = 2) -> pd.DataFrame:
    """Explore: the four arms again at another answer length and reader pace,
    on the notebook's engine."""
    engine = ctx.arm("baseline")
    app = app_for(ctx, engine)
    result = compare_arms(engine, app, n_prompts, max_tokens, reading_wpm=reading_wpm,
                          seed=random.randrange(1000))
    return arm_table(result.frame).round(0)


# --------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------

CLAIM = "streaming: perceived latency -80%, real latency unchanged (low effort)"


def reduction_note(by_length: pd.DataFrame) -> str:
    """The answer length the article's -80% needs, as a note for the results."""
    need = tokens_for_reduction(by_length, -80.0)
    return f"perceived -80% needs answers of >= {need} tokens (median over streamed requests)"


def findings(claim: dict[str, float], overhead_table: pd.DataFrame, cut: dict[str, Any],
             max_tokens: int) -> list[dict[str, Any]]:
    """`Results.add_finding` arguments: both halves of the claim (`claim_check`
    direct to vLLM), the app's overhead (`overhead_summary`) and what a
    hang-up leaves generated (`disconnect_aborts`)."""
    c, o = claim, overhead_table
    server = (f"vLLM's own TTFT {c['server_ttft_off_ms']:.0f} ms (no-stream) vs "
              f"{c['server_ttft_on_ms']:.0f} ms (stream), E2E {c['server_e2e_off_ms']:.0f} vs "
              f"{c['server_e2e_on_ms']:.0f} ms (vllm:time_to_first_token_seconds, "
              "vllm:e2e_request_latency_seconds deltas per request); client E2E - vLLM's E2E "
              f"{c['delivery_off_ms']:.1f} vs {c['delivery_on_ms']:.1f} ms")
    zero = cut["running_zero_after_ms"]
    return [
        {"technique": "streaming: perceived latency",
         "metric": f"first visible text, median (ms), {max_tokens}-token answers, "
                   "no-stream -> stream",
         "baseline": c["perceived_off_ms"], "treated": c["perceived_on_ms"],
         "article_claim": CLAIM, "mechanism": server, "checklist": "streaming:ttft"},
        {"technique": "streaming: real latency",
         "metric": "whole answer (E2E), median (ms), no-stream -> stream",
         "baseline": c["real_off_ms"], "treated": c["real_on_ms"],
         "article_claim": CLAIM, "mechanism": server},
        {"technique": "streaming: real latency",
         "metric": "client E2E - vLLM's own E2E, median (ms), no-stream -> stream",
         "baseline": c["delivery_off_ms"], "treated": c["delivery_on_ms"],
         "article_claim": CLAIM,
         "mechanism": "per request, so the engine's speed drifting with the machine's load "
                      "cancels out"},
        {"technique": "streaming app: overhead",
         "metric": "TTFT median (ms), vLLM's as the app saw it -> the client's through the "
                   "app (same requests)",
         "baseline": o.loc["vLLM's TTFT as the app saw it", "median"],
         "treated": o.loc["TTFT through the app", "median"],
         "article_claim": "(none: the article's endpoint is a proxy too)",
         "mechanism": f"app overhead on TTFT p50 {o.iloc[0]['median']:.1f} ms, "
                      f"p99 {o.iloc[0]['p99']:.1f} ms (client TTFT - app's upstream TTFT)"},
        {"technique": "streaming app: disconnect",
         "metric": f"tokens generated after a hang-up (of {cut['max_tokens']} asked)",
         "baseline": cut["max_tokens"], "treated": cut["generated_tokens"],
         "article_claim": "(none: the article's snippet has no disconnect handling)",
         "mechanism": f"vllm:num_requests_running 1 -> 0 within "
                      f"{zero if zero is None else round(zero)} ms of the hang-up; "
                      f"vllm:generation_tokens +{cut['generated_tokens']:.0f}; "
                      f"vllm:request_success +{cut['vllm_requests_finished']:.0f} "
                      "(an aborted request never finishes)"},
    ]


__all__ = [  # defined here, then the shared names the notebook reads from here
    "ARMS", "CLAIM", "ArmsResult", "app_overhead", "arm_label", "arm_table", "claim_check",
    "compare_arms", "disconnect_aborts", "error_cases", "explore", "findings", "framing_demo",
    "overhead_summary", "plan", "prompts", "reduction_by_length", "reduction_note",
    "READING_WPM", "Timed", "app_for", "dead_upstream_app", "decode_events", "fetch_raw",
    "plot_disconnect", "plot_perceived_by_length", "plot_reading", "plot_token_arrivals",
    "tokens_for_reduction",
]
