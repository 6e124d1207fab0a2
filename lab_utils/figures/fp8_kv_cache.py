"""The figures of `06_fp8_kv_cache` (`lab_utils.experiments.fp8_kv_cache`):
latencies per KV dtype, the KV capacity in one byte budget against its
prediction, vLLM's queue gauges under memory pressure, and the prompt
log-probabilities of each fp8 arm against the baseline's."""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import pyplot, titled


def plot_latencies(frame: pd.DataFrame, title: str):
    """TTFT and TPOT per request by arm (`lab.plots.latency_distributions`), or
    nothing when no arm ran."""
    if frame.empty:
        print("no requests to draw")
        return None
    from ..plots import latency_distributions
    return latency_distributions(frame, metrics=("ttft_ms", "tpot_ms"), hue="arm", title=title)


def plot_capacity(capacity: pd.DataFrame, budget_bytes: int,
                  title: str = "KV-cache capacity in the same byte budget"):
    """Tokens the engine reports per arm (bars), with the bytes-per-token prediction."""
    plt, _ = pyplot()
    if capacity.empty or capacity.kv_cache_size_tokens.isna().all():
        print("no KV capacity to draw: no arm ran, or no server reported its capacity")
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = np.arange(len(capacity))
    ax.bar(x, capacity.kv_cache_size_tokens, color="tab:blue", label="reported by vLLM")
    if "predicted_tokens" in capacity:
        ax.scatter(x, capacity.predicted_tokens, marker="_", s=900, color="tab:orange",
                   zorder=3, label="predicted: budget / bytes per token")
    for xi, v in zip(x, capacity.kv_cache_size_tokens):
        ax.annotate(f"{v:,.0f}", (xi, v), ha="center", va="bottom", fontsize="small")
    ax.set_xticks(x, [f"{a}\n(engine reports {d})" for a, d in
                      zip(capacity.index, capacity.cache_dtype)])
    ax.set_xlabel("--kv-cache-dtype")
    ax.set_ylabel("KV-cache capacity (tokens)")
    ax.set_ylim(0, capacity.kv_cache_size_tokens.max() * 1.2)
    ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(f"{title} ({budget_bytes / 2**20:.0f} MiB)")
    fig.tight_layout()
    return fig


def plot_pressure(gauges: pd.DataFrame, title: str = "Requests running and waiting "
                  "under memory pressure"):
    """vLLM's running/waiting gauges and KV usage against time, one column per arm."""
    plt, _ = pyplot()
    if gauges.empty:
        print("no gauge samples to draw")
        return None
    names = list(dict.fromkeys(gauges.arm))
    fig, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 5.5), squeeze=False,
                             sharex=True, sharey="row")
    for col, arm in enumerate(names):
        g = gauges[gauges.arm == arm]
        top, bottom = axes[0][col], axes[1][col]
        top.step(g.t_s, g.requests_running, where="post", label="running")
        top.step(g.t_s, g.requests_waiting, where="post", label="waiting")
        top.set_title(f"kv_cache_dtype={arm}")
        top.set_ylabel("requests")
        top.legend(fontsize="small")
        bottom.plot(g.t_s, g.kv_cache_usage * 100, color="tab:red", label="KV-cache usage")
        bottom.set_ylim(0, 105)
        bottom.set_xlabel("time since the run started (s)")
        bottom.set_ylabel("KV-cache usage (%)")
        bottom.legend(fontsize="small")
    return titled(fig, title)


def plot_logprobs(result, baseline: str = "auto",
                  title: str = "Prompt log-probabilities: fp8 KV cache against auto"):
    """Per token: the log-prob under each fp8 arm against the baseline's (left), and
    the absolute difference along the text (right); `result.logprobs` holds
    each arm's {"logprobs": array} (`baseline`: the notebook's `auto` arm)."""
    plt, _ = pyplot()
    others = [a for a in result.logprobs if a != baseline]
    if baseline not in result.logprobs or not others:
        print("needs the baseline arm and one more")
        return None
    base = result.logprobs[baseline]["logprobs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm in others:
        lp = result.logprobs[arm]["logprobs"]
        left.scatter(base, lp, s=6, alpha=0.5, label=arm)
        right.plot(np.arange(1, len(lp) + 1), np.abs(lp - base), lw=0.8, alpha=0.8, label=arm)
    lo = float(min(base.min(), *(result.logprobs[a]["logprobs"].min() for a in others)))
    left.plot([lo, 0], [lo, 0], color="grey", ls=":", label="no change")
    left.set_xlabel(f"log-prob with kv_cache_dtype={baseline}")
    left.set_ylabel("log-prob with the fp8 cache")
    left.legend(fontsize="small")
    right.set_xlabel("token position in the text")
    right.set_ylabel("|log-prob difference| (nats)")
    right.legend(fontsize="small")
    return titled(fig, title)


__all__ = ["plot_capacity", "plot_latencies", "plot_logprobs", "plot_pressure"]
