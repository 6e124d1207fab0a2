"""Experiments of `07_streaming`: what streaming changes for the person who
waits (perceived latency) and what it does not change (real latency), sent
straight to vLLM and through the project's streaming app (`lab_utils.app`).

One engine (the plan's baseline arm: the profile's flags; streaming needs no
engine flag) and four client arms, one knob each way: non-streaming vs
streaming (`"stream"` in the request), direct to vLLM vs through the app. The
same prompts go to every arm, one request at a time, in a rotating order so a
busy machine slows every arm alike. `lab_utils.client.Client` only streams,
so the timing here is its own (one aiohttp session per target, kept alive):
for a non-streamed request the first visible content arrives with the whole
body, so TTFT = E2E = time to the full body, as `vllm bench serve` counts
non-streaming backends.

Per request it measures, from the client's send:
- `ttft_ms`: first chunk with `choices` (vllm bench serve's TTFT);
- `first_content_ms`: first non-empty text the user could see;
- `first_sentence_ms`: first complete sentence (see `first_sentence_time`);
- `e2e_ms`: last token chunk (streamed) or full body (non-streamed);
- reading pace: when each word became complete, the fastest reader the stream
  stays ahead of (`max_unstalled_wpm`), and how long a reader at `reading_wpm`
  words/min would wait for words that had not arrived (`reading_stall_ms`);
- vLLM's own view (its TTFT and E2E histograms, scraped around each request):
  the engine makes its first token at the same moment in both modes; only the
  delivery differs.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..app import AppServer, pop_sse_blocks, sse_data, start_app, timing_from_comment
from ..arms import Arm, Plan
from ..client import RequestRecord, Run, run_sync
from ..counters import parse_metrics
from ..metrics import percentile_stats
from ..results import Results
from ..workloads import chat, chat_questions


def plan(profile, params) -> Plan:
    """One engine, the profile's own flags: streaming is a property of each
    request (`"stream": true`), and the app is the engine's client, so the
    four arms below are client-side and share this engine."""
    return Plan("07_streaming", (Arm(
        "baseline", title="the profile's engine flags (streaming is chosen per request)"),))


#: (target, stream) of the four client arms, and their labels.
ARMS: list[tuple[str, bool]] = [("direct", False), ("direct", True), ("app", False),
                                ("app", True)]
#: Typical adult silent reading pace (words per minute); the default reader.
READING_WPM = 250
_SENTENCE_END = re.compile(r"[.!?。！？]")
_WORD = re.compile(r"\S+")


def arm_label(target: str, stream: bool) -> str:
    return f"{target}/{'stream' if stream else 'no-stream'}"


# --------------------------------------------------------------------------
# Perceived-latency measures (pure, unit-tested)
# --------------------------------------------------------------------------

def first_content_time(times: Sequence[float], pieces: Sequence[str]) -> float | None:
    """Arrival of the first piece with visible (non-blank) text."""
    for t, piece in zip(times, pieces):
        if piece and piece.strip():
            return t
    return None


def first_sentence_time(times: Sequence[float], pieces: Sequence[str], *,
                        min_words: int = 3) -> float | None:
    """Arrival of the first complete sentence: a `.`, `!` or `?` (or their CJK
    forms) that ends at least `min_words` words (so "1." of a list does not
    count) and is followed by whitespace, or ends the whole answer (a `.` at
    the end of a chunk may still become "3.5")."""
    text = ""
    for i, (t, piece) in enumerate(zip(times, pieces)):
        start = max(0, len(text) - 1)  # a terminator at the old end may be settled now
        text += piece or ""
        last = i == len(pieces) - 1
        for m in _SENTENCE_END.finditer(text, start):
            end = m.end()
            settled = end < len(text) and text[end].isspace() or (end == len(text) and last)
            if settled and len(_WORD.findall(text[:end])) >= min_words:
                return t
    return None


def word_arrival_times(times: Sequence[float], pieces: Sequence[str]) -> list[float]:
    """When each word became complete: followed by whitespace, or at the end
    of the answer for the last one."""
    text, out = "", []
    for i, (t, piece) in enumerate(zip(times, pieces)):
        text += piece or ""
        words = _WORD.findall(text)
        complete = len(words) if (i == len(pieces) - 1 or (text and text[-1].isspace())) \
            else max(0, len(words) - 1)
        out.extend([t] * (complete - len(out)))
    return out


def max_unstalled_wpm(word_times: Sequence[float]) -> float:
    """The fastest reader (words/min, starting at the first word) who never has
    to wait for a word: min over k of k / (arrival_k - arrival_0). Infinite
    when every word arrives at once (a non-streamed body)."""
    if len(word_times) < 2:
        return math.inf
    t0 = word_times[0]
    rates = [60.0 * k / (t - t0) for k, t in enumerate(word_times[1:], 1) if t > t0]
    return min(rates) if rates else math.inf


def reader_times(word_times: Sequence[float], wpm: float) -> list[float]:
    """When a reader who starts at the first word and reads at `wpm` words/min
    reaches each word, waiting whenever the next word has not arrived yet."""
    if not wpm > 0:
        raise ValueError(f"wpm must be > 0, got {wpm!r}")
    gap = 60.0 / wpm
    out: list[float] = []
    for arrival in word_times:
        out.append(arrival if not out else max(out[-1] + gap, arrival))
    return out


def reading_schedule(word_times: Sequence[float], wpm: float) -> dict[str, float]:
    """`reader_times` summed up: when the reader starts, how long they wait for
    words in all (`stall_s`), and when they finish the answer (`done_s`)."""
    read = reader_times(word_times, wpm)
    if not read:
        return {"start_s": math.nan, "stall_s": math.nan, "done_s": math.nan}
    gap = 60.0 / wpm
    stall = read[-1] - (read[0] + gap * (len(read) - 1))
    return {"start_s": read[0], "stall_s": max(0.0, stall), "done_s": read[-1] + gap}


def perceived_reduction_by_length(times: Sequence[float], token_counts: Sequence[int],
                                  first_content: float) -> pd.DataFrame:
    """For a streamed answer: if it had been k tokens long, a non-streaming
    client would have waited for token k (the engine does the same work), a
    streaming one only for the first content. One row per k."""
    rows = []
    seen = 0
    for t, n in zip(times, token_counts):
        for k in range(seen + 1, int(n) + 1):
            rows.append({"tokens": k, "non_stream_wait_ms": t * 1e3,
                         "stream_wait_ms": first_content * 1e3,
                         "perceived_change_pct": (first_content - t) / t * 100 if t > 0 else 0})
        seen = max(seen, int(n))
    return pd.DataFrame(rows)


def tokens_for_reduction(by_length: pd.DataFrame, target_pct: float = -80.0) -> int | None:
    """Shortest answer (tokens) from which the median perceived change reaches
    `target_pct` (e.g. the article's -80%) and stays there."""
    med = by_length.groupby("tokens")["perceived_change_pct"].median().sort_index()
    ok = med <= target_pct
    if not ok.any():
        return None
    bad = med.index[~ok]
    after = med.index[med.index > (bad.max() if len(bad) else -1)]
    return int(after.min()) if len(after) else None


# --------------------------------------------------------------------------
# One timed request (any arm)
# --------------------------------------------------------------------------

@dataclass
class Timed:
    """One request as the client saw it (seconds since its send)."""
    arm: str
    index: int
    stream: bool
    status: int | None = None
    error: str = ""
    headers_s: float | None = None      # response headers received
    ttft_s: float | None = None         # first chunk with choices
    e2e_s: float | None = None          # last token chunk / full body
    times: list[float] = field(default_factory=list)       # content pieces' arrivals
    pieces: list[str] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)  # cumulative, per piece
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    app_timing: dict[str, Any] = field(default_factory=dict)
    send_time: float = 0.0
    start: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_s is not None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def record(self, label: str) -> RequestRecord:
        """A lab RequestRecord (so `Results.add_arm` and `lab.plots` take it)."""
        return RequestRecord(
            index=self.index, tag=self.arm, label=label, send_time=self.send_time,
            start=self.start, ttft=self.ttft_s, e2e=self.e2e_s,
            itl=list(np.diff(self.times)) if self.stream and len(self.times) > 1 else [],
            chunk_times=list(self.times), chunk_tokens=list(self.token_counts),
            prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
            cached_tokens=self.cached_tokens, status=self.status, ok=self.ok,
            error=self.error, text=self.text)


def request_body(model: str, messages: list[dict], max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}  # ignore_eos: every arm gets max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _usage(t: Timed, usage: dict | None) -> None:
    if usage:
        t.output_tokens = usage.get("completion_tokens", t.output_tokens)
        t.prompt_tokens = usage.get("prompt_tokens", t.prompt_tokens)
        t.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens",
                                                                          t.cached_tokens)


async def timed_request(session, url: str, body: dict, *, arm: str = "", index: int = 0,
                        headers: dict | None = None) -> Timed:
    """POST `body` to `url` (an OpenAI chat endpoint) and time what arrives."""
    stream = bool(body.get("stream"))
    t = Timed(arm=arm, index=index, stream=stream)
    t.send_time = time.time()
    t0 = t.start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            t.headers_s = time.perf_counter() - t0
            t.status = resp.status
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return t
            if not stream:
                data = json.loads(await resp.read())
                now = time.perf_counter() - t0
                t.ttft_s = t.e2e_s = now
                text = data["choices"][0]["message"].get("content") or ""
                _usage(t, data.get("usage"))
                t.times, t.pieces, t.token_counts = [now], [text], [t.output_tokens or 0]
                for part in resp.headers.get("Server-Timing", "").split(","):
                    name, _, dur = part.strip().partition(";dur=")
                    if dur:
                        t.app_timing[f"{name}_s"] = float(dur) / 1e3
                return t
            buffer = bytearray()
            async for raw in resp.content.iter_any():
                now = time.perf_counter() - t0
                buffer += raw
                for block in pop_sse_blocks(buffer):
                    timing = timing_from_comment(block)
                    if timing is not None:
                        t.app_timing.update(timing)
                    data = sse_data(block)
                    if data is None or data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk and not chunk.get("choices"):
                        t.error = f"stream error: {chunk['error']}"
                        continue
                    _usage(t, chunk.get("usage"))
                    choices = chunk.get("choices")
                    if not choices:
                        continue
                    t.ttft_s = t.ttft_s if t.ttft_s is not None else now
                    t.e2e_s = now
                    t.times.append(now)
                    t.pieces.append((choices[0].get("delta") or {}).get("content") or "")
                    t.token_counts.append((chunk.get("usage") or {}).get("completion_tokens",
                                                                          len(t.times)))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # refused, reset, bad JSON
        t.error = f"{type(exc).__name__}: {exc}"
    return t


def _auth(engine) -> dict[str, str] | None:
    """The engine's bearer header (a remote server may want its API key)."""
    return {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else None


async def _scrape(session, engine):
    try:
        async with session.get(engine.base_url + "/metrics", headers=_auth(engine)) as resp:
            return parse_metrics(await resp.text()) if resp.status == 200 else None
    except Exception:
        return None


def _server_view(before, after) -> dict[str, float | None]:
    """vLLM's TTFT/E2E for the one request between two scrapes (histogram sums)."""
    if before is None or after is None:
        return {"server_ttft_ms": None, "server_e2e_ms": None}
    out = {}
    for key, name in (("server_ttft_s", "server_ttft_ms"), ("server_e2e_s", "server_e2e_ms")):
        h = after.histograms[key] - before.histograms[key]
        out[name] = h.sum / h.count * 1e3 if h.count else None
    return out


async def _chat(session, engine, app: AppServer | None, target: str, messages: list[dict],
                max_tokens: int, stream: bool, index: int) -> Timed:
    """One timed chat request of arm (`target`, `stream`): straight to vLLM
    (with the engine's key) or through the app (which holds the key itself)."""
    direct = target == "direct"
    url = (engine.base_url if direct else app.base_url) + "/v1/chat/completions"
    body = request_body(engine.model, messages, max_tokens, stream)
    return await timed_request(session, url, body, arm=arm_label(target, stream), index=index,
                               headers=_auth(engine) if direct else None)


def _session(limit: int = 8):
    import aiohttp
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=30),
                                 timeout=aiohttp.ClientTimeout(total=600), read_bufsize=1 << 20)


def _row(t: Timed, reading_wpm: float) -> dict[str, Any]:
    target = t.arm.partition("/")[0]
    words = word_arrival_times(t.times, t.pieces)
    reading = reading_schedule(words, reading_wpm) if words else {}
    first = first_content_time(t.times, t.pieces)
    sentence = first_sentence_time(t.times, t.pieces)
    ms = lambda v: v * 1e3 if v is not None and not math.isnan(v) else math.nan
    return {"arm": t.arm, "target": target, "stream": t.stream, "index": t.index, "ok": t.ok,
            "error": t.error, "output_tokens": t.output_tokens, "cached_tokens": t.cached_tokens,
            "headers_ms": ms(t.headers_s), "ttft_ms": ms(t.ttft_s),
            "first_content_ms": ms(first), "first_sentence_ms": ms(sentence),
            "e2e_ms": ms(t.e2e_s), "words": len(words),
            "max_unstalled_wpm": max_unstalled_wpm(words) if words else math.nan,
            "reading_stall_ms": ms(reading.get("stall_s")),
            "reading_done_ms": ms(reading.get("done_s")),
            "app_upstream_ttft_ms": ms(t.app_timing.get("upstream_ttft_s")),
            "app_upstream_e2e_ms": ms(t.app_timing.get("upstream_e2e_s")
                                      or t.app_timing.get("upstream_s")),
            "text": t.text}


# --------------------------------------------------------------------------
# Experiments
# --------------------------------------------------------------------------

def prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` chat requests from datasets/chat_questions.jsonl (seeded)."""
    qs = chat_questions()
    random.Random(seed).shuffle(qs)
    return [chat(qs[i % len(qs)]["question"]) for i in range(n)]


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
        async with _session() as session:
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
            recs = result.records(label)
            path = results.records_path(label)
            path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in recs))
            results.add_arm(label, Run(label, "sequential x1 (arms interleaved)", recs, duration),
                            engine=engine.label, max_tokens=max_tokens)
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
        async with _session() as session:
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

def _finished(text: str) -> dict[str, float]:
    """vllm:request_success_total by finished_reason."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:request_success":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    reason = s.labels.get("finished_reason", "?")
                    out[reason] = out.get(reason, 0.0) + s.value
    return out


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
        async with _session() as session:
            async def metrics():
                async with session.get(metrics_url, headers=auth) as resp:
                    text = await resp.text()
                snap = parse_metrics(text)
                return snap, _finished(text)

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
                    for data in (sse_data(b) for b in pop_sse_blocks(buffer)):
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

def decode_events(raw: bytes) -> list[str]:
    """The `data` of every event a spec-following SSE client dispatches for
    `raw`: the `openai` SDK's own decoder (it implements the WHATWG rules)."""
    from openai._streaming import SSEDecoder
    return [e.data for e in SSEDecoder().iter_bytes(iter([raw]))]


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


def fetch_raw(url: str, body: dict, timeout: float = 120.0, ssl_context=None) -> tuple[dict, bytes]:
    """POST and return (headers, whole body bytes): for looking at wire formats."""
    import httpx
    with httpx.Client(timeout=timeout, verify=ssl_context or True) as client:
        resp = client.post(url, json=body)
        return dict(resp.headers), resp.content


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
    rows = []
    with httpx.Client(timeout=30) as client:
        for name, path, kw in cases:
            r = client.post(app.base_url + path, **kw)
            rows.append({"case": name, "path": path, "status": r.status_code,
                         "message": r.json()["error"]["message"][:160]})
        if dead_app is not None:
            r = client.post(dead_app.base_url + "/chat", json={"messages": msgs})
            rows.append({"case": "vLLM not running", "path": "/chat", "status": r.status_code,
                         "message": r.json()["error"]["message"][:160]})
    return pd.DataFrame(rows).set_index("case")


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------

def _figure():
    """One figure and axes, 7.5 x 4 in, in the lab's theme (set on import)."""
    import matplotlib.pyplot as plt

    from .. import plots as _lab_style  # noqa: F401 (the lab's figure theme)
    return plt.subplots(figsize=(7.5, 4))


def _titled(fig, title: str):
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_perceived_by_length(by_length: pd.DataFrame, claim_pct: float = -80.0,
                             title: str = "Perceived-latency change of streaming, by answer length"):
    import seaborn as sns
    fig, ax = _figure()
    sns.lineplot(data=by_length, x="tokens", y="perceived_change_pct", hue="arm",
                 errorbar=("pi", 80), ax=ax)
    ax.axhline(claim_pct, color="crimson", ls="--", label=f"article: {claim_pct:.0f}%")
    ax.set_xlabel("answer length (output tokens)")
    ax.set_ylabel("first visible content vs whole answer (%)")
    ax.legend(title="arm (median, 80% band)")
    return _titled(fig, title)


def plot_reading(result: ArmsResult, index: int = 0, target: str = "direct",
                 wpm: float = READING_WPM, title: str = "Does the stream stay ahead of a reader?"):
    """Words available over time for prompt `index`, streamed and not, and a
    reader at `wpm` words/min who starts at the first word of each."""
    fig, ax = _figure()
    for stream, color in ((True, "tab:blue"), (False, "tab:orange")):
        label = arm_label(target, stream)
        found = [t for t in result.timed if t.arm == label and t.index == index and t.ok]
        if not found:
            continue
        words = word_arrival_times(found[0].times, found[0].pieces)
        if not words:
            continue
        ax.step(words + [words[-1]], list(range(1, len(words) + 1)) + [len(words)],
                where="post", color=color, label=f"{label}: words arrived")
        read = reader_times(words, wpm)
        done = reading_schedule(words, wpm)["done_s"]
        ax.plot(read + [done], list(range(len(read) + 1)), color=color, ls=":",
                label=f"{label}: reader at {wpm:.0f} wpm (done at {done:.1f} s)")
    ax.set_xlabel("time since request sent (s)")
    ax.set_ylabel("words")
    ax.legend(fontsize="small")
    return _titled(fig, title)


def plot_disconnect(timeline: pd.DataFrame, summary: dict[str, Any],
                    title: str = "Hanging up aborts the generation"):
    """vLLM's running requests and generated tokens around the hang-up."""
    fig, ax = _figure()
    ax.step(timeline.t_s, timeline.running, where="post", color="tab:blue",
            label="vllm:num_requests_running")
    ax.set_xlabel("time since the request was sent (s)")
    ax.set_ylabel("requests running")
    ax.set_ylim(-0.1, max(1.5, timeline.running.max() + 0.5))
    right = ax.twinx()
    right.plot(timeline.t_s, timeline.generated, color="tab:orange",
               label="vllm:generation_tokens (since start)")
    right.set_ylabel("tokens generated")
    right.grid(False)
    ax.axvline(summary["hang_up_s"], color="crimson", ls="--", label="client hangs up")
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="center right", fontsize="small")
    return _titled(fig, title)


def plot_token_arrivals(result: ArmsResult,
                        title: str = "Output tokens visible to the client"):
    """Tokens the client holds against time since send, one line per request:
    a streamed answer climbs from its first chunk; a non-streamed one jumps
    from 0 to all of it when the body arrives."""
    import seaborn as sns
    fig, ax = _figure()
    arms = list(dict.fromkeys(t.arm for t in result.timed))
    palette = dict(zip(arms, sns.color_palette("tab10", len(arms))))
    seen = set()
    for t in result.timed:
        if not t.ok:
            continue
        xs, ys = [0.0, *t.times], [0, *t.token_counts]
        ax.step(xs, ys, where="post", color=palette[t.arm], alpha=0.7,
                ls="-" if t.stream else "--", label=None if t.arm in seen else t.arm)
        seen.add(t.arm)
    ax.set_xlabel("time since request sent (s)")
    ax.set_ylabel("output tokens received")
    ax.legend(title="arm (one line per request)", fontsize="small")
    return _titled(fig, title)


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


_APPS: dict[str, AppServer] = {}


def app_for(ctx, engine, **kw: Any) -> AppServer:
    """The notebook's app in front of `engine` (started once, reused)."""
    key = f"{engine.base_url}|{sorted(kw.items())}"
    app = _APPS.get(key)
    if app is None or not app.alive:
        app = _APPS[key] = start_app(ctx, engine, **kw)
    return app


def dead_upstream_app(ctx) -> AppServer:
    """An app whose vLLM is not running (a free port nobody listens on)."""
    from ..server import free_port
    app = AppServer(f"http://127.0.0.1:{free_port()}", "none",
                    log_path=ctx.results.dir / "logs" / ctx.name / "app-dead-upstream.log")
    return app.start()


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


__all__ = [
    "ARMS",
    "CLAIM",
    "READING_WPM",
    "ArmsResult",
    "Timed",
    "app_for",
    "app_overhead",
    "arm_label",
    "arm_table",
    "claim_check",
    "compare_arms",
    "dead_upstream_app",
    "decode_events",
    "disconnect_aborts",
    "error_cases",
    "explore",
    "fetch_raw",
    "findings",
    "first_content_time",
    "first_sentence_time",
    "framing_demo",
    "max_unstalled_wpm",
    "overhead_summary",
    "perceived_reduction_by_length",
    "plot_disconnect",
    "plot_perceived_by_length",
    "plot_reading",
    "plan",
    "plot_token_arrivals",
    "prompts",
    "reader_times",
    "reading_schedule",
    "reduction_by_length",
    "reduction_note",
    "request_body",
    "tokens_for_reduction",
    "word_arrival_times",
]
