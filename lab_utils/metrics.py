"""Latency metrics with `vllm bench serve`'s definitions, and their summaries.

- TTFT: send -> first streamed chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), only for requests with > 1 token.
- ITL: gaps between consecutive chunks, pooled over all requests. A chunk
  may carry several tokens (speculative decoding emits 1 to k+1 per step):
  `token_chunks`, `chunk_frame` and `token_gaps_ms` split each gap over the
  tokens it carried, so per-token latency is comparable with TPOT.
- E2E: send -> last token chunk.
- Goodput: requests/s that met every SLO (TTFT, TPOT, E2E); a request with
  one output token counts TPOT as 0, as vLLM does.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
#: The article's alert thresholds, used as the default SLOs.
DEFAULT_TTFT_SLO_S = 2.0
DEFAULT_TPOT_SLO_S = 0.050


def tpot(e2e: float | None, ttft: float | None, output_tokens: int | None) -> float | None:
    """Time per output token after the first, or None when it is undefined."""
    if e2e is None or ttft is None or not output_tokens or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def percentile(values: Iterable[float | None], q: float) -> float:
    """numpy's linear percentile `q` of the values that are not None (NaN
    when there are none, so a table row of an arm without such requests
    still has the column)."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return float(np.percentile(arr, q)) if arr.size else math.nan


def ms(seconds: float | None) -> float:
    """Seconds as milliseconds; None (not measured) as NaN."""
    return seconds * 1e3 if seconds is not None else math.nan


def percentile_stats(values: Iterable[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, std, median, p90, p99 (numpy's linear percentiles), scaled (s -> ms)."""
    arr = np.asarray([v for v in values if v is not None], dtype=float) * scale
    if arr.size == 0:
        return {"mean": math.nan, "std": math.nan, "median": math.nan,
                **{f"p{p}": math.nan for p in PERCENTILES[1:]}}
    out = {"mean": float(arr.mean()), "std": float(arr.std()), "median": float(np.median(arr))}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES[1:]})
    return out


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = DEFAULT_TTFT_SLO_S
    tpot_s: float | None = DEFAULT_TPOT_SLO_S
    e2e_s: float | None = None

    def met(self, rec) -> bool:
        if not rec.ok:
            return False
        t = rec.tpot if rec.tpot is not None else 0.0
        return all([self.ttft_s is None or rec.ttft <= self.ttft_s,
                    self.tpot_s is None or t <= self.tpot_s,
                    self.e2e_s is None or rec.e2e <= self.e2e_s])


def summarize(records: Sequence, duration_s: float, slo: SLO | None = None) -> dict[str, Any]:
    """Flat summary of a run: `<metric>_ms_<stat>` for ttft/tpot/itl/e2e, counts,
    throughput (req/s, output tok/s) and goodput against `slo`."""
    slo = slo or SLO()
    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {"requests": len(records), "completed": len(ok),
                           "failed": len(records) - len(ok), "duration_s": duration_s}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok],
              "itl": [g for r in ok for g in r.itl], "e2e": [r.e2e for r in ok]}
    for name, values in series.items():
        for stat, value in percentile_stats(values).items():
            out[f"{name}_ms_{stat}"] = value
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    out["input_tokens"] = sum(r.prompt_tokens or 0 for r in ok)
    out["output_tokens"] = out_tokens
    out["request_throughput"] = len(ok) / duration_s if duration_s > 0 else math.nan
    out["output_throughput"] = out_tokens / duration_s if duration_s > 0 else math.nan
    good = sum(1 for r in ok if slo.met(r))
    out["goodput"] = good / duration_s if duration_s > 0 else math.nan
    out["slo_met_fraction"] = good / len(records) if records else math.nan
    return out


def records_frame(records: Sequence):
    """One row per request, times in ms, ready for seaborn."""
    import pandas as pd
    rows = []
    for r in records:
        rows.append({"index": r.index, "label": r.label, "tag": r.tag, "ok": r.ok,
                     "error": r.error, "send_time": r.send_time, "start": r.start,
                     "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                     "cached_tokens": r.cached_tokens,
                     "ttft_ms": r.ttft * 1e3 if r.ttft is not None else math.nan,
                     "tpot_ms": r.tpot * 1e3 if r.tpot is not None else math.nan,
                     "e2e_ms": r.e2e * 1e3 if r.e2e is not None else math.nan,
                     "itl_ms_max": max(r.itl) * 1e3 if r.itl else math.nan,
                     "route": getattr(r, "route", "")})
    return pd.DataFrame(rows)


def token_chunks(record) -> list[tuple[float, int]]:
    """(arrival since send in s, tokens it carried) for every streamed chunk
    that carried output tokens, from the cumulative counts in `chunk_tokens`.

    The chat API's first chunk (the assistant role) and the last one (the
    finish reason) carry no token and are left out."""
    out, prev = [], 0
    for t, n in zip(record.chunk_times, record.chunk_tokens):
        if n is not None and n > prev:
            out.append((float(t), int(n - prev)))
            prev = n
    return out


def chunk_frame(records: Iterable, **columns: Any):
    """One row per token-carrying chunk after a request's first: `gap_ms` since
    the previous token chunk (vLLM bench's ITL), `tokens` it carried and
    `per_token_ms` = gap / tokens (the chunk's share of TPOT); `columns` are
    added to every row. A DataFrame (empty, with those columns, for none)."""
    import pandas as pd
    rows = []
    for r in records:
        if not r.ok:
            continue
        chunks = token_chunks(r)
        for i in range(1, len(chunks)):
            gap = (chunks[i][0] - chunks[i - 1][0]) * 1e3
            rows.append({"label": r.label, "index": r.index, "chunk": i, "gap_ms": gap,
                         "tokens": chunks[i][1], "per_token_ms": gap / chunks[i][1], **columns})
    cols = ["label", "index", "chunk", "gap_ms", "tokens", "per_token_ms", *columns]
    return pd.DataFrame(rows, columns=cols)


def token_gaps_ms(chunks) -> np.ndarray:
    """Per-token latencies: each chunk's gap split evenly over the tokens it
    carried, one value per token (so its median is comparable with TPOT)."""
    if chunks.empty:
        return np.array([])
    return np.repeat(chunks["per_token_ms"].to_numpy(float), chunks["tokens"].to_numpy(int))


def change_pct(baseline: float, treated: float) -> float:
    """Relative change of treated vs baseline in percent (negative = lower)."""
    if baseline is None or treated is None or not baseline or math.isnan(baseline):
        return math.nan
    return (treated - baseline) / baseline * 100.0


def bootstrap_change_pct(baseline: Sequence[float], treated: Sequence[float], *,
                         stat: str = "median", n_boot: int = 2000, seed: int = 0,
                         level: float = 0.95) -> tuple[float, float]:
    """Bootstrap interval of the % change of `stat` (median, mean, p90, p99)
    from baseline to treated samples (resampling each arm independently)."""
    b = np.asarray([v for v in baseline if v is not None and np.isfinite(v)], dtype=float)
    t = np.asarray([v for v in treated if v is not None and np.isfinite(v)], dtype=float)
    if b.size < 2 or t.size < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    q = {"median": 50.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}.get(stat)
    bi = rng.integers(0, b.size, size=(n_boot, b.size))
    ti = rng.integers(0, t.size, size=(n_boot, t.size))
    if stat == "mean":
        bs, ts = b[bi].mean(axis=1), t[ti].mean(axis=1)
    elif q is not None:
        bs, ts = np.percentile(b[bi], q, axis=1), np.percentile(t[ti], q, axis=1)
    else:
        raise ValueError(f"stat must be median, mean, p50, p90 or p99, got {stat!r}")
    with np.errstate(divide="ignore", invalid="ignore"):
        change = (ts - bs) / bs * 100.0
    change = change[np.isfinite(change)]
    alpha = (1 - level) / 2 * 100
    return (float(np.percentile(change, alpha)), float(np.percentile(change, 100 - alpha)))


# --------------------------------------------------------------------------
# Interference: what one class of requests does to another
# --------------------------------------------------------------------------

def streaming_when_sent(records: Sequence, victim: str = "short",
                        intruder: str = "long") -> list:
    """The `victim` requests that had their first token but not their last
    when some `intruder` request was sent (all `start`s of one run share one
    clock): the streams an arriving long prompt can freeze."""
    sent = [r.start for r in records if r.tag == intruder]
    out = []
    for r in records:
        if r.tag != victim or not r.ok or r.ttft is None or r.e2e is None:
            continue
        first, last = r.start + r.ttft, r.start + r.e2e
        if any(first <= t < last for t in sent):
            out.append(r)
    return out


def decode_stall(records: Sequence, victim: str = "short",
                 intruder: str = "long") -> dict[str, float]:
    """Inter-token gaps (ms) of the requests `streaming_when_sent`: their max
    and p99 (pooled), how many there were, and their median E2E (an intruder
    whose work is spread over their stream instead of freezing it still
    lengthens them)."""
    hit = streaming_when_sent(records, victim, intruder)
    gaps = np.array([g for r in hit for g in r.itl], dtype=float) * 1e3
    e2e = [r.e2e * 1e3 for r in hit]
    e2e_median = float(np.median(e2e)) if e2e else math.nan
    if gaps.size == 0:
        return {"stalled_requests": len(hit), "stall_itl_ms_max": math.nan,
                "stall_itl_ms_p99": math.nan, "stalled_e2e_ms_median": e2e_median}
    return {"stalled_requests": len(hit), "stall_itl_ms_max": float(gaps.max()),
            "stall_itl_ms_p99": float(np.percentile(gaps, 99)),
            "stalled_e2e_ms_median": e2e_median}


def arrived_while_waiting(records: Sequence, victim: str = "short",
                          intruder: str = "long") -> list:
    """The `victim` requests sent while some `intruder` request was waiting
    for its first token (its prompt queued or being prefilled)."""
    windows = [(r.start, r.start + r.ttft) for r in records
               if r.tag == intruder and r.ok and r.ttft is not None]
    return [r for r in records if r.tag == victim and r.ok
            and any(lo <= r.start < hi for lo, hi in windows)]
