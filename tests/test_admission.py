"""The client-side off-peak admission policy and its runner (no vLLM needed:
the runner is checked against the fake OpenAI server)."""
import asyncio
import time

import pytest

from lab_utils.admission import (
    BATCH,
    INTERACTIVE,
    OffPeakAdmission,
    PassThrough,
    run_schedule_async,
)
from lab_utils.client import Client, Load, RequestSpec, run_sync


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def spec(tag, model_hint="q"):
    return RequestSpec(messages=[{"role": "user", "content": model_hint}], max_tokens=4, tag=tag)


# --------------------------------------------------------------------------
# The load it counts (a fake clock, no event loop needed for the bookkeeping)
# --------------------------------------------------------------------------

def test_interactive_load_counts_in_flight_and_recent_arrivals_once():
    clock = Clock()
    policy = OffPeakAdmission(threshold=0, window_s=2.0, clock=clock)
    a, b = spec(INTERACTIVE), spec(INTERACTIVE)
    run_sync(policy.admit(a))
    clock.now += 0.5
    run_sync(policy.admit(b))
    assert policy.interactive_load() == 2          # both in flight and recent: counted once each
    policy.release(a)
    assert policy.interactive_load() == 2          # a finished but arrived < 2 s ago
    clock.now += 1.6                               # a arrived 2.1 s ago, b 1.6 s ago
    assert policy.interactive_load() == 1
    assert not policy.may_send_batch()
    policy.release(b)
    assert policy.interactive_load() == 1          # b still recent
    clock.now += 0.5
    assert policy.interactive_load() == 0 and policy.may_send_batch()


def test_threshold_lets_batch_through_under_light_load():
    clock = Clock()
    policy = OffPeakAdmission(threshold=1, window_s=5.0, clock=clock)
    run_sync(policy.admit(spec(INTERACTIVE)))
    assert policy.may_send_batch()
    run_sync(policy.admit(spec(INTERACTIVE)))
    assert not policy.may_send_batch()


def test_batch_cap():
    policy = OffPeakAdmission(max_batch_in_flight=1, window_s=0.0)
    batch = spec(BATCH)
    run_sync(policy.admit(batch))
    assert not policy.may_send_batch()             # one batch request already runs
    policy.release(batch)
    assert policy.may_send_batch()


@pytest.mark.parametrize("kw", [{"threshold": -1}, {"window_s": -0.5},
                                {"max_batch_in_flight": -2}])
def test_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        OffPeakAdmission(**kw)


def test_interactive_is_never_held_and_batch_waits_for_the_window():
    async def go():
        policy = OffPeakAdmission(threshold=0, window_s=0.15)
        inter, batch = spec(INTERACTIVE), spec(BATCH)
        t0 = time.perf_counter()
        await policy.admit(inter)
        # not held: well under the 150 ms window (a busy machine may add a few ms)
        assert time.perf_counter() - t0 < 0.05
        waiter = asyncio.ensure_future(policy.admit(batch))
        await asyncio.sleep(0.05)
        assert not waiter.done()                    # interactive still in flight
        policy.release(inter)                       # finished, but arrived 0.05 s ago
        await asyncio.sleep(0.02)
        assert not waiter.done()
        await asyncio.wait_for(waiter, 1.0)         # released once the window has passed
        return time.perf_counter() - t0

    held = run_sync(go())
    assert 0.15 <= held < 0.4


def test_reset_forgets_traffic():
    clock = Clock()
    policy = OffPeakAdmission(window_s=10.0, clock=clock)
    run_sync(policy.admit(spec(INTERACTIVE)))
    assert policy.interactive_load() == 1
    policy.reset()
    assert policy.interactive_load() == 0


def test_describe_names_the_rule():
    text = OffPeakAdmission(threshold=2, window_s=3, max_batch_in_flight=4).describe()
    assert "> 2" in text and "3 s" in text and "4 batch" in text
    assert "arrival" in PassThrough().describe()


# --------------------------------------------------------------------------
# The runner, against the fake server
# --------------------------------------------------------------------------



def test_run_schedule_holds_batch_until_off_peak(fake, tmp_path):
    client = Client(fake.base_url, "chat")       # 150 ms per request
    specs = [spec(INTERACTIVE), spec(BATCH), spec(INTERACTIVE), spec(BATCH)]
    offsets = [0.0, 0.02, 0.1, 0.12]
    policy = OffPeakAdmission(threshold=0, window_s=0.1)
    sched = run_sync(run_schedule_async(client, specs, offsets, policy=policy, label="adm",
                                        jsonl=tmp_path / "adm.jsonl"))
    assert len(sched.run.records) == 4 and all(r.ok for r in sched.run.records)
    assert sched.held_s[0] == pytest.approx(0, abs=0.01)
    assert sched.held_s[2] == pytest.approx(0, abs=0.01)
    # the second interactive request finishes at ~0.25 s, and arrived at 0.1 s
    # (window 0.1 s): batch goes at ~0.25 s, having arrived at 0.02 / 0.12 s
    assert 0.2 <= sched.held_s[1] + 0.02 < 0.45
    assert 0.2 <= sched.held_s[3] + 0.12 < 0.45
    frame = sched.frame()
    assert {"arrival_s", "held_s", "wait_ms", "done_s"} <= set(frame.columns)
    assert (frame.done_s >= frame.arrival_s).all()
    lines = (tmp_path / "adm.jsonl").read_text().splitlines()
    assert len(lines) == 4 and '"held_s"' in lines[0]


def test_run_schedule_without_policy_sends_at_arrival(fake):
    client = Client(fake.base_url, "chat")
    sched = run_sync(run_schedule_async(client, [spec(BATCH), spec(INTERACTIVE)],
                                        Load.at([0.0, 0.05])))
    assert sched.held_s == [0.0, 0.0] or max(sched.held_s) < 0.01
    assert fake.max_in_flight == 2                  # nothing was held back


def test_run_schedule_needs_arrival_times(fake):
    client = Client(fake.base_url, "chat")
    with pytest.raises(ValueError, match="arrival times"):
        run_sync(run_schedule_async(client, [spec(BATCH)], Load.concurrent(1)))
    with pytest.raises(ValueError, match="offsets"):
        run_sync(run_schedule_async(client, [spec(BATCH)], [0.0, 1.0]))
