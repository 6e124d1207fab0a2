"""How much load an engine takes, measured first, so that load-dependent
experiments mean the same on a slow CPU, a fast CPU and a GPU.

A fixed request rate is light load on one machine and a flood on the next
(2-4x apart between CPUs of the same kind; a GPU is another world). So, as
GuideLLM's `sweep` profile does, the lab measures two points of the engine
for a workload before it places rates:

* **synchronous**: requests one at a time; `sync_rate` = 1 / median E2E is
  the rate an otherwise idle engine serves without queueing;
* **saturation**: `concurrency` requests in flight until `requests` have
  finished; `max_rate` = finished requests per second is its throughput.

`Capacity.rates_above_sync(k)` places the k-1 Poisson rates of a k-point
sweep whose first point is the synchronous run itself, as GuideLLM's is, up
to past saturation; `Capacity.fraction(f)` is a rate at a share of capacity.
`goodput_knee` finds the highest rate at which the share of requests meeting
the SLO stays at or above a target share of what light load attains, and
`knee_ratio_ci` the bootstrap interval of the ratio of two configurations'
knees. `probe_capacity` measures both points within a time budget and returns
their runs too; `measure_capacity` caches its result per engine
configuration, workload and machine in the results folder, so the notebooks
of one run measure an engine once.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .client import Load, RequestSpec

#: Share of a rate's requests that must meet the SLO for the rate to count as met.
DEFAULT_TARGET = 0.9


@dataclass(frozen=True)
class Capacity:
    """Two measured points of one engine on one workload."""
    sync_e2e_s: float          # median E2E of requests sent one at a time
    max_rate: float            # finished requests per second at saturation
    concurrency: int           # requests in flight in the saturation run
    requests: int              # requests of the saturation run
    seconds: float             # wall time both runs took
    workload: str = ""
    engine: str = ""

    @property
    def sync_rate(self) -> float:
        """Requests per second of an idle engine serving one at a time."""
        return 1.0 / self.sync_e2e_s if self.sync_e2e_s > 0 else math.nan

    def fraction(self, share: float) -> float:
        """The Poisson rate at `share` of the saturation throughput."""
        if share <= 0:
            raise ValueError(f"a share of capacity must be positive, got {share}")
        return share * self.max_rate

    def rates_above_sync(self, k: int, *, beyond: float = 1.3) -> list[float]:
        """The Poisson rates of a `k`-point sweep whose first point is the
        synchronous run itself (at `sync_rate`): `k - 1` rates evenly spaced
        above it, up to `beyond` x the saturation throughput (past the knee),
        rounded to 3 significant digits. The synchronous run is the lightest
        load there is (no two requests overlap), measured already by the
        capacity probe, so no Poisson rate is spent on an idle engine (the
        one at half the one-at-a-time rate took ~54 s of 12_checklist's
        269-s sweep cell for 2 arms in a `make run` at 3e7940a; the cell took
        180 s this way at 4444bdd; 2-core Intel AMX guest, AVX2 kernels
        emulated, the host faster in the second run)."""
        if k < 2:
            raise ValueError(f"a sweep needs at least 2 points, got {k}")
        lo = self.sync_rate
        hi = beyond * max(self.max_rate, lo)
        if not (0 < lo < hi):
            raise ValueError(f"no sweep between {lo:g} and {hi:g} req/s ({self})")
        return [float(f"{r:.3g}") for r in np.linspace(lo, hi, k)[1:]]

    def describe(self) -> str:
        return (f"capacity of {self.engine or 'the engine'} on {self.workload or 'the workload'}:"
                f" one at a time {self.sync_rate:.3g} req/s (E2E {self.sync_e2e_s * 1e3:.0f} ms),"
                f" saturated {self.max_rate:.3g} req/s ({self.concurrency} in flight,"
                f" {self.requests} requests); measured in {self.seconds:.0f} s")


def cache_path(results) -> Path:
    """Where a run keeps its capacity measurements: beside the notebooks'
    results, in a subfolder, so the run's index and comparisons, which read
    every `results/*.json` as a notebook's results, do not take it for one."""
    return Path(results.dir) / "cache" / "capacity.json"


def _cache_key(engine, workload: str) -> str:
    from .machine import fingerprint, machine_info
    flags = json.dumps({"label": engine.label, "model": engine.model,
                        "profile": engine.profile.name, "url": engine.base_url
                        if engine.server is None else "local"}, sort_keys=True)
    return f"{fingerprint(machine_info())}|{flags}|{workload}"


def _load_cache(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}   # a half-written cache is remeasured, not trusted


def probe_capacity(engine, make_specs: Callable[[int, int], Sequence[RequestSpec]], *,
                   workload: str, sequential: int = 4, requests: int = 16,
                   concurrency: int = 8, budget_s: float = 120.0,
                   run: Callable[[Sequence[RequestSpec], Load, str], Any] | None = None,
                   results=None, progress: bool = True) -> tuple[Capacity, Any, Any]:
    """Measure the engine's capacity on a workload, uncached: (the capacity,
    the synchronous run, the saturation run), so that a caller can keep the
    two runs' requests as points of its own sweep (GuideLLM's `sweep` does:
    its first point is the synchronous run).

    `make_specs(n, seed)` builds n requests of the workload the experiment
    will send (different text per seed, so the prefix cache does not flatter
    the measurement); `workload` names it. `run(specs, load, phase)` sends
    them (phase "sequential" or "saturated") and returns the client's run;
    by default the engine's plain client, labelled `capacity/<workload>/<phase>`.
    The saturation run is cut to what `budget_s` allows, assuming no speed-up
    from batching (the worst case: one request after another at the
    synchronous E2E), but keeps at least `concurrency` requests so that the
    engine is saturated."""
    if run is None:
        from .client import Client
        client = Client.for_engine(engine)

        def run(specs, load, phase):
            return client.run(specs, load, label=f"capacity/{workload}/{phase}", progress=progress)
    t0 = time.perf_counter()
    seq = run(make_specs(sequential, 7001), Load.sequential(), "sequential")
    e2e = [r.e2e for r in seq.records if r.ok and r.e2e]
    if not e2e:
        raise RuntimeError(f"capacity probe: no request of {workload!r} succeeded one at a time")
    sync_e2e = float(np.median(e2e))
    left = budget_s - (time.perf_counter() - t0)
    n = max(min(requests, int(left / sync_e2e)), concurrency)
    sat = run(make_specs(n, 7002), Load.concurrent(concurrency), "saturated")
    done = sum(1 for r in sat.records if r.ok)
    cap = Capacity(sync_e2e_s=sync_e2e, max_rate=done / sat.duration_s if sat.duration_s else 0.0,
                   concurrency=concurrency, requests=n, seconds=time.perf_counter() - t0,
                   workload=workload, engine=engine.label)
    _record(results, cap, cached=False)
    return cap, seq, sat


def measure_capacity(engine, make_specs: Callable[[int, int], Sequence[RequestSpec]], *,
                     workload: str, sequential: int = 4, requests: int = 16,
                     concurrency: int = 8, budget_s: float = 120.0,
                     cache: str | Path | None = None, results=None,
                     progress: bool = True) -> Capacity:
    """`probe_capacity`, or its result read from `cache` (one entry per
    engine configuration, workload and machine)."""
    path = Path(cache) if cache is not None else None
    key = _cache_key(engine, workload)
    stored = _load_cache(path)
    if key in stored:
        cap = Capacity(**stored[key])
        _record(results, cap, cached=True)
        return cap
    cap, _, _ = probe_capacity(engine, make_specs, workload=workload, sequential=sequential,
                               requests=requests, concurrency=concurrency, budget_s=budget_s,
                               results=results, progress=progress)
    if path is not None:
        from .paths import locked, write_atomic
        with locked(path):  # another process may add its own engines' capacities
            stored = _load_cache(path)
            stored[key] = asdict(cap)
            write_atomic(path, json.dumps(stored, indent=1))
    return cap


def _record(results, cap: Capacity, *, cached: bool) -> None:
    if results is not None:
        results.data.setdefault("capacity", {})[f"{cap.engine} | {cap.workload}"] = {
            **asdict(cap), "sync_rate": cap.sync_rate, "cached": cached}
        results.save()


def goodput_knee(rates: Sequence[float], met: Sequence[float], target: float = DEFAULT_TARGET,
                 *, relative: bool = True) -> tuple[float | None, bool]:
    """(knee, reached): the highest rate at which the share of requests meeting
    the SLO (`met`, one per rate) is still >= the threshold, linearly
    interpolated between the last rate that meets it and the next one that
    does not. The threshold is `target` x the share met at the lowest rate
    (`relative`: where load starts to cost what an idle engine attains; some
    requests, e.g. a long prefill on a CPU, may miss the SLO at any load), or
    `target` itself. `reached` is False when every rate met it (the knee is at
    or past the highest rate tried: the rate returned is a lower bound); the
    knee is None when the threshold is unreachable (nothing met at the lowest
    rate, or the absolute target missed there)."""
    pairs = sorted(zip(map(float, rates), map(float, met)))
    if not pairs:
        return None, False
    threshold = target * pairs[0][1] if relative else target
    if pairs[0][1] <= 0 or pairs[0][1] < threshold:
        return None, True
    for (r0, m0), (r1, m1) in zip(pairs, pairs[1:]):
        if m1 < threshold <= m0:
            return r0 + (m0 - threshold) / (m0 - m1) * (r1 - r0), True
    return pairs[-1][0], False


def knee_ratio_ci(base: Mapping[float, Sequence[bool]], treated: Mapping[float, Sequence[bool]],
                  *, target: float = DEFAULT_TARGET, relative: bool = True,
                  resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(ratio, low, high): treated knee / base knee, and its 95% bootstrap
    interval from resampling each rate's requests (True = met the SLO).
    NaN where a knee is undefined (missed at the lowest rate) in the data."""
    def knee(curve: Mapping[float, np.ndarray]) -> float:
        k, _ = goodput_knee(list(curve), [v.mean() if len(v) else 0.0 for v in curve.values()],
                            target, relative=relative)
        return math.nan if k is None else k

    b = {r: np.asarray(v, bool) for r, v in base.items()}
    t = {r: np.asarray(v, bool) for r, v in treated.items()}
    point = knee(t) / knee(b) if knee(b) else math.nan
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        kb = knee({r: rng.choice(v, len(v)) if len(v) else v for r, v in b.items()})
        kt = knee({r: rng.choice(v, len(v)) if len(v) else v for r, v in t.items()})
        if kb and math.isfinite(kb) and math.isfinite(kt):
            draws.append(kt / kb)
    if len(draws) < resamples // 2:
        return point, math.nan, math.nan
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return point, float(lo), float(hi)


__all__ = ["DEFAULT_TARGET", "Capacity", "cache_path", "goodput_knee", "knee_ratio_ci", "measure_capacity",
           "probe_capacity"]
