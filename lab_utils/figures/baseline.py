"""The figures of `00_baseline` (`lab_utils.experiments.baseline`): single-stream
decode against the memory-bandwidth floor of a step (`decode_floor.table`)."""
from __future__ import annotations

import pandas as pd

from . import pyplot, titled


def plot_decode_floor(table: pd.DataFrame,
                      title: str = "Single-stream decode against the memory-bandwidth floor"):
    """One horizontal bar per figure of `table` (ms per decode step, labelled
    with its multiple of the floor) and the floor as a dashed line; None when
    the table has no floor (a remote server, an unnamed GPU)."""
    floor = table.ms.get("floor: weights / read bandwidth")
    if floor is None or len(table) < 2:
        print("no decode floor to draw")
        return None
    plt, _ = pyplot()
    rows = table.iloc[::-1]  # the floor on top
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(rows) + 1.4))
    bars = ax.barh(range(len(rows)), rows.ms, color=["#4c72b0"] * (len(rows) - 1) + ["#888888"])
    ax.set_yticks(range(len(rows)), rows.index)
    for bar, (ms, times) in zip(bars, zip(rows.ms, rows["x floor"])):
        ax.annotate(f"{ms:.1f} ms ({times:.2f}x)", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize="small")
    ax.axvline(floor, color="crimson", ls="--", label=f"floor {floor:.1f} ms")
    ax.set_xlabel("time per decode step (ms)")
    ax.set_xlim(0, rows.ms.max() * 1.5)  # room for the labels
    ax.legend(loc="lower right", fontsize="small")
    return titled(fig, title)
