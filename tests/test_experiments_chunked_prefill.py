"""The pure logic of the chunked-prefill experiments: the schedule, the decode
stall, the engine-step log parser, the arm flags, the plan and the findings
(no engine needed)."""
import math
from types import SimpleNamespace

import pandas as pd
import pytest
from stand_ins import INTERFERENCE_RECORDS as RECORDS
from stand_ins import ITERATION_LOG as LOG
from stand_ins import word_tokenizer

from lab_utils.client import Load, Run
from lab_utils.experiments import chunked_prefill as cp
from lab_utils.profiles import check_known_options, load_profile


# --------------------------------------------------------------------------
# mixed_schedule
# --------------------------------------------------------------------------

def test_schedule_is_sorted_and_counts_every_request():
    sched = cp.mixed_schedule(10, 2.0, [1.5, 6.0], seed=3)
    times = [t for t, _ in sched]
    assert times == sorted(times)
    assert sum(tag == cp.LONG for _, tag in sched) == 2
    assert sum(tag == cp.SHORT for _, tag in sched) == 10 + 2  # one anchor per long
    assert times[0] == 0.0  # the Poisson stream's first request goes at once


def test_schedule_puts_an_anchor_short_just_before_each_long():
    sched = cp.mixed_schedule(3, 1.0, [2.0, 9.0], anchor_lead_s=0.4, seed=0)
    shorts = [t for t, tag in sched if tag == cp.SHORT]
    for t_long in (2.0, 9.0):
        assert any(t == pytest.approx(t_long - 0.4) for t in shorts)


def test_schedule_is_deterministic_and_matches_load_poisson():
    a = cp.mixed_schedule(8, 1.5, [3.0], anchor_lead_s=0, seed=7)
    assert a == cp.mixed_schedule(8, 1.5, [3.0], anchor_lead_s=0, seed=7)
    shorts = [t for t, tag in a if tag == cp.SHORT]
    assert shorts == pytest.approx(Load.poisson(1.5, seed=7).arrival_offsets(8))
    assert a != cp.mixed_schedule(8, 1.5, [3.0], anchor_lead_s=0, seed=8)


def test_schedule_without_shorts_and_bad_rates():
    assert cp.mixed_schedule(0, 1.0, [1.0], anchor_lead_s=0) == [(1.0, cp.LONG)]
    # an anchor never goes before the run start; at equal times the short goes first
    assert cp.mixed_schedule(0, 1.0, [0.2], anchor_lead_s=0.4) == [(0.0, cp.SHORT),
                                                                   (0.2, cp.LONG)]
    with pytest.raises(ValueError):
        cp.mixed_schedule(5, 0.0, [1.0])


def test_mixed_workload_follows_the_schedule(monkeypatch):
    monkeypatch.setattr(cp, "tokenizer_for", lambda engine: word_tokenizer())
    wl = cp.mixed_workload(None, n_short=5, short_rate=2.0, long_at=(1.0, 4.0),
                           long_prompt_tokens=300, short_output_tokens=16, seed=1)
    assert wl.count(cp.LONG) == 2 and wl.count(cp.SHORT) == 5 + 2
    sched = cp.mixed_schedule(5, 2.0, (1.0, 4.0), seed=1)
    assert [s.tag for s in wl.specs] == [tag for _, tag in sched]
    assert list(wl.load.offsets) == [t for t, _ in sched]
    shorts = [s for s in wl.specs if s.tag == cp.SHORT]
    assert all(s.api == "chat" and s.ignore_eos and s.max_tokens == 16 for s in shorts)
    longs = [s for s in wl.specs if s.tag == cp.LONG]
    assert all(len(s.prompt.split()) == 300 for s in longs)
    assert longs[0].prompt != longs[1].prompt
    assert "300 prompt tokens" in wl.description


# --------------------------------------------------------------------------
# Arms: flags, labels, plan, table row
# --------------------------------------------------------------------------

def test_off_arm_asks_for_max_model_len():
    assert cp.arm_flags(False, None, 4096) == {"enable_chunked_prefill": False,
                                               "max_num_batched_tokens": 4096,
                                               "enable_logging_iteration_details": True}
    assert cp.arm_flags(False, 8192, 4096)["max_num_batched_tokens"] == 8192
    assert cp.arm_flags(False, None, None, log_steps=False) == {"enable_chunked_prefill": False}


def test_off_arm_below_max_model_len_is_refused_like_vllm_does():
    with pytest.raises(ValueError, match=r"must be >= max_model_len \(4096\)"):
        cp.arm_flags(False, 2048, 4096)
    with pytest.raises(ValueError, match="chunked prefill on"):
        cp.arm_flags(False, None, 4096, threshold=128)


def test_on_arm_flags():
    assert cp.arm_flags(True, 256, 4096, log_steps=False) == {
        "enable_chunked_prefill": True, "max_num_batched_tokens": 256}
    flags = cp.arm_flags(True, 256, 4096, threshold=128)
    assert flags["long_prefill_token_threshold"] == 128
    assert cp.arm_flags(True, None, 4096, log_steps=False) == {"enable_chunked_prefill": True}


def test_arm_flags_are_known_to_the_installed_vllm():
    check_known_options(cp.arm_flags(False, None, 4096))
    check_known_options(cp.arm_flags(True, 256, 4096, threshold=128))


def test_labels_and_plan():
    assert cp.arm_label(False, 4096) == "off (budget 4096)"
    assert cp.arm_label(True, 256) == "on, budget 256"
    assert cp.arm_label(True, 256, 128) == "on, budget 256, threshold 128"
    assert cp.sweep_plan([1024, 256, 256]) == [(False, None, 0), (True, 256, 0), (True, 1024, 0)]
    assert cp.sweep_plan([512], include_off=False, threshold=64) == [(True, 512, 0),
                                                                    (True, 512, 64)]
    with pytest.raises(ValueError):
        cp.sweep_plan([], threshold=64)
    with pytest.raises(ValueError):
        cp.sweep_plan([0])


def test_arm_row():
    run = Run("x", "offsets", RECORDS, duration_s=8.0,
              counters={"server_queue_s_mean": 0.01, "server_prefill_s_mean": 0.5,
                        "server_itl_s_p99": 2.0, "server_ttft_s_p99": 3.0,
                        "prefix_cache_hits": 0})
    arm = cp.ArmRun("on, budget 256", True, 256, run, 0, cp.parse_iteration_log(LOG))
    row = cp.arm_row(arm)
    assert row["max_num_batched_tokens"] == 256 and row["chunked_prefill"]
    assert row["long_ttft_ms_median"] == pytest.approx(2900.0)
    assert row["stall_itl_ms_max"] == pytest.approx(3000.0)
    assert row["blocked_short_ttft_ms_median"] == pytest.approx(2600.0)
    assert row["server_queue_ms_mean"] == pytest.approx(10.0)
    assert row["max_prefill_tokens_per_step"] == 1536
    out_tokens = sum(r.output_tokens for r in RECORDS)
    assert row["output_tok_s"] == pytest.approx(out_tokens / 8.0)


def test_plot_sweep_draws_every_arm():
    import matplotlib
    matplotlib.use("Agg")
    table = pd.DataFrame([
        {"arm": "off", "chunked_prefill": False, "max_num_batched_tokens": 4096,
         "long_prefill_token_threshold": 0, "stall_itl_ms_max": 2500, "short_ttft_ms_p99": 3000,
         "long_ttft_ms_median": 2500},
        {"arm": "256", "chunked_prefill": True, "max_num_batched_tokens": 256,
         "long_prefill_token_threshold": 0, "stall_itl_ms_max": 400, "short_ttft_ms_p99": 2200,
         "long_ttft_ms_median": 2100},
        {"arm": "1024", "chunked_prefill": True, "max_num_batched_tokens": 1024,
         "long_prefill_token_threshold": 0, "stall_itl_ms_max": 1400, "short_ttft_ms_p99": 2400,
         "long_ttft_ms_median": 2300},
        {"arm": "thr", "chunked_prefill": True, "max_num_batched_tokens": 256,
         "long_prefill_token_threshold": 128, "stall_itl_ms_max": 300, "short_ttft_ms_p99": 500,
         "long_ttft_ms_median": 2200}]).set_index("arm")
    fig = cp.plot_sweep(table)
    axes = fig.axes
    assert len(axes) == 3
    for ax in axes:
        labels = ax.get_legend_handles_labels()[1]
        assert "chunked prefill on" in labels
        assert any(label.startswith("chunked prefill off") for label in labels)
        assert any("threshold 128" in label for label in labels)
        assert "(ms)" in ax.get_ylabel() and "max_num_batched_tokens" in ax.get_xlabel()


def test_headline_arms():
    table = pd.DataFrame([
        {"arm": "off", "chunked_prefill": False, "max_num_batched_tokens": 4096,
         "long_prefill_token_threshold": 0},
        {"arm": "on 1024", "chunked_prefill": True, "max_num_batched_tokens": 1024,
         "long_prefill_token_threshold": 0},
        {"arm": "thr", "chunked_prefill": True, "max_num_batched_tokens": 128,
         "long_prefill_token_threshold": 64},
        {"arm": "on 256", "chunked_prefill": True, "max_num_batched_tokens": 256,
         "long_prefill_token_threshold": 0}]).set_index("arm")
    assert cp.headline_arms(table) == ("off", "on 256")
    assert cp.headline_arms(table.drop(index="off")) == (None, "on 256")
    assert cp.headline_arms(pd.DataFrame()) == (None, None)


def test_plot_steps():
    import matplotlib
    matplotlib.use("Agg")
    run = Run("x", "offsets", RECORDS, 8.0)
    runs = {"off": cp.ArmRun("off", False, 4096, run, 0, cp.parse_iteration_log(LOG)),
            "empty": cp.ArmRun("empty", True, 256, run)}
    fig = cp.plot_steps(runs)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["off: every step", "off: steps with prefill tokens"]
    assert cp.plot_steps({"empty": runs["empty"]}) is None  # said, not raised (remote runs)


def test_plan_compares_every_budget_with_off_and_the_threshold_with_its_budget():
    cpu = load_profile("cpu")
    plan = cp.plan(cpu, {"budgets": [1024, 256], "long_prefill_threshold": 128}).check()
    assert plan.names == ["off (budget 4096)", "on, budget 256", "on, budget 1024",
                          "on, budget 256, threshold 128"]
    assert dict(plan.baseline.flags) == cp.arm_flags(False, None, 4096)
    pair = ("enable_chunked_prefill", "max_num_batched_tokens")
    assert [a.knob for a in plan.arms[1:3]] == [pair, pair]
    assert {plan.reference_of(a).name for a in plan.arms[1:3]} == {"off (budget 4096)"}
    capped = plan.arm("on, budget 256, threshold 128")
    assert plan.reference_of(capped).name == "on, budget 256"
    assert capped.knob == "long_prefill_token_threshold"
    # at max_model_len itself only chunking changes
    same = cp.plan(cpu, {"budgets": [4096], "long_prefill_threshold": 0}).check()
    assert same.arms[1].knob == "enable_chunked_prefill"
    # a remote server tells neither chunking nor budget: the server as it runs, alone
    remote = load_profile("remote", base_url="http://127.0.0.1:9")
    assert cp.plan(remote, {"budgets": [256]}).check().names == ["server"]


def test_a_remote_plan_with_a_mapped_arm_is_the_sweep_without_the_step_log(monkeypatch):
    # its log is out of reach: no step-log flag there
    monkeypatch.setenv("LAB_REMOTE_ARMS", '{"enable_chunked_prefill=False": "http://h:1"}')
    remote = cp.plan(load_profile("remote", base_url="http://127.0.0.1:9"), {"budgets": [256]})
    assert remote.check().baseline.flags == {"enable_chunked_prefill": False}
    assert remote.names == ["off", "on, budget 256"]


def _headline_table():
    """Off and on at 256 (the pair the findings compare), and a larger budget."""
    cols = dict(long_prefill_token_threshold=0, short_ttft_ms_p99=900.0,
                blocked_short_ttft_ms_median=800.0, long_ttft_ms_median=2000.0,
                stall_itl_ms_max=1800.0, max_prefill_tokens_per_step=1600,
                max_step_ms=1700.0, server_ttft_ms_p99=950.0, server_itl_ms_p99=1500.0,
                prefill_steps=3, server_prefill_ms_mean=1900.0, tokens_per_busy_s=400.0,
                engine_steps=120, output_tok_s=20.0, waiting_max=3.0, waiting_mean=0.5)
    return pd.DataFrame([
        {"arm": "off (budget 4096)", "chunked_prefill": False, "max_num_batched_tokens": 4096,
         **cols},
        {"arm": "on, budget 256", "chunked_prefill": True, "max_num_batched_tokens": 256,
         **cols, "short_ttft_ms_p99": 600.0, "blocked_short_ttft_ms_median": 700.0,
         "long_ttft_ms_median": 2200.0, "stall_itl_ms_max": 300.0,
         "max_prefill_tokens_per_step": 256, "max_step_ms": 310.0, "server_ttft_ms_p99": 650.0,
         "server_itl_ms_p99": 250.0, "prefill_steps": 21, "server_prefill_ms_mean": 2100.0,
         "tokens_per_busy_s": 380.0, "engine_steps": 150, "output_tok_s": 19.5,
         "waiting_max": 1.0, "waiting_mean": 0.25},
        {"arm": "on, budget 1024", "chunked_prefill": True, "max_num_batched_tokens": 1024,
         **cols, "short_ttft_ms_p99": 1.0}]).set_index("arm")


def test_findings_compare_off_with_the_smallest_budget(tmp_path):
    from lab_utils.results import Results
    found = cp.findings(_headline_table())
    assert [(f["baseline"], f["treated"]) for f in found] == [
        (900.0, 600.0), (1800.0, 300.0), (2000.0, 2200.0), (400.0, 380.0)]
    assert found[0]["metric"] == "short-request TTFT p99 (ms), off -> on, budget 256"
    assert found[0]["checklist"] == "chunked prefill:ttft"
    assert [f.get("checklist") for f in found[1:]] == [None, None, None]
    assert found[0]["mechanism"].startswith(
        "largest prefill per engine step 1600 -> 256 tokens, longest step 1700 -> 310 ms")
    assert "median TTFT 800 -> 700 ms" in found[0]["mechanism"]
    assert "vllm:num_requests_waiting max 3 -> 1 (mean 0.50 -> 0.25" in found[0]["mechanism"]
    assert "at most 3 → 1 requests, 0.50 → 0.25 on average" in cp.this_run(
        *cp.headline_rows(_headline_table()), "on, budget 256")
    assert "vllm:inter_token_latency_seconds p99 1500 -> 250 ms" in found[1]["mechanism"]
    assert found[2]["mechanism"].startswith("prefill steps 3 -> 21")
    assert found[3]["mechanism"].startswith("engine steps 120 -> 150; output 20.0 -> 19.5")
    table = Results("01_chunked_prefill", tmp_path).add_findings(found)
    assert table.change_pct.tolist() == pytest.approx([-100 / 3, -250 / 3, 10.0, -5.0])
    assert cp.arm_notes(_headline_table())[1] == (
        "on, budget 256: stall max ITL 300 ms, short TTFT p99 600 ms, long TTFT 2200 ms")


def test_unavailable_arms_are_skipped_with_a_note(tmp_path, remote, monkeypatch):
    """On a default server (no /server_info) with one arm mapped elsewhere:
    the mapped arm could run, the chunked one cannot be placed (its knobs are
    not readable) and is skipped; nothing is compared, and nothing raises."""
    from lab_utils.notebook import setup
    monkeypatch.setenv("LAB_REMOTE_ARMS", '{"enable_chunked_prefill=False": "http://127.0.0.1:9"}')
    ctx = setup("01_chunked_prefill", {"profile": "remote", "base_url": remote.base_url,
                                       "results_dir": str(tmp_path), "budgets": [256]},
                plan=cp.plan)
    results = ctx.results
    table, runs = cp.chunked_prefill_sweep(ctx, ["on, budget 256"])
    assert table.empty and runs == {}
    assert "short_ttft_ms_p99" in table.columns  # the notebook's later cells still index it
    assert cp.headline_arms(table) == (None, None)
    with pytest.raises(RuntimeError, match="off=None"):
        cp.headline_rows(table)
    assert cp.findings(table) == []
    assert "nothing to compare" in cp.run_summary(table)
    assert "does not tell its own enable_chunked_prefill" in results.data["skipped_arms"][
        "on, budget 256"]
    assert results.data["remote_arms"]["off"]["notes"] == ["mapped in LAB_REMOTE_ARMS"]
    assert cp.explore_arm(ctx, 512).empty      # outside the plan: not served either


def test_vllm_source_reads_the_installed_files():
    text = cp.vllm_source("config/scheduler.py", "def verify_max_model_len", 6)
    assert text.startswith("# vllm ") and "vllm/config/scheduler.py\n" in text and "max_num_batched_tokens" in text
    assert "no line containing" in cp.vllm_source("config/scheduler.py", "no such line here")


# --------------------------------------------------------------------------
# The load, placed from measured capacity
# --------------------------------------------------------------------------

def _capacity(max_rate, sync_e2e_s=0.5):
    from lab_utils.capacity import Capacity
    return Capacity(sync_e2e_s=sync_e2e_s, max_rate=max_rate, concurrency=8, requests=16,
                    seconds=10.0, workload="short", engine="off")


def test_load_scales_with_the_engine_so_the_queue_is_the_same():
    """A machine half as fast gets half the short rate and long prompts twice
    as far apart: the same requests per long-prompt gap, the same share of
    capacity."""
    fast = cp.place_load(_capacity(6.0), 2.0, short_load=0.25, long_requests=3, long_spacing=2.0)
    slow = cp.place_load(_capacity(3.0), 4.0, short_load=0.25, long_requests=3, long_spacing=2.0)
    assert fast.short_rate == 1.5 and slow.short_rate == 0.75      # 0.25 x 6, 0.25 x 3
    assert fast.long_at == (2.0, 6.0, 10.0)                        # 4 s gaps, half a gap in
    assert slow.long_at == (4.0, 12.0, 20.0)
    assert fast.n_short == slow.n_short == 15                      # 1.5 x 10 = 0.75 x 20
    assert fast.short_share == pytest.approx(0.25) == slow.short_share
    assert "1.5 req/s = 0.25 x the 6 req/s" in fast.describe()
    assert "every 4.00 s; one alone took 2.00 s" in fast.describe()
    assert fast.workload() == {"n_short": 15, "short_rate": 1.5, "long_at": [2.0, 6.0, 10.0]}


def test_explicit_load_needs_no_measurement():
    load = cp.place_load(None, None, short_load=0.25, long_requests=3, long_spacing=2.0,
                         short_rate=1.5, long_at=[1.5, 6.0], n_short=12)
    assert (load.short_rate, load.long_at, load.n_short) == (1.5, (1.5, 6.0), 12)
    assert load.short_share is None
    assert cp.place_load(None, None, short_load=0, long_requests=0, long_spacing=0,
                         short_rate=2.0).n_short == 4                # no longs: the minimum
    with pytest.raises(ValueError, match="short_rate > 0"):
        cp.place_load(None, 2.0, short_load=0.25, long_requests=3, long_spacing=2.0)
    with pytest.raises(ValueError, match="long_at"):
        cp.place_load(_capacity(6.0), None, short_load=0.25, long_requests=3, long_spacing=2.0)
