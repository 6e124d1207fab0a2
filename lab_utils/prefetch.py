"""The article's request prefetcher, built for real: while a user types,
predict the two likeliest queries from a query log, generate their answers on
the engine ahead of time, and keep them in a 30-second TTL cache, so that
pressing Enter on a predicted query is answered from the cache.

- `QueryPredictor`: prefix matches in a query log, ranked by frequency.
- `TTLCache`: an in-process cache whose entries expire `ttl_s` after they are
  stored (the article uses Redis `setex(key, 30, value)`; one process needs
  no server for that).
- `RequestPrefetcher`: `on_keystroke(prefix)` starts prefetches (without
  waiting for them); `answer(query)` serves from the cache (hit), waits for a
  prefetch still running (in-flight hit) or sends the query (miss). It keeps
  a ledger of every prefetched answer, so tokens nobody used are counted.
- `typing_timeline` and `TypingSession`: keystroke timelines at a realistic
  typing speed (`datasets/typing_sessions.jsonl` was made with them).
"""
from __future__ import annotations

import asyncio
import bisect
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .client import Client, RequestRecord, RequestSpec
from .workloads import chat, dataset_path

_SPACES = re.compile(r"\s+")

#: Inter-key interval of the typing model: lognormal with this median (ms) and
#: shape. Mean = 220 * exp(0.4**2 / 2) = 238 ms, the average inter-key interval
#: over 136M keystrokes in Dhakal et al., "Observations on Typing from 136
#: Million Keystrokes", CHI 2018 (about 52 words per minute).
IKI_MEDIAN_MS, IKI_SIGMA = 220.0, 0.4
#: Pause between the last character and Enter (re-reading the query).
ENTER_MEDIAN_MS, ENTER_SIGMA = 400.0, 0.4


def normalize(query: str) -> str:
    """The cache key of a query: lower case, single spaces, no trailing ?!."""
    return _SPACES.sub(" ", query.strip().lower()).rstrip("?!. ")


# --------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------

def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in dataset_path(name).read_text().splitlines()
            if line.strip()]


def query_log() -> list[dict]:
    """datasets/query_log.jsonl: `{"id", "query", "count"}`, most frequent first."""
    return _jsonl("query_log.jsonl")


@dataclass(frozen=True)
class TypingSession:
    """One user typing `query`: `keys_ms[i]` is when character i was typed
    (ms after the session starts), `enter_ms` when Enter was pressed."""
    id: str
    query: str
    keys_ms: tuple[int, ...]
    enter_ms: int
    in_log: bool = True

    def __post_init__(self) -> None:
        if len(self.keys_ms) != len(self.query):
            raise ValueError(f"{self.id}: {len(self.keys_ms)} keystrokes for a "
                             f"{len(self.query)}-character query")
        if any(b < a for a, b in zip(self.keys_ms, self.keys_ms[1:])) or \
                (self.keys_ms and self.enter_ms < self.keys_ms[-1]):
            raise ValueError(f"{self.id}: keystroke times must not decrease")

    @classmethod
    def from_json(cls, d: dict) -> TypingSession:
        return cls(d["id"], d["query"], tuple(d["keys_ms"]), d["enter_ms"], d.get("in_log", True))

    def to_json(self) -> dict:
        return {"id": self.id, "query": self.query, "in_log": self.in_log,
                "keys_ms": list(self.keys_ms), "enter_ms": self.enter_ms}

    def prefixes(self) -> Iterable[tuple[float, str]]:
        """(seconds since session start, text typed so far) per keystroke."""
        for i, t in enumerate(self.keys_ms):
            yield t / 1e3, self.query[:i + 1]


def typing_sessions() -> list[TypingSession]:
    """datasets/typing_sessions.jsonl as `TypingSession`s."""
    return [TypingSession.from_json(d) for d in _jsonl("typing_sessions.jsonl")]


def typing_timeline(text: str, rng: np.random.Generator, *, iki_median_ms: float = IKI_MEDIAN_MS,
                    iki_sigma: float = IKI_SIGMA, enter_median_ms: float = ENTER_MEDIAN_MS,
                    enter_sigma: float = ENTER_SIGMA) -> tuple[list[int], int]:
    """Keystroke times (ms, the first key at 0) and the Enter time for typing
    `text`: lognormal inter-key intervals, then a lognormal pause before Enter."""
    gaps = rng.lognormal(math.log(iki_median_ms), iki_sigma, max(len(text) - 1, 0))
    keys = np.concatenate([[0.0], np.cumsum(gaps)]) if text else np.array([])
    enter = (keys[-1] if len(keys) else 0.0) + rng.lognormal(math.log(enter_median_ms), enter_sigma)
    return [round(float(k)) for k in keys], round(float(enter))


def retime(session: TypingSession, speed: float) -> TypingSession:
    """The same session typed `speed` times faster (2.0 = twice as fast)."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed!r}")
    return TypingSession(session.id, session.query,
                         tuple(round(t / speed) for t in session.keys_ms),
                         round(session.enter_ms / speed), session.in_log)


# --------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------

class QueryPredictor:
    """The `k` most frequent logged queries that start with what was typed."""

    def __init__(self, log: Iterable[tuple[str, int]]):
        counts: dict[str, int] = {}
        for query, count in log:
            key = normalize(query)
            counts[key] = counts.get(key, 0) + int(count)
        self.counts = counts
        self._sorted = sorted(counts)

    @classmethod
    def from_log(cls, records: Sequence[dict] | None = None) -> QueryPredictor:
        records = query_log() if records is None else records
        return cls((r["query"], r["count"]) for r in records)

    def candidates(self, prefix: str) -> list[str]:
        """Every logged query starting with `prefix` (alphabetical)."""
        p = normalize(prefix) if prefix.strip() else ""
        if prefix.endswith(" ") and p:
            p += " "  # a typed space is part of the prefix ("how to " vs "how tom")
        lo = bisect.bisect_left(self._sorted, p)
        hi = bisect.bisect_left(self._sorted, p + "\uffff")
        return self._sorted[lo:hi]

    def predict(self, prefix: str, k: int = 2) -> list[str]:
        """Up to `k` queries, most frequent first (ties alphabetical)."""
        return sorted(self.candidates(prefix), key=lambda q: (-self.counts[q], q))[:k]


# --------------------------------------------------------------------------
# The TTL cache
# --------------------------------------------------------------------------

class TTLCache:
    """key -> value, each entry forgotten `ttl_s` seconds after it was set
    (Redis `SETEX` semantics: a new `set` restarts the clock)."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 s, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self.clock = clock
        self._data: dict[str, tuple[float, Any]] = {}
        self.hits = self.misses = self.expired = 0

    def set(self, key: str, value: Any) -> None:
        self._data[key] = (self.clock() + self.ttl_s, value)

    def get(self, key: str) -> Any | None:
        item = self._data.get(key)
        if item is not None and item[0] <= self.clock():
            del self._data[key]
            self.expired += 1
            item = None
        if item is None:
            self.misses += 1
            return None
        self.hits += 1
        return item[1]

    def __contains__(self, key: str) -> bool:
        item = self._data.get(key)
        return item is not None and item[0] > self.clock()

    def ttl(self, key: str) -> float | None:
        """Seconds left for `key` (None if absent or expired)."""
        item = self._data.get(key)
        left = item[0] - self.clock() if item else None
        return left if left is not None and left > 0 else None

    def purge(self) -> int:
        """Drop expired entries; return how many."""
        now = self.clock()
        dead = [k for k, (exp, _) in self._data.items() if exp <= now]
        for k in dead:
            del self._data[k]
        self.expired += len(dead)
        return len(dead)

    def __len__(self) -> int:
        self.purge()
        return len(self._data)


# --------------------------------------------------------------------------
# The prefetcher
# --------------------------------------------------------------------------

@dataclass
class Prefetched:
    """One prefetched answer (the ledger keeps every one, served or not)."""
    query: str
    started: float
    finished: float | None = None
    text: str = ""
    output_tokens: int = 0
    ok: bool = False
    served: int = 0                 # times a user got it
    record: RequestRecord | None = None


@dataclass
class Served:
    """What the user who pressed Enter got. `first_ms`: Enter -> first text
    on screen; `full_ms`: Enter -> the whole answer."""
    query: str
    outcome: str                    # "hit" | "in-flight hit" | "miss"
    first_ms: float
    full_ms: float
    output_tokens: int
    text: str = ""
    record: RequestRecord | None = None


def answer_spec(query: str, max_tokens: int = 32, tag: str = "prefetch") -> RequestSpec:
    """The chat request for one query (the same for a prefetch and a miss)."""
    return RequestSpec(messages=chat(query), max_tokens=max_tokens, tag=tag)


class RequestPrefetcher:
    """Predict the `top_k` likeliest queries at every keystroke (from
    `min_prefix_chars` on), generate the ones not cached or running, and cache
    the answers for `cache.ttl_s`. With `enabled=False` it never prefetches
    (every Enter is a miss): the control arm runs the same code.

    `max_in_flight` (0 = no limit) caps prefetches running at once; a
    prediction made while the cap is reached is skipped, not queued.
    `on_record` receives every RequestRecord (prefetches and misses)."""

    def __init__(self, client: Client, session, predictor: QueryPredictor, cache: TTLCache, *,
                 top_k: int = 2, min_prefix_chars: int = 3, max_tokens: int = 32,
                 max_in_flight: int = 0, enabled: bool = True,
                 on_record: Callable[[RequestRecord], None] | None = None):
        self.client, self.session = client, session
        self.predictor, self.cache = predictor, cache
        self.top_k, self.min_prefix_chars = top_k, min_prefix_chars
        self.max_tokens, self.max_in_flight = max_tokens, max_in_flight
        self.enabled = enabled
        self.on_record = on_record
        self.ledger: list[Prefetched] = []
        self.in_flight: dict[str, asyncio.Task] = {}
        self.skipped_at_cap = 0
        self._index = 0

    def _next_index(self) -> int:
        self._index += 1
        return self._index

    async def _generate(self, key: str, item: Prefetched) -> Prefetched:
        try:
            rec = await self.client.send(self.session, answer_spec(key, self.max_tokens),
                                         self._next_index(), "prefetch")
            item.record, item.finished = rec, time.perf_counter()
            item.ok, item.text, item.output_tokens = rec.ok, rec.text, rec.output_tokens or 0
            if self.on_record:
                self.on_record(rec)
            if rec.ok:
                self.cache.set(key, item)
            return item
        finally:
            self.in_flight.pop(key, None)

    def on_keystroke(self, prefix: str) -> list[str]:
        """Start prefetches for the current prefix; returns the queries started.
        Must be called from the event loop; it does not wait for them."""
        if not self.enabled or len(prefix.strip()) < self.min_prefix_chars:
            return []
        started = []
        for key in self.predictor.predict(prefix, self.top_k):
            if key in self.cache or key in self.in_flight:
                continue
            if self.max_in_flight and len(self.in_flight) >= self.max_in_flight:
                self.skipped_at_cap += 1
                continue
            item = Prefetched(key, time.perf_counter())
            self.ledger.append(item)
            self.in_flight[key] = asyncio.ensure_future(self._generate(key, item))
            started.append(key)
        return started

    async def answer(self, query: str) -> Served:
        """The user pressed Enter on `query`."""
        key = normalize(query)
        t0 = time.perf_counter()
        item = self.cache.get(key) if self.enabled else None
        outcome = "hit"
        if item is None and key in self.in_flight:
            outcome = "in-flight hit"
            item = await asyncio.shield(self.in_flight[key])
            if not item.ok:
                item = None
        if item is not None:
            item.served += 1
            wait = (time.perf_counter() - t0) * 1e3
            return Served(query, outcome, wait, wait, item.output_tokens, item.text, item.record)
        rec = await self.client.send(self.session, answer_spec(key, self.max_tokens, "typed"),
                                     self._next_index(), "typed")
        if self.on_record:
            self.on_record(rec)
        first = rec.ttft * 1e3 if rec.ttft is not None else math.nan
        full = rec.e2e * 1e3 if rec.e2e is not None else math.nan
        return Served(query, "miss", first, full, rec.output_tokens or 0, rec.text, rec)

    async def drain(self) -> None:
        """Wait for the prefetches still running (their tokens are spent anyway)."""
        if self.in_flight:
            await asyncio.gather(*list(self.in_flight.values()), return_exceptions=True)

    def cost(self) -> dict[str, float]:
        """Prefetches made, tokens generated, tokens some user got, tokens nobody
        got (an answer served twice is counted once as used)."""
        done = [p for p in self.ledger if p.ok]
        used = [p for p in done if p.served]
        generated = sum(p.output_tokens for p in done)
        used_tokens = sum(p.output_tokens for p in used)
        return {"prefetches": len(self.ledger), "prefetches_failed": len(self.ledger) - len(done),
                "prefetches_used": len(used), "tokens_generated": generated,
                "tokens_used": used_tokens, "tokens_wasted": generated - used_tokens,
                "skipped_at_cap": self.skipped_at_cap}


__all__ = [
    "ENTER_MEDIAN_MS",
    "IKI_MEDIAN_MS",
    "Prefetched",
    "QueryPredictor",
    "RequestPrefetcher",
    "Served",
    "TTLCache",
    "TypingSession",
    "answer_spec",
    "normalize",
    "query_log",
    "retime",
    "typing_sessions",
    "typing_timeline",
]
