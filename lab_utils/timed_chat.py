"""One chat request to an OpenAI-compatible server, streamed or not, timed
from its send the way the person waiting sees it (`timed_request` -> `Timed`).

Streamed (`"stream": true`): TTFT is the first chunk with `choices` (as
`vllm bench serve` counts it), E2E the last; every piece of text is kept with
its arrival time and the cumulative token count (`continuous_usage_stats`),
so perceived-latency measures (`lab_utils.perceived`) can be computed from
it. Not streamed: the first visible content arrives with the whole body, so
TTFT = E2E = the time to the full body, as `vllm bench serve` counts
non-streaming backends. Through the lab's app, its own view of the upstream
request (the `: lab-timing` SSE comment, or the `Server-Timing` header of a
JSON answer) lands in `Timed.app_timing`.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .app import timing_from_comment
from .client import RequestRecord
from .stream_timer import StreamTimer


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
            timer = StreamTimer(t0)
            try:
                if stream:
                    async for raw in resp.content.iter_any():
                        timer.feed(raw, time.perf_counter())
                else:
                    timer.whole_body(json.loads(await resp.read()), time.perf_counter())
            finally:
                t.ttft_s, t.e2e_s = timer.ttft, timer.e2e
                t.times, t.pieces, t.token_counts = timer.times, timer.pieces, timer.token_counts
                t.prompt_tokens, t.output_tokens = timer.prompt_tokens, timer.output_tokens
                t.cached_tokens, t.error = timer.cached_tokens, timer.error
                for comment in timer.comments:
                    t.app_timing.update(timing_from_comment(comment) or {})
            for part in ("" if stream else resp.headers.get("Server-Timing", "")).split(","):
                name, _, dur = part.strip().partition(";dur=")
                if dur:
                    t.app_timing[f"{name}_s"] = float(dur) / 1e3
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # refused, reset, bad JSON
        t.error = f"{type(exc).__name__}: {exc}"
    return t


def chat_session(limit: int = 8):
    """An aiohttp session for timed requests: one keep-alive pool of `limit`
    connections, a 600 s total timeout, a 1 MiB read buffer."""
    import aiohttp
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=30),
                                 timeout=aiohttp.ClientTimeout(total=600), read_bufsize=1 << 20)


__all__ = ["Timed", "chat_session", "request_body", "timed_request"]
