"""Client-side admission: hold batch requests until interactive traffic is
off-peak, and a small runner that sends a schedule of requests through it.

The article's scheduling advice is "interactive requests are served at once,
batch requests are queued for off-peak time". vLLM's priority scheduler can
only reorder what is already inside the server; this is the other half, done
before a request reaches the server:

    policy = OffPeakAdmission(threshold=0, window_s=2.0)
    run = run_schedule(engine, specs, offsets, policy=policy, label="admission")

`OffPeakAdmission` counts *interactive load*: the interactive requests that
are in flight or arrived within the last `window_s` seconds. A batch request
is held while that load is above `threshold` (and while `max_batch_in_flight`
batch requests already run); interactive requests always pass at once.
A batch request that has been admitted runs to the end: the policy cannot
recall it if a user arrives a second later.

`run_schedule` sends each request at its offset with `Client.send` on one
aiohttp session, asks the policy first, and returns a normal `Run` (records
are `RequestRecord`s, so `summarize` and the plots work on them) plus how long
the policy held each request.
"""
from __future__ import annotations

import asyncio
import heapq
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .client import Client, Load, RequestRecord, RequestSpec, Run, run_sync

BATCH, INTERACTIVE = "batch", "interactive"


class PassThrough:
    """The no-policy arm: every request is sent at its arrival time."""
    name = "none"

    async def admit(self, spec: RequestSpec) -> None:
        return None

    def release(self, spec: RequestSpec) -> None:
        return None

    def describe(self) -> str:
        return "send every request at its arrival time"


@dataclass
class OffPeakAdmission:
    """Hold `batch_tag` requests while interactive load is above `threshold`.

    Interactive load = interactive requests in flight, plus those that arrived
    within the last `window_s` seconds and have finished (each request counts
    once). With `threshold=0` a batch request goes only after `window_s`
    seconds without a new interactive request and with none in flight.
    `max_batch_in_flight` (0 = no cap) limits the batch requests sent at once
    after admission; `clock` is injectable for tests."""
    threshold: int = 0
    window_s: float = 2.0
    max_batch_in_flight: int = 0
    batch_tag: str = BATCH
    clock: Callable[[], float] = time.perf_counter
    name: str = "off-peak admission"
    _arrivals: deque = field(default_factory=deque, repr=False)    # (time, key) of interactive
    _in_flight: set = field(default_factory=set, repr=False)        # interactive keys
    _batch_in_flight: int = field(default=0, repr=False)
    _changed: asyncio.Event | None = field(default=None, repr=False)
    _seq: int = field(default=0, repr=False)
    _keys: dict = field(default_factory=dict, repr=False)           # id(spec) -> key

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0 interactive requests, got {self.threshold}")
        if self.window_s < 0:
            raise ValueError(f"window_s must be >= 0 s, got {self.window_s}")
        if self.max_batch_in_flight < 0:
            raise ValueError(f"max_batch_in_flight must be >= 0, got {self.max_batch_in_flight}")

    def reset(self) -> None:
        """Forget all traffic (run_schedule calls it, so a policy can be reused)."""
        self._arrivals.clear()
        self._in_flight.clear()
        self._keys.clear()
        self._batch_in_flight = 0
        self._changed = None

    # -- the load it watches ---------------------------------------------
    def interactive_load(self, now: float | None = None) -> int:
        """Interactive requests in flight or arrived within `window_s` of `now`."""
        now = self.clock() if now is None else now
        while self._arrivals and now - self._arrivals[0][0] > self.window_s:
            self._arrivals.popleft()
        recent = {key for _, key in self._arrivals}
        return len(recent | self._in_flight)

    def is_batch(self, spec: RequestSpec) -> bool:
        return spec.tag == self.batch_tag

    def may_send_batch(self, now: float | None = None) -> bool:
        cap_ok = not self.max_batch_in_flight or self._batch_in_flight < self.max_batch_in_flight
        return cap_ok and self.interactive_load(now) <= self.threshold

    def _next_change(self, now: float) -> float | None:
        """Seconds until the oldest counted arrival leaves the window (None:
        only a finishing request can lower the load)."""
        if not self._arrivals:
            return None
        return max(0.0, self._arrivals[0][0] + self.window_s - now) + 1e-3

    # -- the async protocol run_schedule uses -----------------------------
    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        event = self._event()
        event.set()
        self._changed = asyncio.Event()  # waiters re-check, then wait on a fresh event

    async def admit(self, spec: RequestSpec) -> None:
        """Return when `spec` may be sent (at once for interactive requests)."""
        if not self.is_batch(spec):
            self._seq += 1
            key = self._seq
            self._keys[id(spec)] = key
            self._arrivals.append((self.clock(), key))
            self._in_flight.add(key)
            return
        while not self.may_send_batch():
            event = self._event()
            wait = self._next_change(self.clock())
            try:
                await asyncio.wait_for(event.wait(), timeout=wait)
            except TimeoutError:
                pass
        self._batch_in_flight += 1

    def release(self, spec: RequestSpec) -> None:
        """`spec` finished (or failed): it no longer counts as in flight."""
        if self.is_batch(spec):
            self._batch_in_flight = max(0, self._batch_in_flight - 1)
        else:
            self._in_flight.discard(self._keys.pop(id(spec), None))
        self._notify()

    def describe(self) -> str:
        cap = f", at most {self.max_batch_in_flight} batch in flight" \
            if self.max_batch_in_flight else ""
        return (f"hold '{self.batch_tag}' requests while interactive load (in flight or arrived "
                f"in the last {self.window_s:g} s) > {self.threshold}{cap}")


class ClientQueue:
    """The engine's admission, done by the client: at most `slots` requests
    in flight; the others wait in the client's queue, served in arrival order
    or, `by_priority`, lowest `spec.priority` first (ties in arrival order), as
    vLLM's scheduler orders its waiting queue with `--max-num-seqs` and
    `--scheduling-policy fcfs|priority`. It emulates those two settings on a
    remote server whose own cannot be read or set (`lab_utils.remote`); it
    does not preempt a running request, which vLLM's priority scheduler may."""

    def __init__(self, slots: int, by_priority: bool = False):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots, self.by_priority = int(slots), bool(by_priority)
        self.in_flight = 0
        self.max_waiting = 0
        self._waiting: list[tuple[int, int, asyncio.Future]] = []
        self._seq = 0

    def key(self, spec: RequestSpec) -> int:
        return int(spec.priority or 0) if self.by_priority else 0

    async def admit(self, spec: RequestSpec) -> None:
        if self.in_flight < self.slots and not self._waiting:
            self.in_flight += 1
            return
        self._seq += 1
        ready = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (self.key(spec), self._seq, ready))
        self.max_waiting = max(self.max_waiting, len(self._waiting))
        await ready  # the slot is handed over by release()

    def release(self, spec: RequestSpec) -> None:
        while self._waiting:
            _, _, ready = heapq.heappop(self._waiting)
            if not ready.done():
                ready.set_result(None)  # its slot passes on: in_flight stays
                return
        self.in_flight = max(0, self.in_flight - 1)

    def describe(self) -> str:
        order = "lowest priority value first" if self.by_priority else "in arrival order"
        return f"client queue: at most {self.slots} in flight, the rest {order}"


# --------------------------------------------------------------------------
# A runner with a policy
# --------------------------------------------------------------------------

@dataclass
class ScheduledRun:
    """A `Run` plus, per record index, its arrival offset and the time the
    policy held it before sending (both in seconds)."""
    run: Run
    arrival_s: list[float]
    held_s: list[float]
    policy: str = ""

    def frame(self):
        """records_frame() of the run with arrival, hold and completion columns
        (seconds since the run started)."""
        frame = self.run.frame()
        if frame.empty:
            return frame
        frame["arrival_s"] = [self.arrival_s[i] for i in frame["index"]]
        frame["held_s"] = [self.held_s[i] for i in frame["index"]]
        frame["wait_ms"] = frame["held_s"] * 1e3 + frame["ttft_ms"]  # arrival -> first token
        frame["done_s"] = frame["arrival_s"] + frame["held_s"] + frame["e2e_ms"] / 1e3
        return frame


def since_queued(rec: RequestRecord, waited_s: float) -> RequestRecord:
    """Time `rec` from when it entered the client's queue (`ClientQueue`), as
    an engine times a request from its arrival: TTFT, E2E and the chunk times
    grow by the wait, the start moves back; TPOT and the gaps do not change."""
    rec.start -= waited_s
    rec.send_time -= waited_s
    if rec.ttft is not None:
        rec.ttft += waited_s
    if rec.e2e is not None:
        rec.e2e += waited_s
    rec.chunk_times = [t + waited_s for t in rec.chunk_times]
    return rec


def client_session(client: Client) -> aiohttp.ClientSession:
    """One aiohttp session (one connection pool) with the client's key and timeout."""
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    return aiohttp.ClientSession(connector=conn, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=client.timeout_s),
                                 read_bufsize=1 << 20)


async def run_schedule_async(client: Client, specs: Sequence[RequestSpec],
                             offsets: Sequence[float] | Load, *, policy=None, label: str = "",
                             jsonl: str | Path | None = None,
                             on_start: Callable[[], Any] | None = None) -> ScheduledRun:
    """Send `specs[i]` at `offsets[i]` s after the start (or as the rate/offset
    `Load` schedules it), each after `policy.admit(spec)` returns; records
    stream into `jsonl` as they finish."""
    specs = list(specs)
    if isinstance(offsets, Load):
        scheduled = offsets.arrival_offsets(len(specs))
        if scheduled is None:
            raise ValueError(f"run_schedule needs arrival times: Load.at or Load.poisson, "
                             f"not {offsets.describe()}")
        offsets = scheduled
    offsets = [float(o) for o in offsets]
    if len(offsets) != len(specs):
        raise ValueError(f"{len(specs)} requests but {len(offsets)} offsets")
    policy = policy or PassThrough()
    if hasattr(policy, "reset"):
        policy.reset()
    # A remote arm whose engine slots and order are emulated (lab_utils.remote)
    # queues here, after the policy, as the engine's own queue would.
    queue = client.queue() if getattr(client, "queue", None) else None
    records: list[RequestRecord | None] = [None] * len(specs)
    held = [0.0] * len(specs)
    out = open(jsonl, "a") if jsonl else None

    async def one(i: int, session: aiohttp.ClientSession, t0: float) -> None:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        arrived = time.perf_counter()
        await policy.admit(specs[i])
        held[i] = time.perf_counter() - arrived
        queued = time.perf_counter()
        if queue is not None:
            await queue.admit(specs[i])
        queued = time.perf_counter() - queued
        try:
            rec = await client.send(session, specs[i], i, label)
        finally:
            if queue is not None:
                queue.release(specs[i])
            policy.release(specs[i])
        if queue is not None:  # the engine's queue, emulated: its wait is part of TTFT
            since_queued(rec, queued)
        records[i] = rec
        if out:
            out.write(json.dumps({**rec.to_json(), "arrival_s": offsets[i],
                                  "held_s": held[i]}) + "\n")
            out.flush()

    try:
        async with client_session(client) as session:
            if on_start is not None:
                on_start()
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, session, t0) for i in range(len(specs))))
            duration = time.perf_counter() - t0
    finally:
        if out:
            out.close()
    how = policy.describe() + (f"; {queue.describe()}" if queue is not None else "")
    run = Run(label, f"schedule of {len(specs)} ({how})",
              [r for r in records if r is not None], duration)
    return ScheduledRun(run, offsets, held, getattr(policy, "name", type(policy).__name__))


def run_schedule(engine, specs: Sequence[RequestSpec], offsets: Sequence[float] | Load, **kw: Any
                 ) -> ScheduledRun:
    """Blocking `run_schedule_async` against `engine` (works inside Jupyter)."""
    return run_sync(run_schedule_async(Client.for_engine(engine), specs, offsets, **kw))


__all__ = [
    "BATCH",
    "ClientQueue",
    "INTERACTIVE",
    "OffPeakAdmission",
    "PassThrough",
    "ScheduledRun",
    "client_session",
    "run_schedule",
    "run_schedule_async",
]
