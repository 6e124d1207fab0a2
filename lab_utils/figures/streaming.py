"""The figures of `07_streaming` (`lab_utils.experiments.streaming`): the
perceived-latency change by answer length, a reader against the stream, the
tokens a client holds over time, and vLLM's gauges around a hang-up. Each
takes what the experiment returns (`result.timed`: `lab_utils.timed_chat.Timed`
requests)."""
from __future__ import annotations

from typing import Any

import pandas as pd

from ..perceived import READING_WPM, reader_times, reading_schedule, word_arrival_times
from . import pyplot, titled


def _figure():
    """One figure and axes, 7.5 x 4 in, in the lab's theme."""
    plt, _ = pyplot()
    return plt.subplots(figsize=(7.5, 4))


def plot_perceived_by_length(by_length: pd.DataFrame, claim_pct: float = -80.0,
                             title: str = "Perceived-latency change of streaming, by answer length"):
    _, sns = pyplot()
    fig, ax = _figure()
    sns.lineplot(data=by_length, x="tokens", y="perceived_change_pct", hue="arm",
                 errorbar=("pi", 80), ax=ax)
    ax.axhline(claim_pct, color="crimson", ls="--", label=f"article: {claim_pct:.0f}%")
    ax.set_xlabel("answer length (output tokens)")
    ax.set_ylabel("first visible content vs whole answer (%)")
    ax.legend(title="arm (median, 80% band)")
    return titled(fig, title)


def plot_reading(result, index: int = 0, target: str = "direct",
                 wpm: float = READING_WPM, title: str = "Does the stream stay ahead of a reader?"):
    """Words available over time for prompt `index` (of `result.timed`, arms
    named "<target>/<mode>"), streamed and not, and a reader at `wpm`
    words/min who starts at the first word of each."""
    fig, ax = _figure()
    for stream, color in ((True, "tab:blue"), (False, "tab:orange")):
        found = [t for t in result.timed if t.arm.partition("/")[0] == target
                 and t.stream == stream and t.index == index and t.ok]
        if not found:
            continue
        label = found[0].arm
        words = word_arrival_times(found[0].times, found[0].pieces)
        if not words:
            continue
        ax.step(words + [words[-1]], list(range(1, len(words) + 1)) + [len(words)],
                where="post", color=color, label=f"{label}: words arrived")
        read = reader_times(words, wpm)
        done = reading_schedule(words, wpm)["done_s"]
        ax.plot(read + [done], list(range(len(read) + 1)), color=color, ls=":",
                label=f"{label}: reader at {wpm:.0f} wpm (done at {done:.1f} s)")
    ax.set_xlabel("time since request sent (s)")
    ax.set_ylabel("words")
    ax.legend(fontsize="small")
    return titled(fig, title)


def plot_disconnect(timeline: pd.DataFrame, summary: dict[str, Any],
                    title: str = "Hanging up aborts the generation"):
    """vLLM's running requests and generated tokens around the hang-up."""
    fig, ax = _figure()
    ax.step(timeline.t_s, timeline.running, where="post", color="tab:blue",
            label="vllm:num_requests_running")
    ax.set_xlabel("time since the request was sent (s)")
    ax.set_ylabel("requests running")
    ax.set_ylim(-0.1, max(1.5, timeline.running.max() + 0.5))
    right = ax.twinx()
    right.plot(timeline.t_s, timeline.generated, color="tab:orange",
               label="vllm:generation_tokens (since start)")
    right.set_ylabel("tokens generated")
    right.grid(False)
    ax.axvline(summary["hang_up_s"], color="crimson", ls="--", label="client hangs up")
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="center right", fontsize="small")
    return titled(fig, title)


def plot_token_arrivals(result,
                        title: str = "Output tokens visible to the client"):
    """Tokens the client holds against time since send, one line per request:
    a streamed answer climbs from its first chunk; a non-streamed one jumps
    from 0 to all of it when the body arrives."""
    _, sns = pyplot()
    fig, ax = _figure()
    arms = list(dict.fromkeys(t.arm for t in result.timed))
    palette = dict(zip(arms, sns.color_palette("tab10", len(arms))))
    seen = set()
    for t in result.timed:
        if not t.ok:
            continue
        xs, ys = [0.0, *t.times], [0, *t.token_counts]
        ax.step(xs, ys, where="post", color=palette[t.arm], alpha=0.7,
                ls="-" if t.stream else "--", label=None if t.arm in seen else t.arm)
        seen.add(t.arm)
    ax.set_xlabel("time since request sent (s)")
    ax.set_ylabel("output tokens received")
    ax.legend(title="arm (one line per request)", fontsize="small")
    return titled(fig, title)


__all__ = ["plot_disconnect", "plot_perceived_by_length", "plot_reading", "plot_token_arrivals"]
