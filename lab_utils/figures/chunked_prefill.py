"""The figures of `01_chunked_prefill` (`lab_utils.experiments.chunked_prefill`):
what the token budget trades (decode stall, short and long TTFT against
`max_num_batched_tokens`), and every engine step of an arm from the server's
step log (`lab_utils.engine_steps`)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from . import pyplot, titled



def plot_sweep(table: pd.DataFrame, title: str = "Chunked prefill: what the token budget trades"):
    """Three panels against max_num_batched_tokens (log2 axis): decode stall,
    short-request TTFT p99, long-request TTFT. Chunked-on arms are a line, the
    chunked-off arm a dashed level, a long-prefill-threshold arm a star."""
    plt, _ = pyplot()
    panels = [("stall_itl_ms_max", "max ITL of streaming short requests (ms)", "Decode stall"),
              ("short_ttft_ms_p99", "short-request TTFT p99 (ms)", "Short requests: TTFT p99"),
              ("long_ttft_ms_median", "long-request TTFT median (ms)", "Long requests: TTFT")]
    thr = table.get("long_prefill_token_threshold", pd.Series(0, index=table.index)).fillna(0)
    chunked = table.chunked_prefill
    on = table[chunked.eq(True) & (thr == 0)].sort_values("max_num_batched_tokens")
    capped = table[chunked.eq(True) & (thr > 0)]
    off = table[chunked.eq(False)]
    unknown = table[~chunked.isin([True, False])]  # a remote server as it runs
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (col, ylabel, name) in zip(axes, panels):
        if len(on):
            ax.plot(on.max_num_batched_tokens, on[col], marker="o", label="chunked prefill on")
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(on.max_num_batched_tokens))
            ax.set_xticklabels([str(int(b)) for b in on.max_num_batched_tokens])
        for _, row in capped.iterrows():
            ax.plot([row.max_num_batched_tokens], [row[col]], marker="*", markersize=14,
                    linestyle="none", color="tab:green",
                    label=f"on + long-prefill threshold {row.long_prefill_token_threshold:g}")
        for _, row in off.iterrows():
            ax.axhline(row[col], color="tab:red", linestyle="--",
                       label=f"chunked prefill off (budget {row.max_num_batched_tokens:g})")
        for label, row in unknown.iterrows():
            ax.axhline(row[col], color="tab:gray", linestyle=":", label=f"{label} (budget unknown)")
        ax.set_xlabel("max_num_batched_tokens (tokens per engine step)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_title(name)
        ax.legend(fontsize="small")
    return titled(fig, title)


def plot_steps(runs: Mapping[str, Any], labels: Sequence[str] | None = None,
               title: str = "Engine steps: how long each one took"):
    """Every engine step of the chosen arms ({label: `ArmRun`}, from the server's step log): its
    duration against its number in the run, prefill steps marked."""
    plt, _ = pyplot()
    labels = [lb for lb in (labels or list(runs)) if lb in runs and not runs[lb].steps.empty]
    if not labels:
        print("no engine steps to draw: the step log is read from local servers only "
              "(vLLM's --enable-logging-iteration-details), and none ran here")
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, label in enumerate(labels):
        st = runs[label].steps.reset_index(drop=True)
        color = f"C{i}"
        ax.plot(st.index, st.elapsed_ms, color=color, linewidth=0.8, label=f"{label}: every step")
        pre = st[st.ctx_tokens > 0]
        ax.scatter(pre.index, pre.elapsed_ms, color=color, s=18, marker="o",
                   label=f"{label}: steps with prefill tokens")
    ax.set_yscale("log")
    ax.set_xlabel("engine step (in order, this run)")
    ax.set_ylabel("step time (ms, log scale)")
    ax.legend(fontsize="small")
    return titled(fig, title)
