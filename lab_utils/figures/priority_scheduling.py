"""The figures of `09_priority_scheduling`
(`lab_utils.experiments.priority_scheduling`): every request of each arm on
a timeline (held by the client, waiting, decoding), and vLLM's sampled queue
gauges during each arm. Both take {label: `Arm`} (its `frame()` and `gauges`)."""
from __future__ import annotations

from typing import Any

from ..admission import BATCH, INTERACTIVE
from . import pyplot, titled



def plot_timelines(arms: dict[str, Any], title: str = "Requests over time, per arm"):
    """One panel per arm: a bar per request from arrival: held by the client
    (hatched), waiting for its first token (light), decoding (solid)."""
    plt, _ = pyplot()
    from matplotlib.patches import Patch
    colors = {INTERACTIVE: "tab:blue", BATCH: "tab:orange"}
    fig, axes = plt.subplots(1, len(arms), figsize=(4.6 * len(arms), 4.6), sharex=True,
                             squeeze=False)
    for ax, (label, arm) in zip(axes[0], arms.items()):
        f = arm.frame().sort_values(["tag", "arrival_s"], ascending=[False, True])
        f = f[f.ok].reset_index(drop=True)
        for y, r in f.iterrows():
            c = colors.get(r.tag, "grey")
            send = r.arrival_s + r.held_s
            if r.held_s > 0.05:
                ax.barh(y, r.held_s, left=r.arrival_s, color="none", edgecolor=c, hatch="///",
                        linewidth=0.5)
            ax.barh(y, r.ttft_ms / 1e3, left=send, color=c, alpha=0.3, edgecolor="none")
            ax.barh(y, (r.e2e_ms - r.ttft_ms) / 1e3, left=send + r.ttft_ms / 1e3, color=c,
                    edgecolor="none")
        ax.set_title(label)
        ax.set_xlabel("time since arm start (s)")
        ax.set_yticks([])
        ax.invert_yaxis()
    axes[0][0].set_ylabel("requests by arrival (interactive above, batch below)")
    handles = [Patch(facecolor="none", edgecolor="grey", hatch="///", label="held by client"),
               *(Patch(color=c, alpha=0.3, label=f"{t}: waiting for 1st token")
                 for t, c in colors.items()),
               *(Patch(color=c, label=f"{t}: decoding") for t, c in colors.items())]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize="small",
               bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def plot_queue(arms: dict[str, Any], title: str = "vLLM's queue during each arm (/metrics)"):
    """Sampled `vllm:num_requests_waiting` and `..._running`, one line per arm."""
    plt, _ = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharex=True)
    for label, arm in arms.items():
        g = arm.gauges
        if len(g):
            axes[0].plot(g.t_s, g.requests_running, drawstyle="steps-post", label=label)
            axes[1].plot(g.t_s, g.requests_waiting, drawstyle="steps-post", label=label)
    for ax, what in zip(axes, ("running (in a batch slot)", "waiting (queued in vLLM)")):
        ax.set_xlabel("time since arm start (s)")
        ax.set_ylabel(f"requests {what}")
        ax.set_title(what)
        ax.legend(fontsize="small")
    return titled(fig, title)
