"""Experiments of `00_baseline`: how TTFT grows with the prompt, how TPOT
behaves with output length and concurrency, and whether perceived latency is
TTFT + n x TPOT on this engine, and how close single-stream TPOT comes to
the memory-bandwidth floor of a decode step (`lab_utils.decode_floor`). The
figures are `lab_utils.figures.baseline`'s."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pandas as pd

from pathlib import Path

from .. import arms, decode_floor, step_profile
from ..figures.baseline import plot_decode_floor  # noqa: F401  (re-exported for the notebook)
from ..client import Client, Load
from ..metrics import records_frame
from ..paths import cache_dir
from ..results import Results, measure
from ..workloads import synthetic_specs, tokenizer_for

#: The profiled arm's name, and where its worker writes vLLM's profile.
PROFILED = "profiled"


def profiler_folder() -> Path:
    """Where the profiled arm's worker writes its torch profile: in the lab's
    cache (the same path in every kernel, runner and test of a run, as the
    plan's engine key needs)."""
    return cache_dir() / "step_profiles" / "00_baseline"


def why_not_profiled(profile) -> str:
    """Why this target has no profiled arm, or "" where it has one."""
    if profile.is_remote:
        return "a remote server: its profiler writes on its own machine"
    if profile.device != "cpu":
        return ("a GPU engine: its steps run on the device, and lab_utils.step_profile splits "
                "a CPU engine's steps only")
    return ""


def plan(profile, params) -> arms.Plan:
    """The profile's own flags (every other notebook's baseline) and, on a local
    CPU engine with `profile_tokens` > 0, the same flags with vLLM's torch
    profiler on (`lab_utils.step_profile`): where a decode step's time goes."""
    out = [arms.Arm("baseline", title="the profile's engine flags")]
    if int(params.get("profile_tokens") or 0) > 0 and not why_not_profiled(profile):
        out.append(arms.Arm(PROFILED, flags=step_profile.profiler_flags(profiler_folder()),
                            knob=step_profile.PROFILER_FLAG, reference="baseline",
                            title="the profile's flags with vLLM's torch profiler on",
                            optional=True))
    return arms.Plan("00_baseline", tuple(out))


# Every call draws new prompt text, so vLLM's prefix cache (on by default)
# cannot serve a repeat of an earlier prompt and hide the prefill cost.
_fresh = itertools.count(1)


def ttft_vs_prompt_length(engine, lengths: Sequence[int], repeats: int = 4, *,
                          output_tokens: int = 8, results: Results | None = None,
                          progress: bool = True) -> pd.DataFrame:
    """Sequential requests of exact prompt lengths; one row per request."""
    tok = tokenizer_for(engine)
    frames = []
    for length in lengths:
        specs = synthetic_specs(tok, repeats, int(length), max_tokens=output_tokens,
                                seed=next(_fresh) * 1000 + int(length), tag=f"prompt_{length}")
        run = measure(engine, specs, Load.sequential(), label=f"prompt_len={length}",
                      results=results, progress=progress)
        frame = run.frame().assign(prompt_len=int(length),
                                   prefix_cache_hits=run.counters["prefix_cache_hits"])
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def tpot_vs_output_and_concurrency(engine, output_lengths: Sequence[int],
                                   concurrencies: Sequence[int], repeats: int = 4, *,
                                   prompt_tokens: int = 64, results: Results | None = None,
                                   progress: bool = True) -> tuple[pd.DataFrame, list]:
    """Fixed prompt length; `ignore_eos` makes every request produce exactly
    `output_len` tokens. At concurrency c, `repeats * c` requests keep c in flight."""
    tok = tokenizer_for(engine)
    frames, records = [], []
    for conc, out_len in itertools.product(concurrencies, output_lengths):
        specs = synthetic_specs(tok, repeats * int(conc), prompt_tokens, max_tokens=int(out_len),
                                seed=next(_fresh) * 1000 + int(out_len), tag=f"c{conc}")
        run = measure(engine, specs, Load.concurrent(int(conc)),
                      label=f"output_len={out_len},concurrency={conc}", results=results,
                      progress=progress)
        records += run.records
        frames.append(run.frame().assign(output_len=int(out_len), concurrency=int(conc)))
    return pd.concat(frames, ignore_index=True), records


def perceived_latency_fit(frame: pd.DataFrame) -> dict:
    """Least-squares E2E = a + b * n over single-stream requests, against the
    article's TTFT + n x TPOT with the measured medians plugged in."""
    data = frame.dropna(subset=["e2e_ms", "output_tokens"])
    n = data["output_tokens"].to_numpy(float)
    e2e = data["e2e_ms"].to_numpy(float)
    slope, intercept = np.polyfit(n, e2e, 1)
    fitted = intercept + slope * n
    ss_res = float(((e2e - fitted) ** 2).sum())
    ss_tot = float(((e2e - e2e.mean()) ** 2).sum()) or 1.0
    ttft_med = float(data["ttft_ms"].median())
    tpot_med = float(data["tpot_ms"].median())
    article = ttft_med + n * tpot_med
    residual_pct = (e2e - article) / e2e * 100
    return {"fit_intercept_ms": float(intercept), "fit_slope_ms_per_token": float(slope),
            "r2": 1 - ss_res / ss_tot, "ttft_median_ms": ttft_med, "tpot_median_ms": tpot_med,
            "article_residual_pct_median": float(np.median(residual_pct)),
            "article_residual_pct_max_abs": float(np.abs(residual_pct).max()),
            "residuals": pd.DataFrame({"output_tokens": n, "measured_e2e_ms": e2e,
                                       "article_prediction_ms": article,
                                       "residual_pct": residual_pct})}


__all__ = [
    "engine_binding",
    "perceived_latency_fit",
    "records_frame",
    "tpot_vs_output_and_concurrency",
    "ttft_vs_prompt_length",
]


def engine_binding(engine) -> pd.DataFrame:
    """Which cores the engine's worker computes on, as vLLM applied it (its own
    log) beside the environment the lab started it with and the machine's
    cores; for a remote server only what the lab knows (nothing of its cores)."""
    import os
    from pathlib import Path

    from ..cpu_tuning import FORK_CORE_ENV, describe_env
    from ..machine import parse_engine_binding
    rows = {"cores this process may use": len(os.sched_getaffinity(0))}
    if engine.server is None:
        rows["engine"] = f"remote server at {engine.base_url}: its binding is its own"
        return pd.Series(rows, name="value").to_frame()
    try:
        got = parse_engine_binding(Path(engine.server.log_path).read_text(errors="replace"))
    except OSError:
        got = {}
    env = engine.server.env
    in_core = got.get("executor") == "uni"
    unbound = "– (vLLM binds only a worker process of its own)"
    rows.update({
        "lab's setting (profile [cpu_binding] + [env])": describe_env(env),
        "engine core's process": (
            "spawned (vLLM's CPU platform); the worker computes in it" if in_core else
            "forked from the API server (the lab's launcher, lab_utils.vllm_cli)"
            if env.get(FORK_CORE_ENV) == "1" else "spawned (vLLM's CPU platform)"),
        "worker's process (vLLM)": {
            "mp": "its own (vLLM's mp executor)",
            "uni": "the engine core's (uni executor: VLLM_ENABLE_V1_MULTIPROCESSING=0)",
        }.get(got.get("executor"), "?"),
        "VLLM_CPU_OMP_THREADS_BIND (vLLM)": got.get("bind", unbound if in_core else "?"),
        "worker core ids (vLLM)": got.get("core_ids", unbound if in_core else "?"),
        "reserved for the engine core (vLLM)": got.get("reserved_cpus",
                                                       "none: it is the worker" if in_core else "?"),
        "torch threads in the worker (vLLM)": got.get("torch_threads", "?"),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "(vLLM's choice)"),
        "LD_PRELOAD": env.get("LD_PRELOAD", "") or "(none)"})
    return pd.Series({k: str(v) for k, v in rows.items()}, name="value").to_frame()


def decode_step_split(ctx, tokens: int, requests: int = 2) -> tuple[pd.DataFrame | None, dict]:
    """Where a single-request decode step goes on the profiled arm: `requests`
    requests of 16 prompt tokens and `tokens` answer tokens one at a time, under
    vLLM's torch profiler (`step_profile.Profiling`). Returns a table (ms per
    step and share of the step, per part) and the split
    (`step_profile.decode_breakdown`, with `requests` and `tokens`), or
    (None, {"why": ...}) where there is no profiled arm or it did not start."""
    if ctx.plan is None or PROFILED not in [a.name for a in ctx.plan.arms]:
        why = why_not_profiled(ctx.profile) or "profile_tokens = 0"
        return None, {"why": why}
    engine = ctx.arm(PROFILED)
    if engine is None:  # skipped, with its reason in the results
        return None, {"why": "the profiled arm did not start (see the skipped arms)"}
    tok = tokenizer_for(engine)
    client = Client.for_engine(engine)
    client.run(synthetic_specs(tok, 1, 16, max_tokens=4, seed=next(_fresh)), progress=False)
    specs = synthetic_specs(tok, requests, 16, max_tokens=int(tokens), seed=next(_fresh))
    with step_profile.Profiling(engine):
        run = client.run(specs, Load.sequential(), progress=False)
    failed = [r.error for r in run.records if not r.ok]
    if failed:
        raise RuntimeError(f"profiled requests failed: {failed[0]}")
    facts, _ = decode_floor.step_facts(engine)
    split = {**step_profile.decode_breakdown(step_profile.read_table(step_profile.folder_of(engine))),
             "requests": requests, "tokens": int(tokens),
             "layers": facts.num_hidden_layers if facts is not None else None}
    parts = [*step_profile.PARTS]
    table = pd.DataFrame({"ms per step": [split[p] for p in parts]}, index=pd.Index(parts, name="part"))
    table["share of the step"] = table["ms per step"] / split["step_ms"]
    table.loc["the step (vLLM's step timer under the profiler)"] = [split["step_ms"], 1.0]
    return table.round({"ms per step": 2, "share of the step": 3}), split


def calls_per_forward(split: dict) -> pd.DataFrame | None:
    """What vLLM's torch profiler counted per forward pass on the profiled arm
    (each request: one prefill and `tokens` - 1 decode steps), beside what the
    model's layers call for: a matrix product per projection (q/k/v, o, gate/up,
    down: 4 a layer) and the LM head; two norms a layer and the final one; an
    activation a layer. Norms and activations count only where they ran in
    vLLM's C kernels (`lab_utils.cpu_kernels`); as PyTorch ops they count 0.
    None where the split has no profile (`split["why"]`)."""
    if "why" in split:
        return None
    passes = split["requests"] * split["tokens"]
    layers = split.get("layers")
    rows = {"matrix products (_C::onednn_mm, ...)": (split["gemm_calls"], 4, 1),
            "norms in C (_C::rms_norm, _C::fused_add_rms_norm)": (split["norm_calls"], 2, 1),
            "activations in C (_C::silu_and_mul)": (split["activation_calls"], 1, 0)}
    return pd.DataFrame(
        {"counted per pass": [calls / passes for calls, _, _ in rows.values()],
         "the layers call for": [a * layers + b if layers else np.nan
                                         for _, a, b in rows.values()]},
        index=pd.Index(list(rows), name=f"op ({layers} layers)" if layers else "op"))


def findings(ttft: pd.DataFrame, tpot: pd.DataFrame, fit: dict, floor=None,
             step_split: dict | None = None) -> list[dict]:
    """The notebook's findings (`Results.add_findings`): TTFT median from the
    shortest to the longest prompt (`ttft_vs_prompt_length` rows), TPOT median
    from the lowest to the highest concurrency (`tpot_vs_output_and_concurrency`
    rows), how far E2E is from TTFT + n x TPOT (`perceived_latency_fit`), and
    single-stream TPOT against the decode floor (`decode_floor.measure`, if given;
    with the profiled arm's `step_split`, what the step is made of)."""
    by_len = ttft.groupby("prompt_len").ttft_ms.median()
    lo, hi = by_len.index.min(), by_len.index.max()
    by_c = tpot.groupby("concurrency").tpot_ms.median()
    c_lo, c_hi = by_c.index.min(), by_c.index.max()
    return [
        dict(technique="baseline: prefill", metric=f"TTFT median (ms), {lo} -> {hi} prompt tokens",
             baseline=by_len[lo], treated=by_len[hi],
             article_claim="TTFT is the prefill of the prompt: shorter input, lower TTFT",
             mechanism=f"vllm:prefix_cache_hits_total delta = {int(ttft.prefix_cache_hits.sum())} "
                       "during the sweep (every prompt prefilled from scratch)"),
        dict(technique="baseline: batching",
             metric=f"TPOT median (ms), concurrency {c_lo} -> {c_hi}",
             baseline=by_c[c_lo], treated=by_c[c_hi],
             article_claim="(none; context for every TPOT claim)",
             mechanism="decode steps are shared by the batch: higher per-request TPOT, "
                       "higher tok/s"),
        dict(technique="baseline: perceived latency",
             metric="E2E = TTFT + n x TPOT, median residual (%)",
             baseline=0.0, treated=fit["article_residual_pct_median"],
             article_claim="perceived latency = TTFT + output tokens x TPOT",
             mechanism=f"least-squares E2E = {fit['fit_intercept_ms']:.0f} ms + "
                       f"{fit['fit_slope_ms_per_token']:.1f} ms x n (R² {fit['r2']:.3f})"),
    ] + ([decode_floor.finding(floor, tpot, step_split)] if floor is not None else [])

