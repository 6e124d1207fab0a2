"""The article's latency-breakdown monitor: per request TTFT, TPOT and total
time in ms, with an alert when TTFT > 2 s or TPOT > 50 ms.

The article computes `tpot = (total - ttft) / max(output_tokens - 1, 1)`; that
equals vLLM's TPOT whenever there are 2+ output tokens, and it gives 0 ms (not
"undefined") for a single token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyMonitor:
    ttft_alert_s: float = 2.0
    tpot_alert_s: float = 0.050

    def breakdown(self, records: Sequence):
        """One row per request: ttft_ms, tpot_ms, total_ms, output_tokens, alerts."""
        import pandas as pd
        rows = []
        for r in records:
            if not r.ok:
                rows.append({"index": r.index, "label": r.label, "tag": r.tag, "ttft_ms": None,
                             "tpot_ms": None, "total_ms": None, "output_tokens": None,
                             "alert": f"request failed: {r.error[:80]}"})
                continue
            n = r.output_tokens or len(r.chunk_times)
            tpot_s = (r.e2e - r.ttft) / max(n - 1, 1)
            alerts = []
            if r.ttft > self.ttft_alert_s:
                alerts.append(f"TTFT {r.ttft * 1e3:.0f} ms > {self.ttft_alert_s * 1e3:.0f} ms")
            if tpot_s > self.tpot_alert_s:
                alerts.append(f"TPOT {tpot_s * 1e3:.1f} ms > {self.tpot_alert_s * 1e3:.0f} ms")
            rows.append({"index": r.index, "label": r.label, "tag": r.tag,
                         "ttft_ms": r.ttft * 1e3, "tpot_ms": tpot_s * 1e3,
                         "total_ms": r.e2e * 1e3, "output_tokens": n,
                         "alert": "; ".join(alerts)})
        return pd.DataFrame(rows, columns=["index", "label", "tag", "ttft_ms", "tpot_ms",
                                           "total_ms", "output_tokens", "alert"])

    def alert_counts(self, breakdown) -> dict[str, int]:
        alerts = breakdown["alert"].fillna("")
        return {"requests": len(breakdown),
                "ttft_alerts": int(alerts.str.contains("TTFT").sum()),
                "tpot_alerts": int(alerts.str.contains("TPOT").sum()),
                "failed": int(alerts.str.startswith("request failed").sum()),
                "any_alert": int((alerts != "").sum())}
