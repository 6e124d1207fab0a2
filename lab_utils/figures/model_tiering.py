"""The figures of `11_model_tiering` (`lab_utils.experiments.model_tiering`):
TTFT and TPOT per arm, and the probe's confidence of right and wrong answers."""
from __future__ import annotations

import pandas as pd

from . import pyplot, titled


def plot_latency(arms, title: str = "TTFT and TPOT per arm"):
    """Box + strip plots of the successful requests' TTFT and TPOT per arm
    (`arms`: the experiment's `Arms`; lab.plots)."""
    from ..plots import latency_distributions
    f = arms.frame()
    return latency_distributions(f[f.ok].assign(label=lambda d: d.arm),
                                 metrics=("ttft_ms", "tpot_ms"), title=title)


def plot_confidence(quality: pd.DataFrame, threshold: float | None = None,
                    title: str = "The probe's signal: confidence of correct and wrong answers"):
    """Strip plot of each answer's confidence (mean log-prob of its first
    tokens), by tier and correctness, with the threshold if one is set."""
    plt, sns = pyplot()
    data = quality.assign(outcome=quality.correct.map({True: "correct", False: "wrong"}))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    sns.stripplot(data=data, x="tier", y="confidence", hue="outcome", dodge=True, ax=ax,
                  palette={"correct": "tab:green", "wrong": "tab:red"}, size=5, alpha=0.8)
    if threshold is not None:
        ax.axhline(threshold, color="black", ls="--", lw=1, label=f"threshold {threshold:g}")
    ax.set_ylabel("mean log-prob of the first tokens (nats/token)")
    ax.set_xlabel("tier")
    ax.legend(loc="lower left", fontsize=8)
    return titled(fig, title)
