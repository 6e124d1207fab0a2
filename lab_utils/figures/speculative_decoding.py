"""The figures of `04_speculative_decoding`
(`lab_utils.experiments.speculative_decoding`): per-request TPOT by arm,
workload and load, the gap between streamed chunks against the per-token
latency, and vLLM's acceptance by draft position."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..metrics import token_gaps_ms
from . import pyplot, titled


def plot_tpot(requests: pd.DataFrame, title: str = "TPOT per request, by workload and load"):
    """Box + points of per-request TPOT (log scale), one panel per (workload, concurrency)."""
    plt, sns = pyplot()
    data = requests[requests.ok.astype(bool)].dropna(subset=["tpot_ms"])
    if data.empty:
        print("no requests to draw")
        return None
    panels = list(data[["workload", "concurrency"]].drop_duplicates().itertuples(index=False))
    names = list(dict.fromkeys(data.arm))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False,
                             sharey=True)
    for ax, (w, c) in zip(axes[0], panels):
        d = data[(data.workload == w) & (data.concurrency == c)]
        sns.boxplot(data=d, x="arm", y="tpot_ms", hue="arm", order=names, hue_order=names, ax=ax,
                    showfliers=False, legend=False)
        sns.stripplot(data=d, x="arm", y="tpot_ms", order=names, color="black", size=4,
                      alpha=0.6, ax=ax)
        ax.set_title(f"{w}, concurrency {c}")
        ax.set_xlabel("arm")
        ax.set_ylabel("TPOT (ms per output token, log scale)")
        ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=25)
    from matplotlib.patches import Patch
    palette = sns.color_palette(n_colors=len(names))
    fig.legend(handles=[Patch(color=palette[i], label=a) for i, a in enumerate(names)],
               loc="upper right", fontsize="small", title="arm")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    return fig


def plot_chunk_vs_token(chunks: pd.DataFrame, workload: str = "code_edit", concurrency: int = 1,
                        title: str | None = None):
    """ECDFs of the gap between streamed chunks (ITL, per chunk) and of the
    per-token latency (gap / tokens in the chunk), per arm."""
    plt, sns = pyplot()
    d = chunks[(chunks.workload == workload) & (chunks.concurrency == concurrency)]
    if d.empty:
        print(f"no chunks for {workload} at concurrency {concurrency}")
        return None
    tokens = pd.DataFrame({"arm": np.repeat(d.arm.to_numpy(), d.tokens.to_numpy(int)),
                           "ms": token_gaps_ms(d)})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    sns.ecdfplot(data=d, x="gap_ms", hue="arm", ax=axes[0])
    axes[0].set_title("ITL: gap between streamed chunks")
    sns.ecdfplot(data=tokens, x="ms", hue="arm", ax=axes[1])
    axes[1].set_title("per token: chunk gap / tokens in the chunk")
    for ax in axes:
        ax.set_xlabel("milliseconds (log scale)")
        ax.set_ylabel("fraction of chunks" if ax is axes[0] else "fraction of tokens")
        ax.set_xscale("log")
    fig.suptitle(title or f"One chunk, several tokens ({workload}, concurrency {concurrency})")
    fig.tight_layout()
    return fig


def plot_acceptance(runs: pd.DataFrame, title: str = "Acceptance by draft position"):
    """Per speculative arm and run: the fraction of drafts whose i-th proposed
    token was accepted (vLLM's per-position counters)."""
    plt, sns = pyplot()
    rows = [{"run": f"{r.arm}\n{r.workload}, c={r.concurrency}", "position": i + 1, "rate": v}
            for _, r in runs.iterrows() for i, v in enumerate(r.per_position_acceptance or [])]
    if not rows:
        print("no speculative runs with drafts to draw")
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    sns.barplot(data=pd.DataFrame(rows), x="position", y="rate", hue="run", ax=ax)
    ax.set_xlabel("position in the draft (1 = first proposed token)")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="x-small", title="arm and run", loc="upper left",
              bbox_to_anchor=(1.01, 1))
    return titled(fig, title)


__all__ = ["plot_acceptance", "plot_chunk_vs_token", "plot_tpot"]
