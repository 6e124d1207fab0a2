"""The figures of `05_quantization` (`lab_utils.experiments.quantization`):
TTFT and TPOT per arm, and each arm's decode speed against its perplexity."""
from __future__ import annotations

import pandas as pd

from . import pyplot, titled


def plot_latency(latency: pd.DataFrame, title: str = "TTFT and TPOT per arm"):
    """Box + strip plots of TTFT and TPOT per arm (lab.plots)."""
    from ..plots import latency_distributions
    return latency_distributions(latency.assign(label=latency.arm), title=title)


def plot_speed_vs_quality(summary: pd.DataFrame,
                          title: str = "Decode speed against quality, per arm"):
    """Decode cost per token (x: worker CPU ms per decode step when measured,
    else the TPOT median) against perplexity (y), one labelled point per arm."""
    plt, sns = pyplot()
    data = summary.reset_index().rename(columns={"index": "arm"})
    use_cpu = "decode_cpu_ms" in data and data.decode_cpu_ms.notna().all()
    x = "decode_cpu_ms" if use_cpu else "tpot_ms_median"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sns.scatterplot(data=data, x=x, y="perplexity", hue="arm", s=90, ax=ax)
    for _, r in data.iterrows():
        ax.annotate(r["arm"], (r[x], r.perplexity), textcoords="offset points",
                    xytext=(6, 4), fontsize="small")
    ax.set_xlabel("worker CPU ms per decode step, lower is faster" if use_cpu
                  else "TPOT median (ms per output token), lower is faster")
    ax.set_ylabel("perplexity of the fixed text, lower is better")
    ax.margins(x=0.15, y=0.1)
    ax.legend(title="arm", fontsize="small")
    return titled(fig, title)


__all__ = ["plot_latency", "plot_speed_vs_quality"]
