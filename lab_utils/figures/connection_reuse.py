"""The figures of `08_connection_reuse` (`lab_utils.experiments.connection_reuse`):
TTFT per client arm and concurrency, and TTFT and set-up cost against an
emulated round-trip time."""
from __future__ import annotations

import pandas as pd

from . import pyplot, titled


def plot_ttft(frame: pd.DataFrame, title: str = "TTFT per arm and concurrency"):
    """Box plot of TTFT per arm, one panel per target, concurrency on x."""
    plt, sns = pyplot()
    targets = list(dict.fromkeys(frame.target))
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 4), squeeze=False)
    for ax, target in zip(axes[0], targets):
        data = frame[(frame.target == target) & frame.ok]
        sns.boxplot(data=data, x="concurrency", y="ttft_ms", hue="arm", ax=ax, showfliers=False)
        ax.set_title(target)
        ax.set_xlabel("requests in flight (concurrency)")
        ax.set_ylabel("TTFT (ms)")
        ax.legend(title="arm", fontsize="small")
    return titled(fig, title)


def plot_remote(frame: pd.DataFrame, title: str = "TTFT against the round-trip time"):
    """Left: TTFT per arm against the emulated RTT. Right: the connection
    set-up each request paid (TCP + TLS, 0 on a reused connection)."""
    plt, sns = pyplot()
    ok = frame[frame.ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    sns.lineplot(data=ok, x="rtt_ms", y="ttft_ms", hue="arm", marker="o", errorbar=("pi", 80),
                 ax=axes[0])
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].legend(title="arm (median, 80% band)", fontsize="small")
    axes[0].set_title("time to first token")
    sns.lineplot(data=ok, x="rtt_ms", y="setup_ms", hue="arm", marker="o", errorbar=None,
                 estimator="mean", ax=axes[1])
    axes[1].set_ylabel("connection set-up per request, mean (ms)")
    axes[1].legend(title="arm", fontsize="small")
    axes[1].set_title("what reuse saves: TCP + TLS set-up")
    for ax in axes:
        ax.set_xlabel("emulated round-trip time to the server (ms)")
    return titled(fig, title)


__all__ = ["plot_remote", "plot_ttft"]
