"""vLLM's own Prometheus counters, scraped before and after a run.

The deltas confirm the mechanism behind a latency change: prefix-cache hits,
accepted draft tokens, preemptions, KV-cache usage, and the server's own TTFT
histogram (to compare with the client's view).
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Self

from prometheus_client.parser import text_string_to_metric_families

from .errors import ServerError
from .http import http_get

#: Counter families (summed over engines/labels); names without `_total`.
COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "preemptions": "vllm:num_preemptions",
    "requests_success": "vllm:request_success",
    "spec_decode_drafts": "vllm:spec_decode_num_drafts",
    "spec_decode_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_decode_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
GAUGES = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "requests_running": "vllm:num_requests_running",
    "requests_waiting": "vllm:num_requests_waiting",
}
HISTOGRAMS = {
    "server_ttft_s": "vllm:time_to_first_token_seconds",
    "server_itl_s": "vllm:inter_token_latency_seconds",
    "server_queue_s": "vllm:request_queue_time_seconds",
    "server_prefill_s": "vllm:request_prefill_time_seconds",
    "server_e2e_s": "vllm:e2e_request_latency_seconds",
}


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count
    count: float = 0.0
    sum: float = 0.0

    def __sub__(self, other: Histogram) -> Histogram:
        return Histogram({le: c - other.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.count - other.count, self.sum - other.sum)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Prometheus-style histogram_quantile (linear within the bucket)."""
        if not self.count:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in sorted(self.buckets.items()):
            if c >= rank:
                if le == float("inf"):
                    return prev_le
                width = c - prev_c
                return prev_le + (le - prev_le) * ((rank - prev_c) / width if width else 0.0)
            prev_le, prev_c = le, c
        return prev_le


@dataclass
class Snapshot:
    counters: dict[str, float]
    gauges: dict[str, float]
    histograms: dict[str, Histogram]


def parse_metrics(text: str) -> Snapshot:
    """Parse Prometheus exposition text (vLLM's /metrics) into a Snapshot."""
    by_family: dict[str, Any] = {fam.name: fam for fam in text_string_to_metric_families(text)}
    counters = {}
    for key, name in COUNTERS.items():
        fam = by_family.get(name)
        counters[key] = sum(s.value for s in fam.samples if s.name.endswith("_total")) if fam else 0.0
    gauges = {}
    for key, name in GAUGES.items():
        fam = by_family.get(name)
        values = [s.value for s in fam.samples] if fam else []
        # Counts add up over engines; a usage ratio does not (the fullest engine matters).
        gauges[key] = max(values, default=0.0) if key == "kv_cache_usage" else sum(values)
    histograms = {}
    for key, name in HISTOGRAMS.items():
        fam = by_family.get(name)
        h = Histogram()
        for s in (fam.samples if fam else []):
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                h.buckets[le] = h.buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_count"):
                h.count += s.value
            elif s.name.endswith("_sum"):
                h.sum += s.value
        histograms[key] = h
    return Snapshot(counters, gauges, histograms)


def scrape_text(base_url: str, api_key: str | None = None, timeout: float = 10) -> str:
    status, body = http_get(base_url.rstrip("/") + "/metrics", timeout=timeout, api_key=api_key)
    if status != 200:
        raise ServerError(f"{base_url}/metrics answered HTTP {status}")
    return body.decode()


def scrape(base_url: str, api_key: str | None = None) -> Snapshot:
    return parse_metrics(scrape_text(base_url, api_key))


def scrape_families(base_url: str, api_key: str | None = None) -> list:
    return list(text_string_to_metric_families(scrape_text(base_url, api_key)))


def cache_config(base_url: str, api_key: str | None = None) -> dict[str, str]:
    """vLLM's `cache_config_info` labels (KV capacity, block size, prefix
    caching); {} when the server does not export them or cannot be read."""
    with contextlib.suppress(Exception):
        return cache_config_labels(scrape_families(base_url, api_key=api_key))
    return {}


def cache_config_labels(families) -> dict[str, str]:
    """The `vllm:cache_config_info` labels among scraped metric families ({} if none)."""
    for fam in families:
        if fam.name == "vllm:cache_config_info" and fam.samples:
            return dict(fam.samples[0].labels)
    return {}


def counter_by_label(text: str, family: str, label: str) -> dict[str, float]:
    """One counter family of /metrics exposition text (`family` without
    `_total`, e.g. "vllm:request_success"), summed per value of `label` (over
    engines and other labels); samples without that label are left out."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_total") and label in s.labels:
                    out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def block_size_of(engine, default: int | None = None) -> int | None:
    """The engine's KV block size from vLLM's `cache_config_info` labels
    (`engine.info["cache_config"]`, read when the engine started), else `default`."""
    value = (getattr(engine, "info", None) or {}).get("cache_config", {}).get("block_size")
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def prefix_caching_of(engine) -> bool | None:
    """Whether the server runs with prefix caching, as it reports it itself
    (`cache_config_info`), else as its flags say; None when neither tells.
    A remote arm's emulated setting wins (lab_utils.remote: "off" emulated by
    a fresh `cache_salt` per request cannot hit)."""
    emulated = getattr(getattr(engine, "emulation", None), "sets", {})
    if "enable_prefix_caching" in emulated:
        return bool(emulated["enable_prefix_caching"])
    value = (getattr(engine, "info", None) or {}).get("cache_config", {}) \
        .get("enable_prefix_caching")
    if value is None:
        flag = getattr(engine, "flags", {}).get("enable_prefix_caching")
        return None if flag is None else bool(flag)
    return str(value).lower() == "true"


def kv_capacity_of(engine) -> dict[str, Any]:
    """The engine's KV cache as vLLM reports it (`cache_config_info` labels in
    `engine.info["cache_config"]`): its dtype, byte budget, blocks, block
    size, tokens and maximum concurrency (NaN for what it does not report)."""
    cc = (getattr(engine, "info", None) or {}).get("cache_config", {}) or {}

    def num(key: str) -> float:
        try:
            return float(cc[key])
        except (KeyError, TypeError, ValueError):
            return math.nan

    return {"cache_dtype": cc.get("cache_dtype", "?"),
            "kv_cache_memory_bytes": num("kv_cache_memory_bytes"),
            "num_blocks": num("num_gpu_blocks"), "block_size": num("block_size"),
            "kv_cache_size_tokens": num("kv_cache_size_tokens"),
            "kv_cache_max_concurrency": num("kv_cache_max_concurrency")}


def delta(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    """What happened between two snapshots, with the derived ratios notebooks cite."""
    d: dict[str, float | None] = {k: after.counters[k] - before.counters[k] for k in COUNTERS}
    q, h = d["prefix_cache_queries"], d["prefix_cache_hits"]
    d["prefix_cache_hit_rate"] = h / q if q else None
    drafts, dt, acc = (d["spec_decode_drafts"], d["spec_decode_draft_tokens"],
                       d["spec_decode_accepted_tokens"])
    d["spec_decode_acceptance_rate"] = acc / dt if dt else None
    # Tokens per verification step: the accepted drafts plus the one token the
    # target model always produces (vLLM's "mean acceptance length").
    d["spec_decode_mean_accepted_length"] = 1 + acc / drafts if drafts else None
    d["kv_cache_usage_after"] = after.gauges["kv_cache_usage"]
    for key in HISTOGRAMS:
        hist = after.histograms[key] - before.histograms[key]
        d[f"{key}_count"] = hist.count
        d[f"{key}_mean"] = hist.mean
        d[f"{key}_p50"] = hist.quantile(0.5)
        d[f"{key}_p99"] = hist.quantile(0.99)
    return d


#: The columns of `GaugeSampler.frame()`.
GAUGE_COLUMNS = ["t_s", "requests_running", "requests_waiting", "kv_cache_usage", "preemptions"]


class GaugeSampler:
    """vLLM's queue gauges (`vllm:num_requests_running`, `..._waiting`,
    `vllm:kv_cache_usage_perc`) and the cumulative preemption counter, scraped
    from `/metrics` every `interval_s` in a background thread while a run
    goes on (use as a context manager; `t_s` counts from entering it).

    A thread, not a task: the sampler keeps its pace while the run's own
    event loop is busy. A scrape that fails is a missing sample, not an error.
    """

    def __init__(self, engine, interval_s: float = 0.5):
        self.base_url, self.api_key = engine.base_url, getattr(engine, "api_key", None)
        self.interval_s = float(interval_s)
        self.rows: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="gauge-sampler")
        self.t0 = time.perf_counter()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                snap = parse_metrics(scrape_text(self.base_url, self.api_key, timeout=5))
                self.rows.append({"t_s": time.perf_counter() - self.t0, **snap.gauges,
                                  "preemptions": snap.counters["preemptions"]})
            except (OSError, ServerError, ValueError):
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Self:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def frame(self):
        import pandas as pd
        return pd.DataFrame(self.rows, columns=GAUGE_COLUMNS)

    def summary(self) -> dict[str, float | int | None]:
        """Queue depth over the run: most and mean waiting, most running, samples."""
        rows = self.rows
        if not rows:
            return {"samples": 0, "waiting_max": None, "waiting_mean": None,
                    "running_max": None}
        waiting = [r["requests_waiting"] for r in rows]
        return {"samples": len(rows), "waiting_max": max(waiting),
                "waiting_mean": sum(waiting) / len(waiting),
                "running_max": max(r["requests_running"] for r in rows)}

