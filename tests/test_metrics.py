"""Latency metrics with `vllm bench serve`'s definitions, checked against
numbers worked out by hand."""
import math

import pytest
from stand_ins import INTERFERENCE_RECORDS as RECORDS
from stand_ins import timed_record

from lab_utils import metrics as m
from lab_utils.client import RequestRecord, Run
from lab_utils.metrics import (
    SLO,
    change_pct,
    chunk_frame,
    percentile_stats,
    records_frame,
    summarize,
    token_chunks,
    token_gaps_ms,
    tpot,
)

# --------------------------------------------------------------------------
# tpot
# --------------------------------------------------------------------------

def test_tpot_excludes_the_first_token():
    # (1.0 - 0.2) / (5 - 1)
    assert tpot(1.0, 0.2, 5) == pytest.approx(0.2)
    assert tpot(0.5, 0.1, 2) == pytest.approx(0.4)


@pytest.mark.parametrize("tokens", [1, 0, None])
def test_tpot_is_undefined_below_two_tokens(tokens):
    assert tpot(1.0, 0.2, tokens) is None


@pytest.mark.parametrize("e2e, ttft", [(None, 0.2), (1.0, None), (None, None)])
def test_tpot_of_missing_times_is_none(e2e, ttft):
    assert tpot(e2e, ttft, 5) is None


def test_record_tpot_property_uses_the_same_rule():
    rec = RequestRecord(0, "t", ttft=0.2, e2e=1.0, output_tokens=5, ok=True)
    assert rec.tpot == pytest.approx(0.2)
    assert RequestRecord(0, "t", ttft=0.2, e2e=0.2, output_tokens=1, ok=True).tpot is None


# --------------------------------------------------------------------------
# percentile_stats
# --------------------------------------------------------------------------

def test_percentile_stats_hand_computed():
    # seconds -> ms: [100, 200, 300, 400, 1000]
    stats = percentile_stats([0.1, 0.2, 0.3, 0.4, 1.0])
    assert set(stats) == {"mean", "std", "median", "p90", "p99"}
    assert stats["mean"] == pytest.approx(400.0)
    # population std: sqrt((300² + 200² + 100² + 0² + 600²) / 5) = sqrt(100000)
    assert stats["std"] == pytest.approx(math.sqrt(100_000))
    assert stats["median"] == pytest.approx(300.0)
    # numpy "linear": rank = p/100 * (n - 1); 3.6 -> 400 + 0.6 * 600, 3.96 -> 400 + 0.96 * 600
    assert stats["p90"] == pytest.approx(760.0)
    assert stats["p99"] == pytest.approx(976.0)


def test_percentile_stats_even_count_median_and_none_skipped():
    stats = percentile_stats([0.004, None, 0.001, 0.003, 0.002])
    assert stats["median"] == pytest.approx(2.5)   # (2 + 3) / 2 ms
    assert stats["mean"] == pytest.approx(2.5)
    # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * 1
    assert stats["p90"] == pytest.approx(3.7)


def test_percentile_stats_scale():
    assert percentile_stats([1.0, 3.0], scale=1.0)["median"] == pytest.approx(2.0)
    assert percentile_stats([1.0, 3.0])["median"] == pytest.approx(2000.0)
    assert percentile_stats([0.5], scale=1e6)["p99"] == pytest.approx(500_000.0)


@pytest.mark.parametrize("values", [[], [None, None], iter(())])
def test_percentile_stats_empty_is_nan(values):
    stats = percentile_stats(values)
    assert set(stats) == {"mean", "std", "median", "p90", "p99"}
    assert all(math.isnan(v) for v in stats.values())


# --------------------------------------------------------------------------
# summarize
# --------------------------------------------------------------------------

def _records():
    return [
        # 5 tokens: TPOT = (0.5 - 0.1) / 4 = 0.1 s
        RequestRecord(0, "a", ttft=0.1, e2e=0.5, itl=[0.1, 0.1, 0.2], output_tokens=5,
                      prompt_tokens=10, ok=True, status=200),
        # 1 token: TPOT undefined (excluded from TPOT stats, counts as 0 for goodput)
        RequestRecord(1, "a", ttft=0.3, e2e=0.3, itl=[], output_tokens=1,
                      prompt_tokens=20, ok=True, status=200),
        # 4 tokens: TPOT = (0.26 - 0.2) / 3 = 0.02 s
        RequestRecord(2, "b", ttft=0.2, e2e=0.26, itl=[0.02, 0.02, 0.02], output_tokens=4,
                      prompt_tokens=30, ok=True, status=200),
        # failed: ignored by every latency statistic
        RequestRecord(3, "b", ttft=0.01, e2e=0.02, itl=[5.0], output_tokens=99,
                      prompt_tokens=1000, ok=False, status=500, error="HTTP 500: boom"),
    ]


def test_summarize_counts_and_medians():
    s = summarize(_records(), duration_s=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["duration_s"] == 2.0
    assert s["ttft_ms_median"] == pytest.approx(200.0)          # 100, 300, 200
    assert s["ttft_ms_mean"] == pytest.approx(200.0)
    assert s["tpot_ms_median"] == pytest.approx(60.0)           # 100, 20 (1-token skipped)
    assert s["tpot_ms_mean"] == pytest.approx(60.0)
    # ITL pooled over requests: 100, 100, 200, 20, 20, 20 -> sorted middle (20 + 100) / 2
    assert s["itl_ms_median"] == pytest.approx(60.0)
    assert s["itl_ms_mean"] == pytest.approx(460.0 / 6)
    assert s["itl_ms_p99"] < 200.0 + 1e-9 and s["itl_ms_p99"] > 100.0
    assert s["e2e_ms_median"] == pytest.approx(300.0)           # 500, 300, 260
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "std", "median", "p90", "p99"):
            assert f"{metric}_ms_{stat}" in s


def test_summarize_throughput_and_tokens():
    s = summarize(_records(), duration_s=2.0)
    assert s["input_tokens"] == 60                # failed request's 1000 not counted
    assert s["output_tokens"] == 10               # 5 + 1 + 4
    assert s["request_throughput"] == pytest.approx(3 / 2.0)
    assert s["output_throughput"] == pytest.approx(10 / 2.0)


def test_summarize_goodput_default_slo():
    # default SLO: TTFT <= 2 s, TPOT <= 50 ms. Request 0 (TPOT 100 ms) misses;
    # the 1-token request counts TPOT as 0 and meets it; the failed one never does.
    s = summarize(_records(), duration_s=2.0)
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["slo_met_fraction"] == pytest.approx(2 / 4)


@pytest.mark.parametrize("slo, good", [
    (SLO(ttft_s=0.25, tpot_s=None), 2),                 # 0.1 and 0.2 pass, 0.3 misses
    (SLO(ttft_s=None, tpot_s=None, e2e_s=0.3), 2),      # 0.3 and 0.26 pass
    (SLO(ttft_s=None, tpot_s=None, e2e_s=0.28), 1),
    (SLO(ttft_s=None, tpot_s=0.0), 1),                  # only the 1-token request (TPOT = 0)
    (SLO(ttft_s=None, tpot_s=0.1), 3),                  # <= is inclusive
    (SLO(ttft_s=None, tpot_s=None), 3),                 # no SLO: every completed request
    (SLO(ttft_s=0.05, tpot_s=None), 0),
])
def test_summarize_goodput_against_slo(slo, good):
    s = summarize(_records(), duration_s=4.0, slo=slo)
    assert s["goodput"] == pytest.approx(good / 4.0)
    assert s["slo_met_fraction"] == pytest.approx(good / 4)


def test_slo_met_single_token_rule_and_failures():
    one = RequestRecord(0, "", ttft=0.5, e2e=0.5, output_tokens=1, ok=True)
    assert one.tpot is None
    assert SLO(ttft_s=1.0, tpot_s=0.0).met(one)
    assert not SLO(ttft_s=0.4, tpot_s=None).met(one)
    failed = RequestRecord(1, "", ttft=0.01, e2e=0.01, output_tokens=3, ok=False, error="x")
    assert not SLO(ttft_s=None, tpot_s=None).met(failed)


def test_summarize_zero_duration_and_empty():
    s = summarize(_records(), duration_s=0.0)
    assert math.isnan(s["request_throughput"]) and math.isnan(s["output_throughput"])
    assert math.isnan(s["goodput"])
    e = summarize([], duration_s=1.0)
    assert (e["requests"], e["completed"], e["failed"]) == (0, 0, 0)
    assert math.isnan(e["ttft_ms_median"]) and math.isnan(e["itl_ms_p99"])
    assert e["request_throughput"] == 0.0
    assert math.isnan(e["slo_met_fraction"])


def test_summarize_all_failed():
    recs = [RequestRecord(i, "", ok=False, error="refused") for i in range(3)]
    s = summarize(recs, duration_s=1.0)
    assert (s["completed"], s["failed"]) == (0, 3)
    assert math.isnan(s["ttft_ms_median"])
    assert s["goodput"] == 0.0 and s["slo_met_fraction"] == 0.0


def test_run_summary_default_matches_summarize():
    run = Run("x", "sequential x1", _records(), 2.0)
    assert run.summary() == pytest.approx(summarize(_records(), 2.0), nan_ok=True)


def test_run_summary_with_slo():
    run = Run("x", "sequential x1", _records(), 2.0)
    slo = SLO(ttft_s=0.25, tpot_s=None)
    assert run.summary(slo)["goodput"] == summarize(_records(), 2.0, slo)["goodput"] == 1.0
    assert run.summary(slo=SLO(ttft_s=None, tpot_s=0.0))["goodput"] == 0.5


# --------------------------------------------------------------------------
# change_pct, records_frame
# --------------------------------------------------------------------------

@pytest.mark.parametrize("baseline, treated, expected", [
    (100.0, 80.0, -20.0),
    (50.0, 75.0, 50.0),
    (200.0, 200.0, 0.0),
    (-10.0, -5.0, -50.0),
])
def test_change_pct(baseline, treated, expected):
    assert change_pct(baseline, treated) == pytest.approx(expected)


@pytest.mark.parametrize("baseline, treated", [
    (0.0, 10.0), (None, 10.0), (10.0, None), (math.nan, 10.0), (0, 0)])
def test_change_pct_undefined(baseline, treated):
    assert math.isnan(change_pct(baseline, treated))


def test_change_pct_nan_treated_propagates():
    assert math.isnan(change_pct(10.0, math.nan))


def test_records_frame_columns_and_ms():
    frame = records_frame(_records())
    assert list(frame.columns) == [
        "index", "label", "tag", "ok", "error", "send_time", "start", "prompt_tokens",
        "output_tokens", "cached_tokens", "ttft_ms", "tpot_ms", "e2e_ms", "itl_ms_max", "route"]
    assert len(frame) == 4
    first = frame.iloc[0]
    assert first["ttft_ms"] == pytest.approx(100.0)
    assert first["tpot_ms"] == pytest.approx(100.0)
    assert first["e2e_ms"] == pytest.approx(500.0)
    assert first["itl_ms_max"] == pytest.approx(200.0)
    one = frame.iloc[1]
    assert math.isnan(one["tpot_ms"]) and math.isnan(one["itl_ms_max"])
    assert list(frame["ok"]) == [True, True, True, False]
    assert frame.iloc[3]["error"] == "HTTP 500: boom"


def test_records_frame_missing_times_are_nan():
    frame = records_frame([RequestRecord(7, "x", label="arm", ok=False, error="refused")])
    row = frame.iloc[0]
    assert row["index"] == 7 and row["label"] == "arm" and row["tag"] == "x"
    assert all(math.isnan(row[c]) for c in ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms_max"))


def test_records_frame_empty():
    assert len(records_frame([])) == 0


# --------------------------------------------------------------------------
# Chunks carrying several tokens
# --------------------------------------------------------------------------

def rec(times, tokens, index=0, label="a", ok=True):
    return RequestRecord(index=index, tag="t", label=label, chunk_times=list(times),
                         chunk_tokens=list(tokens), ok=ok)


def test_token_chunks_skip_the_role_and_finish_chunks():
    r = rec([0.10, 0.10, 0.20, 0.30, 0.30], [0, 1, 5, 6, 6])
    assert token_chunks(r) == [(0.10, 1), (0.20, 4), (0.30, 1)]


def test_chunk_frame_gaps_and_per_token_share():
    r = rec([0.1, 0.1, 0.2, 0.4], [0, 1, 5, 6])
    f = chunk_frame([r, rec([0.1], [1], ok=False)], arm="x")
    assert list(f.tokens) == [4, 1]
    assert f.gap_ms.round(6).tolist() == [100.0, 200.0]
    assert f.per_token_ms.round(6).tolist() == [25.0, 200.0]
    assert set(f.arm) == {"x"}
    assert token_gaps_ms(f).round(6).tolist() == [25.0] * 4 + [200.0]
    assert chunk_frame([]).empty and token_gaps_ms(chunk_frame([])).size == 0


def test_per_token_gaps_average_to_tpot():
    # TPOT = (E2E - TTFT) / (n - 1): the mean per-token gap over the chunks
    # after the first token equals it when the first chunk carries one token.
    r = rec([0.5, 0.6, 0.9, 1.0], [1, 4, 5, 9])
    r.ttft, r.e2e, r.output_tokens = 0.5, 1.0, 9
    gaps = token_gaps_ms(chunk_frame([r]))
    assert gaps.mean() == pytest.approx(r.tpot * 1e3)


# --------------------------------------------------------------------------
# Interference: decode stall and blocked arrivals (short requests, a long intruder)
# --------------------------------------------------------------------------

def test_streaming_when_sent_needs_first_token_before_and_last_after():
    hit = m.streaming_when_sent(RECORDS)
    assert [r.index for r in hit] == [1]


def test_decode_stall_is_the_max_and_p99_of_those_gaps():
    stall = m.decode_stall(RECORDS)
    assert stall["stalled_requests"] == 1
    assert stall["stall_itl_ms_max"] == pytest.approx(3000.0)
    assert 2900 < stall["stall_itl_ms_p99"] <= 3000.0
    assert stall["stalled_e2e_ms_median"] == pytest.approx(5000.0)


def test_decode_stall_without_streaming_requests_is_nan():
    stall = m.decode_stall([r for r in RECORDS if r.index != 1])
    assert stall["stalled_requests"] == 0 and math.isnan(stall["stall_itl_ms_max"])


def test_arrived_while_waiting():
    assert [r.index for r in m.arrived_while_waiting(RECORDS)] == [3]


def test_failed_requests_are_ignored():
    bad = [timed_record(1, "short", 1.0, None, None, ok=False), RECORDS[2]]
    assert m.streaming_when_sent(bad) == []
    assert m.arrived_while_waiting(bad) == []


def test_interference_of_other_tags():
    """The classes are parameters: 'batch' requests intruding on 'chat' ones."""
    renamed = [timed_record(r.index, {"short": "chat", "long": "batch"}[r.tag], r.start, r.ttft, r.e2e,
                   r.itl) for r in RECORDS]
    assert [r.index for r in m.streaming_when_sent(renamed, "chat", "batch")] == [1]
    assert m.streaming_when_sent(renamed) == []                # no "short"/"long" here



def test_percentile_skips_missing_values_and_is_nan_without_any():
    from lab_utils.metrics import ms, percentile
    assert percentile([1.0, None, 3.0], 50) == 2.0       # numpy's linear rule on [1, 3]
    assert percentile([10.0, 20.0, 30.0, 40.0], 25) == 17.5
    assert math.isnan(percentile([None], 50)) and math.isnan(percentile([], 99))
    assert ms(0.0125) == 12.5 and math.isnan(ms(None))
