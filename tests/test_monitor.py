"""The article's latency-breakdown monitor and its alerts."""
import math

import pytest

from lab_utils.client import RequestRecord
from lab_utils.monitor import LatencyMonitor


def _records():
    return [
        # fine: TTFT 100 ms, TPOT (0.5 - 0.1) / 9 = 44.4 ms
        RequestRecord(0, "short", label="arm", ttft=0.1, e2e=0.5, output_tokens=10, ok=True),
        # slow first token: TTFT 2.5 s
        RequestRecord(1, "long", label="arm", ttft=2.5, e2e=2.9, output_tokens=10, ok=True),
        # slow decode: TPOT (1.1 - 0.1) / 10 = 100 ms
        RequestRecord(2, "short", label="arm", ttft=0.1, e2e=1.1, output_tokens=11, ok=True),
        # one token: the article's max(n - 1, 1) divides by 1 -> (0.3 - 0.3) / 1 = 0 ms
        RequestRecord(3, "short", label="arm", ttft=0.3, e2e=0.3, output_tokens=1, ok=True),
        # both alerts
        RequestRecord(4, "long", label="arm", ttft=3.0, e2e=4.0, output_tokens=5, ok=True),
        # failed
        RequestRecord(5, "short", label="arm", ok=False, status=500,
                      error="HTTP 500: " + "x" * 200),
    ]


def test_breakdown_columns_and_values():
    frame = LatencyMonitor().breakdown(_records())
    assert list(frame.columns) == ["index", "label", "tag", "ttft_ms", "tpot_ms", "total_ms",
                                   "output_tokens", "alert"]
    assert len(frame) == 6
    row = frame.iloc[0]
    assert row["ttft_ms"] == pytest.approx(100.0)
    assert row["tpot_ms"] == pytest.approx(400.0 / 9)
    assert row["total_ms"] == pytest.approx(500.0)
    assert row["output_tokens"] == 10
    assert row["alert"] == ""
    assert frame.iloc[2]["tpot_ms"] == pytest.approx(100.0)


def test_breakdown_alert_texts():
    alerts = list(LatencyMonitor().breakdown(_records())["alert"])
    assert alerts[1] == "TTFT 2500 ms > 2000 ms"
    assert alerts[2] == "TPOT 100.0 ms > 50 ms"
    assert alerts[4] == "TTFT 3000 ms > 2000 ms; TPOT 250.0 ms > 50 ms"
    assert alerts[5].startswith("request failed: HTTP 500: ")
    assert len(alerts[5]) == len("request failed: ") + 80      # error cut to 80 characters


def test_single_token_uses_max_n_minus_1_rule():
    frame = LatencyMonitor().breakdown(_records())
    row = frame.iloc[3]
    assert row["tpot_ms"] == 0.0 and row["alert"] == ""
    # with a gap, a single token divides by 1 (not 0), so it can alert on TPOT
    rec = RequestRecord(0, "", ttft=0.2, e2e=0.3, output_tokens=1, ok=True)
    row = LatencyMonitor().breakdown([rec]).iloc[0]
    assert row["tpot_ms"] == pytest.approx(100.0)
    assert "TPOT" in row["alert"]
    assert rec.tpot is None          # unlike vLLM's TPOT, which is undefined here


def test_missing_usage_falls_back_to_chunk_count():
    rec = RequestRecord(0, "", ttft=0.1, e2e=0.4, output_tokens=None, ok=True,
                        chunk_times=[0.1, 0.2, 0.3, 0.4])
    row = LatencyMonitor().breakdown([rec]).iloc[0]
    assert row["output_tokens"] == 4
    assert row["tpot_ms"] == pytest.approx(100.0)


def test_failed_row_has_no_times():
    row = LatencyMonitor().breakdown(_records()).iloc[5]
    for col in ("ttft_ms", "tpot_ms", "total_ms", "output_tokens"):
        assert row[col] is None or math.isnan(row[col])


def test_alert_counts():
    mon = LatencyMonitor()
    counts = mon.alert_counts(mon.breakdown(_records()))
    assert counts == {"requests": 6, "ttft_alerts": 2, "tpot_alerts": 2, "failed": 1,
                      "any_alert": 4}


def test_thresholds_are_strictly_greater():
    recs = [RequestRecord(0, "", ttft=2.0, e2e=2.5, output_tokens=11, ok=True)]  # TPOT 50 ms
    mon = LatencyMonitor()
    assert mon.alert_counts(mon.breakdown(recs))["any_alert"] == 0


def test_custom_thresholds():
    mon = LatencyMonitor(ttft_alert_s=0.05, tpot_alert_s=0.01)
    counts = mon.alert_counts(mon.breakdown(_records()))
    # every completed request but the single-token one (TPOT 0) breaks both
    assert counts["ttft_alerts"] == 5 and counts["tpot_alerts"] == 4
    alerts = mon.breakdown(_records())["alert"]
    assert alerts.iloc[0] == "TTFT 100 ms > 50 ms; TPOT 44.4 ms > 10 ms"


def test_empty_run():
    mon = LatencyMonitor()
    assert mon.alert_counts(mon.breakdown([]))["requests"] == 0
