"""Experiments of 09_priority_scheduling: the mixed workload, the engine
flags per arm, and the per-class summaries (no vLLM needed)."""
import math

import pandas as pd
import pytest

from lab_utils.admission import BATCH, INTERACTIVE, ScheduledRun
from lab_utils.client import RequestRecord, Run
from lab_utils.experiments import priority_scheduling as pr
from lab_utils.metrics import SLO
from lab_utils.workloads import Schedule


def test_peak_arrivals_are_seeded_sorted_and_inside_the_peak():
    a = pr.peak_arrivals(12, 8.0, seed=3)
    assert a == pr.peak_arrivals(12, 8.0, seed=3) and a != pr.peak_arrivals(12, 8.0, seed=4)
    assert a[0] == 0.0 and a == sorted(a) and a[-1] < 8.0 and len(a) == 12
    assert pr.peak_arrivals(0, 8.0) == []
    with pytest.raises(ValueError):
        pr.peak_arrivals(3, 0.0)


def test_mixed_workload_shape():
    w = pr.mixed_workload(interactive=12, peak_s=8.0, batch=8, batch_tokens=128, batch_at_s=1.0,
                          batch_spread_s=0.5, interactive_tokens=(16, 32), seed=0)
    f = w.frame()
    assert (f.tag == BATCH).sum() == 8 and (f.tag == INTERACTIVE).sum() == 12
    assert f.arrival_s.is_monotonic_increasing
    b, i = f[f.tag == BATCH], f[f.tag == INTERACTIVE]
    assert (b.max_tokens == 128).all() and i.max_tokens.between(16, 32).all()
    assert b.arrival_s.min() == 1.0 and b.arrival_s.max() == pytest.approx(1.5)
    assert i.arrival_s.max() < 8.0
    assert all(s.ignore_eos for s in w.specs) and f.priority.isna().all()
    texts = [s.messages[-1]["content"] for s in w.specs]
    assert len(set(texts)) == len(texts)                    # no prompt repeats
    assert [s.messages for s in pr.mixed_workload(seed=0).specs] == \
        [s.messages for s in pr.mixed_workload(seed=0).specs]


def test_mixed_workload_rejects_bad_lengths():
    with pytest.raises(ValueError):
        pr.mixed_workload(interactive_tokens=(32, 16))


def test_priorities_lower_is_interactive():
    w = pr.with_priorities(pr.mixed_workload())
    pri = {s.tag: s.priority for s in w.specs}
    assert pri[INTERACTIVE] < pri[BATCH]           # vLLM serves the lower value first
    assert w.specs[0].payload("m")["priority"] == pri[w.specs[0].tag]
    none = pr.with_priorities(pr.mixed_workload(), None, None)
    assert "priority" not in none.specs[0].payload("m")


def test_only_keeps_one_class_with_its_times():
    w = pr.mixed_workload()
    inter = w.only(INTERACTIVE)
    assert {s.tag for s in inter.specs} == {INTERACTIVE}
    assert inter.offsets == [o for s, o in zip(w.specs, w.offsets) if s.tag == INTERACTIVE]


def test_engine_flags_one_knob_each():
    assert pr.engine_flags(0) == {}
    assert pr.engine_flags(4) == {"max_num_seqs": 4}
    assert pr.engine_flags(4, "fcfs") == {"max_num_seqs": 4}
    assert pr.engine_flags(4, "priority") == {"max_num_seqs": 4, "scheduling_policy": "priority"}


def test_slot_demand():
    w = Schedule([pr.RequestSpec(messages=[{"role": "user", "content": "x"}], tag=t)
                     for t in (BATCH, BATCH, INTERACTIVE)], [0.0, 0.0, 4.0])
    # 2 x 8 s + 1 x 2 s of work over 2 slots x 4 s
    assert pr.slot_demand(w, {BATCH: 8.0, INTERACTIVE: 2.0}, slots=2) == pytest.approx(18 / 8)


def _arm():
    recs, arrival, held = [], [], []
    # two interactive (one slow), two batch (one held 5 s)
    for i, (tag, at, h, ttft, e2e) in enumerate([(INTERACTIVE, 0.0, 0.0, 0.2, 1.0),
                                                (INTERACTIVE, 1.0, 0.0, 3.0, 4.0),
                                                (BATCH, 0.5, 5.0, 0.3, 8.0),
                                                (BATCH, 0.5, 0.0, 0.3, 8.0)]):
        recs.append(RequestRecord(index=i, tag=tag, ttft=ttft, e2e=e2e, ok=True,
                                  output_tokens=64 if tag == BATCH else 20))
        arrival.append(at)
        held.append(h)
    sched = ScheduledRun(Run("x", "", recs, 14.0), arrival, held)
    gauges = pd.DataFrame({"t_s": [0, 1], "requests_waiting": [0, 3],
                           "requests_running": [2, 4], "preemptions": [0, 0], "kv_cache_usage": [0, 0]})
    return pr.Arm("x", "e", sched, {"preemptions": 0.0}, gauges)


def test_class_summaries_price_of_holding():
    s = pr.class_summaries(_arm(), SLO(ttft_s=2.0, tpot_s=None))
    i, b = s["interactive"], s["batch"]
    assert i["requests"] == 2 and i["slo_met_fraction"] == 0.5
    assert i["duration_s"] == pytest.approx(5.0)          # first arrival 0 -> last done 5
    assert b["job_done_s"] == pytest.approx(13.5)          # 0.5 + 5 held + 8
    assert b["held_s_median"] == pytest.approx(2.5)
    assert b["job_throughput_tok_s"] == pytest.approx(128 / 13.0)


def test_arm_row_and_compare():
    row = pr.arm_row(_arm(), SLO(ttft_s=2.0, tpot_s=None))
    assert row["interactive SLO met (%)"] == 50.0 and row["max waiting (sampled)"] == 3
    assert row["preemptions"] == 0 and row["failed"] == 0
    table = pr.compare({"a": _arm(), "b": _arm()})
    assert list(table.index) == ["a", "b"] and "interactive TTFT p99" in table.columns
    assert not math.isnan(table.loc["a", "interactive TTFT p50"])


def test_findings_compare_each_policy_with_fcfs_and_the_control():
    arms = {k: _arm() for k in ("fcfs", "admission", "equal priority", "priority")}
    table = pr.compare(arms, SLO(ttft_s=2.0, tpot_s=None))
    found = pr.findings(arms, table)
    assert [f["technique"] for f in found] == [
        "scheduling: priority", "scheduling: priority (batch price)", "scheduling: admission",
        "scheduling: admission (batch price)", "scheduling: priority (same engine)"]
    for f in found:
        assert f["article_claim"] == pr.CLAIM and "vllm:num_preemptions_total" in f["mechanism"]
        assert not math.isnan(f["baseline"]) and not math.isnan(f["treated"])
    assert pr.findings({"fcfs": arms["fcfs"]}, table.loc[["fcfs"]]) == []


def test_plan_declares_the_fcfs_and_the_priority_engine_with_the_same_slots():
    from lab_utils.profiles import load_profile
    plan = pr.plan(load_profile("cpu"), {"max_num_seqs": 4})
    assert plan.names == ["fcfs", "priority"] and plan.problems() == []
    assert dict(plan.baseline.flags) == {"max_num_seqs": 4}
    assert dict(plan.arm("priority").flags) == {"max_num_seqs": 4, "scheduling_policy": "priority"}
    assert plan.arm("priority").knob == "scheduling_policy"
    default_slots = pr.plan(load_profile("cpu"), {"max_num_seqs": 0})
    assert dict(default_slots.baseline.flags) == {}     # 0 = vLLM's default slot count


class _Counted:
    """Stands in for a measured arm: `findings` reads only its counters."""
    def __init__(self, preemptions):
        self.counters = {"preemptions": preemptions}


def test_findings_read_the_table_hand_made():
    columns = ["interactive TTFT p50", "interactive TTFT p99", "batch job done at (s)",
               "batch held p50 (s)", "max waiting (sampled)", "mean waiting (sampled)",
               "max running (sampled)"]
    table = pd.DataFrame([[2500.0, 5600.0, 8.3, 0.0, 9, 3.25, 4],
                          [310.0, 2300.0, 11.8, 0.0, 5, 2.0, 4],
                          [3300.0, 6100.0, 8.9, 0.0, 8, 3.0, 4],
                          [88.0, 149.0, 17.5, 9.2, 4, 1.0, 4]],
                         index=["fcfs", "priority", "equal priority", "admission"], columns=columns)
    arms = {k: _Counted(0.0) for k in table.index}
    found = {f["metric"]: f for f in pr.findings(arms, table)}
    p99 = found["interactive TTFT p99 (ms), fcfs -> priority"]
    assert (p99["baseline"], p99["treated"], p99["p50"]) == (5600.0, 2300.0, [2500.0, 310.0])
    assert "fcfs: max 9 requests waiting (mean 3.2) and 4 running" in p99["mechanism"]
    price = found["batch job done at (s), fcfs -> admission"]
    assert (price["baseline"], price["treated"]) == (8.3, 17.5)
    assert price["mechanism"].startswith("batch held by the client p50 9.2 s; admission: max 4")
    control = found["interactive TTFT p99 (ms), equal -> class priorities"]
    assert (control["baseline"], control["treated"]) == (6100.0, 2300.0)
    assert control["technique"] == "scheduling: priority (same engine)"
    assert len(found) == 5


def _capacity(max_rate, concurrency=4):
    from lab_utils.capacity import Capacity
    return Capacity(sync_e2e_s=0.6, max_rate=max_rate, concurrency=concurrency, requests=16,
                    seconds=9.0, workload="interactive", engine="fcfs")


def test_the_peak_stretches_with_a_slower_engine():
    """Half the capacity: the same 12 requests over twice the time, and an
    admission window of the same number of arrival gaps."""
    fast = pr.place_peak(_capacity(5.0), interactive=12, interactive_load=0.3)
    slow = pr.place_peak(_capacity(2.5), interactive=12, interactive_load=0.3)
    assert fast.peak_s == 8.0 and slow.peak_s == 16.0          # 12 / (0.3 x 5), 12 / (0.3 x 2.5)
    assert fast.window_s == 3.0 and slow.window_s == 6.0       # 4.5 gaps of 8/12 s, of 16/12 s
    assert fast.rate == 1.5 and fast.share == pytest.approx(0.3) == slow.share
    assert "1.5 req/s = 0.30 x the 5 req/s the engine served with 4 in flight" in fast.describe()


def test_an_explicit_peak_needs_no_capacity():
    p = pr.place_peak(None, interactive=12, interactive_load=0.3, peak_s=8.0, window_s=2.0)
    assert (p.peak_s, p.window_s, p.share) == (8.0, 2.0, None)
    assert pr.place_peak(None, interactive=8, interactive_load=0, peak_s=6.0).window_s == 3.4
    with pytest.raises(ValueError, match="peak_s > 0"):
        pr.place_peak(None, interactive=12, interactive_load=0.3)


def test_capacity_concurrency_fills_the_slots():
    assert pr.capacity_concurrency(4) == 4 and pr.capacity_concurrency(16) == 16
    assert pr.capacity_concurrency(0) == 16 and pr.capacity_concurrency(64) == 16
