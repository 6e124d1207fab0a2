"""The interference workload: a steady stream of short requests with long
prompts landing among them, the shape in which a long prefill blocks the
short requests' decode (`01_chunked_prefill`; the measures of what it does
are `lab_utils.metrics.decode_stall` and `arrived_while_waiting`).

`mixed_schedule` gives the send times (a seeded Poisson stream, the long
requests at fixed offsets, an anchor short request just before each long
one); `place_load` sizes it from what the engine measured (the short
stream at a share of its capacity for short requests, the long prompts a
multiple of one long request's solo latency apart), so that the queue a
long prompt builds is the same on a slow CPU, a fast CPU and a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .capacity import Capacity
from .client import Load

SHORT, LONG = "short", "long"


def mixed_schedule(n_short: int, short_rate: float, long_at: Sequence[float], *,
                   anchor_lead_s: float = 0.4, seed: int = 0) -> list[tuple[float, str]]:
    """Send times (s from the run start) and tags, sorted by time.

    Short requests arrive as a seeded Poisson stream at `short_rate` req/s
    (`Load.poisson`); a long request arrives at each offset in `long_at`. One
    extra "anchor" short request is sent `anchor_lead_s` before each long one,
    so that at least one short request is decoding when every long prompt
    lands (the decode stall is then measured on every run, not by luck)."""
    if n_short < 0 or not short_rate > 0:
        raise ValueError(f"need n_short >= 0 and short_rate > 0, got {n_short}, {short_rate}")
    shorts = Load.poisson(short_rate, seed=seed).arrival_offsets(n_short) if n_short else []
    anchors = [max(0.0, t - anchor_lead_s) for t in long_at] if anchor_lead_s > 0 else []
    events = ([(float(t), SHORT) for t in shorts] + [(float(t), SHORT) for t in anchors]
              + [(float(t), LONG) for t in long_at])
    # Stable sort: at equal times the short request goes first.
    return sorted(events, key=lambda e: (e[0], e[1] == LONG))


@dataclass(frozen=True)
class PlacedLoad:
    """The schedule's load and where it came from: the short stream's rate as
    a share of the engine's measured capacity for short requests, and the
    long requests' spacing in multiples of one long request's solo latency.
    Then the queue a long prompt builds is the same on a slow CPU, a fast CPU
    and a GPU. Explicit values (`short_rate`, `long_at`) are used as given."""
    short_rate: float
    long_at: tuple[float, ...]
    n_short: int
    short_capacity: Capacity | None = None
    long_solo_s: float | None = None

    def workload(self) -> dict[str, Any]:
        """The workload keywords (`n_short`, `short_rate`, `long_at`) of this load."""
        return {"n_short": self.n_short, "short_rate": self.short_rate,
                "long_at": list(self.long_at)}

    @property
    def short_share(self) -> float | None:
        """The short stream's rate over the short requests' saturation throughput."""
        cap = self.short_capacity
        return self.short_rate / cap.max_rate if cap and cap.max_rate > 0 else None

    def describe(self) -> str:
        parts = [f"{self.n_short} short requests at {self.short_rate:.3g} req/s"]
        if self.short_share is not None:
            parts[0] += (f" = {self.short_share:.2f} x the {self.short_capacity.max_rate:.3g} "
                         "req/s the engine served saturated")
        gaps = np.diff(self.long_at)
        parts.append(f"{len(self.long_at)} long requests at {[round(t, 2) for t in self.long_at]}"
                     " s" + (f" (every {gaps.mean():.2f} s" if len(gaps) else " (")
                     + (f"; one alone took {self.long_solo_s:.2f} s)" if self.long_solo_s
                        else ")"))
        return "; ".join(parts)


def place_load(short: Capacity | None, long_solo_s: float | None, *, short_load: float,
               long_requests: int, long_spacing: float, short_rate: float = 0.0,
               long_at: Sequence[float] = (), n_short: int = 0) -> PlacedLoad:
    """The schedule of the sweep (pure). The short stream runs at `short_load`
    x the short requests' saturation throughput (`short.max_rate`) unless
    `short_rate` > 0 fixes it; `long_requests` long prompts arrive
    `long_spacing` x `long_solo_s` apart (the first half a gap in) unless
    `long_at` fixes the times; `n_short` (0: enough to keep the stream going
    until the last long prompt arrives, at least 4)."""
    if short_rate > 0:
        rate = float(short_rate)
    elif short is not None and short.max_rate > 0 and short_load > 0:
        rate = short.fraction(short_load)
    else:
        raise ValueError("no short-request rate: give short_rate > 0, or short_load > 0 and a "
                         "measured capacity")
    if long_at:
        times = tuple(float(t) for t in long_at)
    elif long_requests > 0:
        if not (long_solo_s and long_solo_s > 0 and long_spacing > 0):
            raise ValueError("no long-request times: give long_at, or long_spacing > 0 and a "
                             "measured long-request latency")
        gap = long_spacing * long_solo_s
        times = tuple(round(gap * (i + 0.5), 2) for i in range(int(long_requests)))
    else:
        times = ()
    span = max(times, default=0.0)
    n = int(n_short) if n_short > 0 else max(4, math.ceil(rate * span))
    return PlacedLoad(float(f"{rate:.3g}"), times, n, short, long_solo_s)



__all__ = ["LONG", "PlacedLoad", "SHORT", "mixed_schedule", "place_load"]
