"""An async streaming load generator for OpenAI-compatible (vLLM) servers.

Timing follows `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py):
the clock starts just before the POST; every SSE message with `choices` is a
chunk; the first chunk's arrival is TTFT; later gaps are ITL; E2E ends at the
last chunk; output tokens come from the stream's `usage`. TPOT is derived in
`lab_utils.metrics` as (E2E - TTFT) / (output tokens - 1).

One `aiohttp` session (one connection pool) serves a whole run. Each finished
request is appended to a JSONL file at once, so an interrupted run keeps what
it measured.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from .stream_timer import StreamTimer


@dataclass
class RequestSpec:
    """One request to send. Give `messages` (chat API) or `prompt` (completions)."""
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int = 64
    tag: str = ""                      # workload class, e.g. "short" / "long"
    temperature: float = 0.0
    ignore_eos: bool = False           # vLLM extension: generate exactly max_tokens
    priority: int | None = None        # vLLM extension (--scheduling-policy priority)
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # e.g. a router's session key

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages= (chat) or prompt= (completions)")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")

    @property
    def api(self) -> str:
        return "chat" if self.messages is not None else "completions"

    def payload(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "stream": True, "temperature": self.temperature,
                                "max_tokens": self.max_tokens,
                                "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}
        if self.api == "chat":
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.priority is not None:
            body["priority"] = self.priority
        body.update(self.extra)
        return body


@dataclass
class RequestRecord:
    """What one request did, in seconds (relative times from its send)."""
    index: int
    tag: str
    label: str = ""
    send_time: float = 0.0            # wall clock (epoch s) at send
    start: float = 0.0                # perf_counter at send (for ordering within a run)
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)   # since send
    chunk_tokens: list[int] = field(default_factory=list)    # cumulative output tokens
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    status: int | None = None
    ok: bool = False
    error: str = ""
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)  # per output token, if the request asked
    route: str = ""                   # which model served it, when a router chose (tiering)

    @property
    def tpot(self) -> float | None:
        from .metrics import tpot
        return tpot(self.e2e, self.ttft, self.output_tokens)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tpot"] = self.tpot
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------
# Load shapes
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Load:
    """How requests are released: in order one at a time, with a fixed number
    in flight, at a seeded random rate (Poisson, or gamma for burstiness), or
    at given offsets."""
    kind: str = "sequential"
    concurrency: int = 1
    rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    offsets: tuple[float, ...] = ()

    @classmethod
    def sequential(cls) -> Load:
        return cls("sequential", 1)

    @classmethod
    def concurrent(cls, n: int) -> Load:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"concurrency must be a positive int, got {n!r}")
        return cls("concurrency", n)

    @classmethod
    def poisson(cls, rate: float, *, burstiness: float = 1.0, seed: int = 0,
                max_concurrency: int | None = None) -> Load:
        """Arrivals at `rate` req/s; gamma intervals with shape `burstiness`
        (1 = Poisson, <1 burstier), as `vllm bench serve --burstiness`."""
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
        if not burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness!r}")
        return cls("rate", max_concurrency or 0, float(rate), float(burstiness), int(seed))

    @classmethod
    def at(cls, offsets: Sequence[float]) -> Load:
        """Send request i at offsets[i] seconds after the run starts."""
        return cls("offsets", 0, offsets=tuple(float(o) for o in offsets))

    def arrival_offsets(self, n: int) -> list[float] | None:
        """Send times (s from run start) for rate/offset loads, else None."""
        if self.kind == "offsets":
            if len(self.offsets) < n:
                raise ValueError(f"Load.at has {len(self.offsets)} offsets for {n} requests")
            return list(self.offsets[:n])
        if self.kind != "rate":
            return None
        if math.isinf(self.rate):
            return [0.0] * n
        rng = np.random.default_rng(self.seed)
        theta = 1.0 / (self.rate * self.burstiness)
        gaps = rng.gamma(shape=self.burstiness, scale=theta, size=n)
        if n:
            gaps[0] = 0.0  # the first request goes at once
        return list(np.cumsum(gaps))

    def describe(self) -> str:
        if self.kind == "rate":
            return f"rate={self.rate:g}/s burstiness={self.burstiness:g} seed={self.seed}"
        if self.kind == "offsets":
            return f"offsets={list(self.offsets)}"
        return f"{self.kind} x{self.concurrency}"


# --------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------

@dataclass
class Run:
    """The records of one run, its wall duration and (if scraped) counter deltas."""
    label: str
    load: str
    records: list[RequestRecord]
    duration_s: float
    counters: dict[str, Any] | None = None

    def summary(self, slo=None) -> dict[str, Any]:
        """`lab_utils.metrics.summarize` of this run (goodput against `slo`)."""
        from .metrics import summarize
        return summarize(self.records, self.duration_s, slo)

    def frame(self):
        from .metrics import records_frame
        return records_frame(self.records)


class Client:
    """Streams requests to `base_url` (an OpenAI-compatible server)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout_s: float = 600.0, max_connections: int = 0,
                 request_fields: Callable[[], dict[str, Any]] | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        #: Called once per request; its fields are added to the body (a remote
        #: arm's emulation, e.g. a unique cache_salt: lab_utils.remote).
        self.request_fields = request_fields

    #: A factory of the client-side queue that emulates a remote arm's engine
    #: slots and order (`admission.ClientQueue`; run_schedule uses it), or None.
    queue: Callable[[], Any] | None = None

    @classmethod
    def for_engine(cls, engine, **kw: Any) -> Client:
        emulation = getattr(engine, "emulation", None)
        client = cls(engine.base_url, engine.model, api_key=engine.api_key,
                     request_fields=engine.request_fields if emulation else None, **kw)
        if emulation is not None and getattr(emulation, "slots", 0):
            client.queue = emulation.client_queue
        return client

    def _session(self) -> aiohttp.ClientSession:
        conn = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=30,
                                    enable_cleanup_closed=True)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return aiohttp.ClientSession(connector=conn, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                     read_bufsize=1 << 20)

    async def send(self, session: aiohttp.ClientSession, spec: RequestSpec,
                   index: int = 0, label: str = "", *,
                   stop_when: Callable[[RequestRecord], bool] | None = None) -> RequestRecord:
        """Send one request and time its stream. `stop_when(record)` is asked
        after every token chunk; when it returns True the client hangs up (vLLM
        aborts the generation) and the record ends there with finish_reason
        "client_stop"."""
        rec = RequestRecord(index=index, tag=spec.tag, label=label)
        url = f"{self.base_url}/v1/{'chat/completions' if spec.api == 'chat' else 'completions'}"
        body = spec.payload(self.model)
        if self.request_fields is not None:
            body.update(self.request_fields())
        rec.send_time = time.time()
        st = rec.start = time.perf_counter()
        timer = StreamTimer(st, api="chat" if spec.api == "chat" else "completions")
        # The record shares the timer's lists, so `stop_when` sees the stream so far.
        rec.chunk_times, rec.chunk_tokens, rec.logprobs = (timer.times, timer.token_counts,
                                                           timer.logprobs)

        def stop(t: StreamTimer) -> bool:
            rec.ttft, rec.finish_reason = t.ttft, t.finish_reason
            return stop_when(rec)

        try:
            async with session.post(url, json=body, headers=spec.headers or None) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                    return rec
                async for chunk in resp.content.iter_any():
                    if timer.feed(chunk, time.perf_counter(),
                                  stop if stop_when is not None else None):
                        timer.finish_reason = "client_stop"
                        timer.output_tokens = timer.token_counts[-1]
                        break
            rec.error = timer.close()
            rec.ok = not rec.error
            rec.e2e = timer.e2e  # an answer that did not end has no E2E
        except asyncio.CancelledError:
            timer.error = "cancelled"
            raise
        except Exception as exc:  # connection refused, reset, timeout, bad JSON
            timer.error = f"{type(exc).__name__}: {exc}"
        finally:
            rec.error = rec.error or timer.error
            rec.ttft, rec.itl = timer.ttft, timer.itl
            rec.text, rec.finish_reason = timer.text, timer.finish_reason
            rec.prompt_tokens = timer.prompt_tokens if timer.prompt_tokens is not None \
                else rec.prompt_tokens
            rec.output_tokens, rec.cached_tokens = timer.output_tokens, timer.cached_tokens
        return rec

    async def run_async(self, specs: Sequence[RequestSpec], load: Load = Load(),
                        *, label: str = "", jsonl: str | Path | None = None,
                        progress: bool = True) -> Run:
        from tqdm.auto import tqdm
        specs = list(specs)
        n = len(specs)
        records: list[RequestRecord | None] = [None] * n
        out = open(jsonl, "a") if jsonl else None
        # Short runs finish before a bar is worth reading (and clutter notebooks).
        bar = tqdm(total=n, desc=label or "requests", unit="req", leave=False,
                   disable=not progress or n < 10)

        async def one(i: int, session: aiohttp.ClientSession) -> None:
            rec = await self.send(session, specs[i], i, label)
            records[i] = rec
            if out:
                out.write(json.dumps(rec.to_json()) + "\n")
                out.flush()
            bar.update(1)
            if not rec.ok:
                bar.set_postfix_str(f"errors: {sum(1 for r in records if r and not r.ok)}")

        t0 = time.perf_counter()
        try:
            async with self._session() as session:
                offsets = load.arrival_offsets(n)
                if offsets is None:
                    counter = itertools.count()

                    async def worker() -> None:
                        while (i := next(counter)) < n:
                            await one(i, session)

                    await asyncio.gather(*(worker() for _ in range(min(load.concurrency, n) or 1)))
                else:
                    gate = asyncio.Semaphore(load.concurrency) if load.concurrency else None

                    async def gated(i: int) -> None:
                        if gate is None:
                            return await one(i, session)
                        async with gate:
                            await one(i, session)

                    tasks = []
                    for i, at in enumerate(offsets):
                        delay = t0 + at - time.perf_counter()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        tasks.append(asyncio.create_task(gated(i)))
                    await asyncio.gather(*tasks)
        finally:
            bar.close()
            if out:
                out.close()
        duration = time.perf_counter() - t0
        return Run(label, load.describe(), [r for r in records if r is not None], duration)

    def run(self, specs: Sequence[RequestSpec], load: Load = Load(), **kw: Any) -> Run:
        """Blocking wrapper; works inside Jupyter's running event loop too."""
        return run_sync(self.run_async(specs, load, **kw))


def run_sync(coro):
    """Run a coroutine to completion from sync code, even under a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
