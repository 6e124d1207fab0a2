"""The one stream timer: an OpenAI-compatible SSE stream, timed as `vllm
bench serve` times it, whatever HTTP client reads the bytes.

A caller feeds the raw body bytes as they arrive (`StreamTimer.feed`), each
read with its arrival time; the timer parses the events with `lab_utils.sse`
and keeps, per chunk that carries `choices` (a token chunk):

- its arrival, in seconds since the request was sent (`times`): TTFT is the
  first (`ttft`), E2E the last (`e2e`), ITL the gaps between them (`itl`);
- its text (chat `delta.content`, completions `text`), the cumulative output
  token count (`usage.completion_tokens` with `continuous_usage_stats`, else
  the chunk's ordinal), the sampled tokens' log-probabilities;

and from the whole stream: the usage of the last chunk that reports it
(prompt, output and cached prompt tokens), the finish reason, an in-stream
error (a chunk with `error` and no choices), and the comment events
(`comments`, e.g. the lab app's `: lab-timing` line). A usage-only trailing
chunk carries no token and moves no time; `[DONE]` ends the stream.

`lab_utils.client.Client.send` (aiohttp), `lab_utils.timed_chat.timed_request`
(aiohttp, with the app's timing), `lab_utils.connection_trace.traced_stream`
(httpx, with the connection set-up) and the app's relay (`lab_utils.app`, its
view of the upstream request) all read their streams through it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from .sse import pop_sse_blocks, sse_data


def sampled_logprobs(logprobs: dict | None) -> list[float]:
    """The sampled tokens' log-probabilities in a chunk's `logprobs` (chat:
    `content[].logprob`; completions: `token_logprobs`)."""
    if not logprobs:
        return []
    if logprobs.get("content") is not None:
        return [float(t["logprob"]) for t in logprobs["content"]]
    return [float(x) for x in logprobs.get("token_logprobs") or [] if x is not None]


class StreamTimer:
    """One streamed completion as the client saw it (times in seconds since
    `start`, a `time.perf_counter()` reading taken when the request was sent).
    `api` is "chat" or "completions" (where a chunk's text is)."""

    def __init__(self, start: float, api: str = "chat") -> None:
        self.start = start
        self.api = api
        self.times: list[float] = []          # token chunks' arrivals
        self.pieces: list[str] = []           # their text
        self.token_counts: list[int] = []     # cumulative output tokens, per token chunk
        self.logprobs: list[float] = []       # sampled tokens' log-probabilities
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error = ""
        self.comments: list[str] = []         # events without data (SSE comments)
        self.done = False                     # "[DONE]" arrived
        self.bad_chunks = 0                   # events that were not JSON (strict=False)
        self._buffer = bytearray()

    @property
    def ttft(self) -> float | None:
        return self.times[0] if self.times else None

    @property
    def e2e(self) -> float | None:
        return self.times[-1] if self.times else None

    @property
    def itl(self) -> list[float]:
        return [float(g) for g in np.diff(self.times)] if len(self.times) > 1 else []

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def take_usage(self, usage: dict | None) -> None:
        """Prompt, output and cached prompt tokens from a `usage` object
        (a missing count keeps the one seen before)."""
        if not usage:
            return
        self.output_tokens = usage.get("completion_tokens", self.output_tokens)
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            self.cached_tokens = cached

    def feed(self, raw: bytes, now: float,
             stop: Callable[[StreamTimer], bool] | None = None, *,
             each: Callable[[str, dict[str, Any]], None] | None = None,
             strict: bool = True) -> bool:
        """Take one read of the body (`now`: its `perf_counter()` arrival).
        `stop(self)`, if given, is asked after every token chunk until the
        stream has a finish reason; when it says True the rest of the read is
        dropped and True is returned (the caller hangs up). `each(data,
        chunk)`, if given, gets every JSON event first (its text and parsed
        object: a relay re-frames them). A chunk that is not JSON raises, or
        with `strict=False` is counted in `bad_chunks` and skipped."""
        self._buffer += raw
        for block in pop_sse_blocks(self._buffer):
            data = sse_data(block)
            if data is None:
                self.comments.append(block)
                continue
            if data == "[DONE]":
                self.done = True
                continue
            try:
                chunk: dict[str, Any] = json.loads(data)
            except ValueError:
                if strict:
                    raise
                self.bad_chunks += 1
                continue
            if each is not None:
                each(data, chunk)
            choices = chunk.get("choices")
            if "error" in chunk and not choices:
                self.error = f"stream error: {chunk['error']}"
                continue
            usage = chunk.get("usage")
            self.take_usage(usage)
            if not choices:
                continue  # the trailing usage-only chunk carries no token
            choice = choices[0]
            piece = ((choice.get("delta") or {}).get("content") if self.api == "chat"
                     else choice.get("text"))
            self.times.append(now - self.start)
            self.pieces.append(piece or "")
            self.token_counts.append((usage or {}).get("completion_tokens", len(self.times)))
            self.logprobs.extend(sampled_logprobs(choice.get("logprobs")))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if stop is not None and not self.finish_reason and stop(self):
                return True
        return False

    def whole_body(self, data: dict[str, Any], now: float) -> None:
        """A response that was not streamed (`data`: its JSON body, arrived at
        `now`): the first visible text comes with the whole body, so it is one
        token chunk and TTFT = E2E, as `vllm bench serve` counts non-streaming
        backends."""
        self.take_usage(data.get("usage"))
        if not data.get("choices"):
            self.error = f"a body without choices: {json.dumps(data)[:300]}"
            return
        choice = data["choices"][0]
        text = ((choice.get("message") or {}).get("content") if self.api == "chat"
                else choice.get("text"))
        self.times, self.pieces = [now - self.start], [text or ""]
        self.token_counts = [self.output_tokens or 0]
        self.finish_reason = choice.get("finish_reason")

    def close(self) -> str:
        """The stream's error once it has ended ("" if it delivered a token
        chunk and no error): a stream without a token chunk is an error."""
        if not self.times and not self.error:
            self.error = "the stream ended without a token chunk"
        return self.error


__all__ = ["StreamTimer", "sampled_logprobs"]
