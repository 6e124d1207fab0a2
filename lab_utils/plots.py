"""Seaborn figures with titles, units and legends. Each returns its Figure."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

sns.set_theme(style="whitegrid", context="notebook")


def _finish(fig, title: str, save_to: str | Path | None):
    fig.suptitle(title)
    fig.tight_layout()
    if save_to:
        Path(save_to).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(save_to, dpi=110, bbox_inches="tight")
    return fig


def latency_distributions(frame, metrics: Sequence[str] = ("ttft_ms", "tpot_ms"),
                          hue: str = "label", title: str = "Latency per request",
                          save_to: str | Path | None = None):
    """Box + strip plot per metric (one panel each), arms side by side."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        data = frame.dropna(subset=[metric])
        sns.boxplot(data=data, x=hue, y=metric, hue=hue, ax=ax, showfliers=False, legend=False)
        sns.stripplot(data=data, x=hue, y=metric, color="black", size=3, alpha=0.5, ax=ax)
        ax.set_xlabel("arm" if hue == "label" else hue.replace("_", " "))
        ax.set_ylabel(metric.replace("_ms", "") .upper() + " (ms)")
        ax.tick_params(axis="x", rotation=20)
        ax.set_title(metric.replace("_ms", "").upper())
    return _finish(fig, title, save_to)


def request_timeline(records: Sequence, title: str = "Per-request timeline",
                     save_to: str | Path | None = None):
    """One bar per request: waiting for the first token, then decoding."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.start)
    if not ok:
        raise ValueError("no successful requests to draw")
    t0 = min(r.start for r in ok)
    tags = sorted({r.tag for r in ok})
    palette = dict(zip(tags, sns.color_palette("tab10", len(tags))))
    fig, ax = plt.subplots(figsize=(9, 0.25 * len(ok) + 1.5))
    for y, r in enumerate(ok):
        send = r.start - t0
        ax.barh(y, r.ttft, left=send, color=palette[r.tag], alpha=0.35, edgecolor="none")
        ax.barh(y, r.e2e - r.ttft, left=send + r.ttft, color=palette[r.tag], edgecolor="none")
    from matplotlib.patches import Patch
    handles = [Patch(color=palette[t], alpha=0.35, label=f"{t}: until first token")
               for t in tags] + [Patch(color=palette[t], label=f"{t}: decoding") for t in tags]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("request (by send time)")
    ax.invert_yaxis()
    return _finish(fig, title, save_to)


def token_arrivals(records: Sequence, hue: str = "label", title: str = "Token arrivals",
                   save_to: str | Path | None = None):
    """Cumulative output tokens against time since send, one line per request."""
    import pandas as pd
    rows = [{"t_s": t, "tokens": n, hue: getattr(r, hue), "request": f"{r.label}#{r.index}"}
            for r in records if r.ok for t, n in zip(r.chunk_times, r.chunk_tokens)]
    if not rows:
        raise ValueError("no streamed chunks to draw")
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(data=pd.DataFrame(rows), x="t_s", y="tokens", hue=hue, units="request",
                 estimator=None, drawstyle="steps-post", alpha=0.6, ax=ax)
    ax.set_xlabel("time since request sent (s)")
    ax.set_ylabel("output tokens received")
    return _finish(fig, title, save_to)


def table_figure(table, columns: Sequence[str], *, ylabel: str, xlabel: str | None = None,
                 kind: str = "bar", title: str = ""):
    """The `columns` of a result table against its index: grouped bars (one
    group per row, e.g. per arm) or lines (a numeric index, e.g. prompt
    tokens). Only the columns the table has; None when none has a value (an
    Explore widget's figure beside its table: `lab_utils.notebook.explore`)."""
    import pandas as pd
    present = [c for c in columns if c in getattr(table, "columns", ())]
    if not present or len(table) == 0:
        return None
    data = table[present].apply(pd.to_numeric, errors="coerce")
    if data.isna().all().all():
        return None
    if kind not in ("bar", "line"):
        raise ValueError(f"kind must be 'bar' or 'line', got {kind!r}")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if kind == "line":
        for c in present:
            ax.plot(data.index, data[c], marker="o", label=c)
    else:
        labels = [" / ".join(map(str, i)) if isinstance(i, tuple) else str(i) for i in data.index]
        width = 0.8 / len(present)
        for j, c in enumerate(present):
            ax.bar([i + j * width for i in range(len(data))], data[c], width, label=c)
        ax.set_xticks([i + width * (len(present) - 1) / 2 for i in range(len(data))], labels,
                      rotation=20, ha="right")
    ax.set_xlabel(xlabel or " / ".join(str(n) for n in data.index.names if n) or "row")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    if len(present) > 1:
        ax.legend(fontsize="small")
    return _finish(fig, title, None)


def xy(frame, x: str, y: str, hue: str | None = None, *, xlabel: str, ylabel: str,
       title: str, save_to: str | Path | None = None, fit: bool = False):
    """Scatter (or line) of y against x with labelled axes; `fit` adds a linear fit."""
    fig, ax = plt.subplots(figsize=(7, 4))
    if fit:
        sns.regplot(data=frame, x=x, y=y, ax=ax, scatter_kws={"s": 14, "alpha": 0.6},
                    line_kws={"label": "linear fit"})
        ax.legend()
    else:
        sns.lineplot(data=frame, x=x, y=y, hue=hue, marker="o", errorbar=("pi", 80), ax=ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(fig, title, save_to)


def article_table_across_runs(checklist, runs: Sequence[str], names: dict[str, str] | None = None,
                              title: str = "The article's table across runs",
                              save_to: str | Path | None = None):
    """Each row of the article's table (technique · metric): the claimed range
    as a band and each run's measured improvement (%) as a dot with its 95%
    interval. `checklist` is long (a `run` column beside `checklist_table`'s
    columns), `runs` the run labels in order, `names` their legend names."""
    import numpy as np

    from .article_table import ARTICLE_TABLE
    rows = list(dict.fromkeys(zip(checklist.technique, checklist.metric)))
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.8))
    y = np.arange(len(rows))
    claims = [ARTICLE_TABLE[(t, m.lower())] for t, m in rows]
    ax.barh(y, [max(hi - lo, 3.0) for lo, hi in claims],  # a point claim stays visible
            left=[lo if hi - lo >= 3.0 else lo - 1.5 for lo, hi in claims],
            height=0.7, color="#c7d7ee", label="article's claim", zorder=2)
    colors = sns.color_palette(n_colors=max(1, len(runs)))
    offsets = np.linspace(-0.22, 0.22, len(runs)) if len(runs) > 1 else [0.0]
    for run, color, dy in zip(runs, colors, offsets):
        part = checklist[checklist.run == run].set_index(["technique", "metric"])
        for i, row in enumerate(rows):
            if row not in part.index or not np.isfinite(float(part.loc[row, "measured"])):
                ax.annotate(f"{run}: missing", (0, i + dy), xytext=(6, -3),
                            textcoords="offset points", fontsize=8, color=color)
                continue
            m = float(part.loc[row, "measured"])
            ci = part.loc[row, "measured_ci95"]
            err = ([[m - min(ci)], [max(ci) - m]] if isinstance(ci, (list, tuple))
                   and None not in ci else None)
            ax.errorbar(m, i + dy, xerr=err, fmt="o", color=color, ms=7, capsize=3, zorder=3)
        ax.plot([], [], "o", color=color, label=f"{run}: {(names or {}).get(run, run)}")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, [f"{t} · {m}" for t, m in rows])
    ax.invert_yaxis()
    ax.set_xlabel("measured improvement (%): TTFT cut, or TPOT speed-up")
    ax.set_ylabel("row of the article's table")
    ax.legend(loc="lower right", fontsize=8)
    return _finish(fig, title, save_to)
