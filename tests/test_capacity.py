"""lab_utils.capacity: measured capacity against a fake engine with a known
one (tests/fake_openai.py "slots": 2 requests at a time, 0.1 s each), the rate
placement, and the goodput knee on hand-made curves."""
from __future__ import annotations

import math
import time

import pytest
from fake_openai import SLOT_S, SLOTS

from lab_utils.capacity import (
    Capacity,
    goodput_knee,
    knee_ratio_ci,
    measure_capacity,
    probe_capacity,
)
from lab_utils.client import RequestSpec
from lab_utils.profiles import load_profile
from lab_utils.server import Engine


def _engine(fake) -> Engine:
    return Engine(load_profile("remote", base_url=fake.base_url), {}, fake.base_url, "slots")


def _specs(n: int, seed: int) -> list[RequestSpec]:
    return [RequestSpec(prompt=f"request {seed}-{i}", max_tokens=1) for i in range(n)]


def test_measured_capacity_matches_the_fake_engines(fake, tmp_path):
    cap = measure_capacity(_engine(fake), _specs, workload="one-token", sequential=4,
                           requests=20, concurrency=6, cache=tmp_path / "capacity.json",
                           progress=False)
    assert cap.sync_rate == pytest.approx(1 / SLOT_S, rel=0.3)      # ~10 req/s one at a time
    assert cap.max_rate == pytest.approx(SLOTS / SLOT_S, rel=0.3)   # ~20 req/s saturated
    assert fake.max_in_flight == 6
    sent = len(fake.requests)
    again = measure_capacity(_engine(fake), _specs, workload="one-token",
                             cache=tmp_path / "capacity.json", progress=False)
    assert again == cap and len(fake.requests) == sent              # read from the cache
    other = measure_capacity(_engine(fake), _specs, workload="other", sequential=2, requests=6,
                             concurrency=3, cache=tmp_path / "capacity.json", progress=False)
    assert len(fake.requests) == sent + 2 + 6 and other.workload == "other"


def test_the_time_budget_cuts_the_saturation_run(fake):
    t0 = time.perf_counter()
    cap = measure_capacity(_engine(fake), _specs, workload="budget", sequential=2,
                           requests=1000, concurrency=2, budget_s=1.0, progress=False)
    # 2 sequential requests take ~0.2 s; the rest of 1 s allows ~8 at 0.1 s each.
    assert cap.requests <= 10 and time.perf_counter() - t0 < 2.5


def test_a_share_of_capacity_is_a_share_of_its_saturation_throughput():
    cap = Capacity(sync_e2e_s=0.5, max_rate=5.0, concurrency=8, requests=16, seconds=3)
    assert cap.sync_rate == 2.0
    assert cap.fraction(0.5) == 2.5
    with pytest.raises(ValueError):
        cap.fraction(0)


def test_a_sweep_from_the_synchronous_run_places_its_poisson_rates_above_it():
    cap = Capacity(sync_e2e_s=0.5, max_rate=5.0, concurrency=8, requests=16, seconds=3)
    # 4 points: the synchronous run at 2 req/s, then 3 rates evenly to 1.3 x 5 = 6.5
    assert cap.rates_above_sync(4) == [3.5, 5.0, 6.5]
    assert cap.rates_above_sync(2) == [6.5]
    # Saturation below the one-at-a-time rate (batching does not pay): the
    # rates still rise from it, to 1.3 x 4 req/s.
    slow = Capacity(sync_e2e_s=0.25, max_rate=2.0, concurrency=8, requests=16, seconds=3)
    assert slow.rates_above_sync(3) == [4.6, 5.2]
    with pytest.raises(ValueError):
        cap.rates_above_sync(1)


def test_the_probe_returns_its_two_runs_for_a_sweep_to_keep(fake):
    phases = []

    def run(specs, load, phase):
        from lab_utils.client import Client
        phases.append((phase, len(specs)))
        return Client.for_engine(_engine(fake)).run(specs, load, label=phase, progress=False)

    cap, seq, sat = probe_capacity(_engine(fake), _specs, workload="one-token", sequential=5,
                                   requests=12, concurrency=4, run=run, progress=False)
    assert phases == [("sequential", 5), ("saturated", 12)]
    assert len(seq.records) == 5 and all(r.ok for r in seq.records)
    assert len(sat.records) == 12 and fake.max_in_flight == 4
    assert cap.sync_rate == pytest.approx(1 / SLOT_S, rel=0.3)
    assert cap.max_rate == pytest.approx(SLOTS / SLOT_S, rel=0.3)


def test_knee_interpolates_where_the_met_share_crosses_the_target():
    # met share 1.0, 0.95 (passes 0.9), then 0.7 (fails): crossing a quarter of
    # the way from rate 2 to rate 3 (0.95 - 0.9 = 0.05 of the 0.25 drop: 1/5).
    assert goodput_knee([1, 2, 3, 4], [1.0, 0.95, 0.7, 0.1]) == (pytest.approx(2.2), True)
    assert goodput_knee([3, 1, 2], [0.7, 1.0, 0.95]) == (pytest.approx(2.2), True)   # any order
    assert goodput_knee([1, 2], [1.0, 0.95]) == (2.0, False)      # never crossed: lower bound
    # Half the requests miss the SLO even at light load (e.g. long prefills):
    # relative to that, 0.45 is crossed a sixth of the way to rate 2.
    assert goodput_knee([1, 2], [0.5, 0.2]) == (pytest.approx(1 + 0.05 / 0.3), True)
    assert goodput_knee([1, 2], [0.5, 0.2], relative=False) == (None, True)   # absolute 0.9
    assert goodput_knee([1, 2], [0.0, 0.0]) == (None, True)       # nothing met at all
    assert goodput_knee([1, 2, 3], [1.0, 0.9, 0.0]) == (pytest.approx(2.0), True)


def test_knee_ratio_and_its_interval():
    n = 40
    base = {1.0: [True] * n, 2.0: [True] * 20 + [False] * 20, 3.0: [False] * n}
    treated = {1.0: [True] * n, 2.0: [True] * n, 3.0: [True] * 20 + [False] * 20}
    ratio, lo, hi = knee_ratio_ci(base, treated, resamples=400)
    # base crosses 0.9 at 1 + 0.1/0.5 = 1.2; treated at 2 + 0.1/0.5 = 2.2
    assert ratio == pytest.approx(2.2 / 1.2)
    assert lo <= ratio <= hi and hi - lo < 1.0
    ratio, lo, hi = knee_ratio_ci({1.0: [False] * 5}, treated, resamples=50)
    assert math.isnan(ratio) and math.isnan(lo)


def test_the_cache_lives_beside_the_results_not_among_them(tmp_path):
    """The run's index reads every results/*.json as a notebook's results."""
    from types import SimpleNamespace

    from lab_utils.capacity import cache_path
    from lab_utils.report import load_findings
    path = cache_path(SimpleNamespace(dir=tmp_path))
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    assert path.parent != tmp_path and load_findings(tmp_path) == {}
