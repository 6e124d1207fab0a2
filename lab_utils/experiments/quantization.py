"""Experiments of `05_quantization`: full-precision against quantized weights
on the same engine and workload, for latency (TTFT, TPOT), weight memory and
quality (perplexity of a fixed text, greedy answers to fixed questions).

Arms come from a catalogue (`ARMS`); each names the engine flags it layers on
the profile and, for a pre-quantized checkpoint, the profile's model *role*
that serves it (`[models]` in `profiles/gpu.toml`: published checkpoints; in
`profiles/cpu.toml`: `quantized:<recipe>` checkpoints of the embedded model
that `lab_utils.quantize` builds here on first use). Every quantized arm has a
`reference` arm that differs from it in one knob: the weights.

What a vLLM build runs is not written here: on the `cpu` profile each arm maps
to a `lab_utils.capabilities` candidate probed on this machine, the default
arms are chosen from that probe and an arm whose candidate did not run here is
skipped with its reason. Off the CPU nothing is probed: the support table says
so beside the plan checker's estimates (`lab_utils.plan.engine_facts`).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .. import arms, capabilities
from ..arms import ROLE
from ..client import Load, RequestSpec
from ..decode_floor import step_weight_bytes
from ..figures.quantization import plot_latency, plot_speed_vs_quality
from ..host import measured_compute
from ..metrics import change_pct
from ..plan import engine_facts, role_reference
from ..profiles import ConfigError, Profile
from ..quality import agreement, greedy_answers, pooled_perplexity, score_text, text_windows
from ..results import measure
from ..server import ServerError
from ..weight_memory import checkpoint_table, weight_memory
from ..workloads import Tokenizer, served_tokenizer, synthetic_specs, warm_up

# --------------------------------------------------------------------------
# The arms
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arm(arms.Arm):
    """A plan arm (`lab_utils.arms.Arm`; a GPTQ/AWQ checkpoint is read only
    with its --quantization, so those move together) that also says what its
    `weights` are ("full", "int8", "int4", "fp8") and the claim it tests."""
    weights: str = "full"
    claim: str | None = None
    #: the `lab_utils.capabilities` candidate that says whether it runs on
    #: this CPU (None: none; "full"'s is the profile's dtype: `probe_name`)
    probe: str | None = None

    @property
    def quantized(self) -> bool:
        return self.weights != "full"


def _arm(name: str, title: str, flags: Mapping[str, Any] | None = None, **kw: Any) -> Arm:
    return Arm(name, dict(flags or {}), title=title, **kw)


_BF16 = {"dtype": "bfloat16"}
_CKPT = (ROLE, "quantization")

ARMS: dict[str, Arm] = {a.name: a for a in (
    _arm("full", "full precision (profile dtype)"),
    _arm("full_bf16", "full precision, bfloat16", dict(_BF16), reference="full", knob="dtype",
         probe="bfloat16"),
    _arm("int8_w8a8", "W8A8-INT8 checkpoint", role="int8_w8a8", reference="full",
         weights="int8", claim="int8", knob=ROLE, probe="w8a8"),
    _arm("int8_w8a8_bf16", "W8A8-INT8 checkpoint, bfloat16", dict(_BF16), role="int8_w8a8",
         reference="full_bf16", weights="int8", claim="int8", knob=ROLE, probe="w8a8_bf16"),
    # vLLM 0.32's int8_per_channel_weight_only quantizes MoE experts only
    # (vllm/config/quantization.py: "linear stays unquantized"): on a dense
    # model like SmolLM2 or Qwen2.5 it changes no weight. Kept as a control.
    _arm("int8_online", "online INT8 weight-only (MoE layers only), profile dtype",
         {"quantization": "int8_per_channel_weight_only"}, reference="full", weights="int8-moe",
         knob="quantization"),
    _arm("int4_w4a16", "W4A16-INT4 checkpoint (profile dtype)", role="int4_w4a16",
         reference="full", weights="int4", claim="int4", knob=ROLE, probe="w4a16"),
    _arm("int8_online_bf16", "online INT8 weight-only (MoE layers only), bfloat16",
         {**_BF16, "quantization": "int8_per_channel_weight_only"}, reference="full_bf16",
         weights="int8-moe", knob="quantization", probe="int8_online_bf16"),
    _arm("int4_w4a16_bf16", "W4A16-INT4 checkpoint, bfloat16", dict(_BF16), role="int4_w4a16",
         reference="full_bf16", weights="int4", claim="int4", knob=ROLE, probe="w4a16_bf16"),
    _arm("gptq_int4_bf16", "GPTQ-format INT4 checkpoint, bfloat16",
         {**_BF16, "quantization": "gptq"}, role="gptq_int4", reference="full_bf16",
         weights="int4", claim="int4", knob=_CKPT, probe="gptq_w4_bf16"),
    _arm("awq_bf16", "AWQ-format INT4 checkpoint, bfloat16", {**_BF16, "quantization": "awq"},
         role="awq", reference="full_bf16", weights="int4", claim="int4", knob=_CKPT,
         probe="awq_w4_bf16"),
    _arm("gptq_int8_bf16", "GPTQ-format INT8 checkpoint, bfloat16",
         {**_BF16, "quantization": "gptq"}, role="gptq_int8", reference="full_bf16",
         weights="int8", claim="int8", knob=_CKPT, probe="gptq_w8_bf16"),
    _arm("int8_w8a16_bf16", "W8A16-INT8 checkpoint, bfloat16", dict(_BF16), role="int8_w8a16",
         reference="full_bf16", weights="int8", claim="int8", knob=ROLE, probe="w8a16_bf16"),
    _arm("fp8_online_bf16", "online FP8 per channel (weights + dynamic activations), bfloat16",
         {**_BF16, "quantization": "fp8_per_channel"}, reference="full_bf16", weights="fp8",
         knob="quantization", probe="fp8_online_bf16"),
    _arm("fp8_bf16", "FP8 checkpoint, bfloat16", dict(_BF16), role="fp8", reference="full_bf16",
         weights="fp8", knob=ROLE),
)}

#: The quantized arms a notebook run compares by default on GPUs (each brings
#: its reference): the gpu profile names real AWQ / GPTQ / FP8 checkpoints.
DEFAULT_ARMS: dict[str, list[str]] = {
    "cuda": ["awq_bf16", "gptq_int4_bf16", "gptq_int8_bf16", "fp8_bf16"],
    "remote": [],
}


def probe_name(profile: Profile, name: str) -> str | None:
    """The capability candidate of arm `name` on `profile` (None: no candidate)."""
    if name == "full":
        dtype = str(profile.engine.get("dtype", "float32"))
        return dtype if dtype in ("float32", "bfloat16") else None
    return arm(name).probe


def choose_cpu_arms(caps) -> list[str]:
    """Default arms on a CPU from its probed capabilities: INT8 (W8A8) against
    the fastest full-precision dtype measured here, and INT4 (W4A16, whose CPU
    kernel needs bfloat16) against bfloat16. An arm whose candidate failed
    stays in the list: `engine_for` skips it with the probe's reason."""
    fast = caps.fastest(["float32", "bfloat16"]) or "float32"
    return ["int8_w8a8" if fast == "float32" else "int8_w8a8_bf16", "int4_w4a16_bf16"]


#: Capability candidates `default_arms` reads on a CPU.
CPU_CHOICE_PROBES = ("float32", "bfloat16")


def default_arms(profile: Profile, caps=None) -> list[str]:
    """The arms a run compares when the notebook names none. On the cpu
    profile they come from this machine's probe (`lab_utils.capabilities`:
    probed now if not cached)."""
    if profile.device != "cpu" or profile.is_remote:
        return list(DEFAULT_ARMS.get(profile.device, []))
    if caps is None:
        caps = capabilities.probe(profile, CPU_CHOICE_PROBES)
    return choose_cpu_arms(caps)


def runnable_here(profile: Profile, name: str, caps=None) -> str:
    """"" if arm `name` runs on this machine (or nothing says otherwise), else the
    probe's reason (`caps`, or this machine's probe, run if needed)."""
    return capabilities.why_not(profile, probe_name(profile, name), caps)


def support_table(profile: Profile, names: Sequence[str] | None = None, caps=None) -> pd.DataFrame:
    """What this machine's vLLM build did with each arm's candidate on the cpu
    profile, elsewhere the plan checker's estimates and "not probed"
    (`lab_utils.capabilities.support_table`); `attrs["machine"]` says which."""
    names = list(names if names is not None else ARMS)
    engines = [arm(n) for n in names if role_reference(profile, arm(n).role)]
    facts = (engine_facts(profile, engines) if engines and profile.device != "cpu"
             and not profile.is_remote else None)
    return capabilities.support_table(
        {n: (arm(n).title, probe_name(profile, n)) for n in names}, caps, profile=profile,
        facts=facts)


#: The article's claims (source README, technique 6 and the checklist).
CLAIMS = {
    "int8": "INT8: 2x faster, accuracy loss < 1% (checklist: TTFT -10-20%, TPOT -50-100%)",
    "int4": "INT4: 3x faster, accuracy loss 3-5% (checklist: TTFT -10-20%, TPOT -50-100%)",
    None: "(no claim in the article for this format)",
}
CLAIM_SPEEDUP = {"int8": 2.0, "int4": 3.0}
CLAIM_LOSS_PCT = {"int8": (0.0, 1.0), "int4": (3.0, 5.0)}


def arm(name: str) -> Arm:
    try:
        return ARMS[name]
    except KeyError:
        raise ConfigError(f"unknown arm {name!r}; choose from {sorted(ARMS)}") from None


def with_references(names: Sequence[str]) -> list[str]:
    """`names` in order, each quantized arm preceded by its one-knob reference
    (once). A full-precision arm's own reference (bf16's is float32) is not
    added: ask for it by name to compare the dtypes too."""
    return arms.with_references(ARMS, names, lambda a: a.quantized)


def arm_table(profile: Profile, names: Sequence[str]) -> pd.DataFrame:
    """Which arms of `names` (with their references) the profile can serve and
    why not (`lab_utils.arms.unavailable`), before starting anything."""
    rows = [{"arm": n, "title": a.title, "reference": a.reference or "", "weights": a.weights,
             "role": a.role or "", "model": role_reference(profile, a.role) or "",
             "flags": json.dumps(dict(a.flags)), "available": not arms.unavailable(profile, a),
             "skip_reason": arms.unavailable(profile, a)}
            for n, a in ((n, arm(n)) for n in with_references(names))]
    return pd.DataFrame(rows, columns=["arm", "title", "reference", "weights", "role", "model",
                                       "flags", "available", "skip_reason"]).set_index("arm")


def plan(profile: Profile, params: Mapping[str, Any], caps=None) -> arms.Plan:
    """The arms asked for (`params["arms"]`, or `default_arms`), each after its
    one-knob reference, without those this target cannot serve (noted with
    the probe's or the profile's reason: `lab_utils.arms.catalogue_plan`).
    Quantized arms are optional (a server that does not start is skipped).
    With no arm asked (remote) the served model is measured alone ("full")."""
    asked, notes = list(params.get("arms") or default_arms(profile, caps)), []
    if not asked:
        notes.append(f"no quantized arm on profile {profile.name!r}: the server's own weights "
                     "are measured alone (name arms to compare on a profile that starts them)")
        asked = ["full"]
    catalogue = {n: dataclasses.replace(a, optional=a.quantized) for n, a in ARMS.items()}
    return arms.catalogue_plan(
        "05_quantization", catalogue, asked, notes=notes, needs_reference=lambda a: a.quantized,
        why_not=lambda a: runnable_here(profile, a.name, caps) or arms.unavailable(profile, a))


def prepare_checkpoints(profile: Profile, names: Sequence[str], *,
                        progress: bool = True) -> pd.DataFrame:
    """The model each arm's role serves, its format and size: on the cpu
    profile the `lab_utils.quantize` checkpoints, built now if missing (first
    time ~10-60 s each, then cached), with their build record; a hub model's
    from the facts data (`lab_utils.weight_memory.checkpoint_table`)."""
    roles = dict.fromkeys(arm(n).role for n in names if arm(n).role)
    return checkpoint_table(profile, {r: role_reference(profile, r) for r in roles},
                            progress=progress)


def engine_for(ctx, a: Arm, *, planned: bool = True):
    """The engine of arm `a` (`ctx.arm`; `planned=False`: any arm, for
    Explore), or None (noted) if this target cannot serve it."""
    if not planned:
        why = runnable_here(ctx.profile, a.name) or arm_table(ctx.profile, [a.name]).loc[
            a.name, "skip_reason"]
        if why:
            print(f"arm {a.name!r} cannot run here: {why}")
            return None
    print(f"arm {a.name}: {a.title}" + (f" (model role {a.role!r})" if a.role else ""))
    return ctx.arm(a.name) if planned else ctx.any_engine(a.role, **dict(a.flags))


# --------------------------------------------------------------------------
# Pure helpers (unit-tested without a server)
# --------------------------------------------------------------------------

#: compare()'s columns: its name -> the summary column, for the arm and `_ref`.
PAIRED = {"ttft_ms": "ttft_ms_median", "tpot_ms": "tpot_ms_median", "itl_ms": "itl_ms_median",
          "decode_cpu_ms": "decode_cpu_ms", "prefill_cpu_ms": "prefill_cpu_ms",
          "cpu_share": "cpu_share", "checkpoint_mib": "checkpoint_mib",
          "step_read_mib": "step_read_mib",
          "model_loading_gib": "model_loading_gib", "rss_mib": "worker_rss_mib",
          "ppl": "perplexity", "accuracy": "accuracy"}
#: Speed-ups (reference / arm) of compare(), and the column each divides.
SPEEDUPS = {"tpot_speedup": "tpot_ms", "step_speedup": "itl_ms",
            "decode_cpu_speedup": "decode_cpu_ms", "prefill_cpu_speedup": "prefill_cpu_ms",
            # fewer bytes per step: the speed-up of a decode step bound by memory reads
            "read_speedup": "step_read_mib"}


def compare(summary: pd.DataFrame) -> pd.DataFrame:
    """Each measured arm against its one-knob reference (`PAIRED` columns,
    `_ref` for the reference's), the `SPEEDUPS`, the TTFT and perplexity
    change in %, the answers identical to the reference's and the same
    verdicts. `summary` is `summarize`'s table (arms as index)."""
    rows = []
    for name, row in summary.iterrows():
        ref = arm(name).reference
        if not ref or ref not in summary.index:
            continue
        r = summary.loc[ref]
        out = {"arm": name, "reference": ref, "claim": arm(name).claim or ""}
        for key, col in PAIRED.items():
            out[f"{key}_ref"], out[key] = r.get(col, math.nan), row.get(col, math.nan)
        for key, col in SPEEDUPS.items():
            out[key] = out[f"{col}_ref"] / out[col] if out[col] else math.nan
        out["ttft_change_pct"] = change_pct(out["ttft_ms_ref"], out["ttft_ms"])
        out["ppl_change_pct"] = change_pct(out["ppl_ref"], out["ppl"])
        out["identical_answers"] = row.get(f"identical_vs_{ref}", math.nan)
        out["same_verdict"] = row.get(f"same_verdict_vs_{ref}", math.nan)
        rows.append(out)
    return pd.DataFrame(rows).set_index("arm") if rows else pd.DataFrame()


def claim_verdict(claim: str | None, ppl_change_pct: float, *, compute_speedup: float = math.nan,
                  step_speedup: float = math.nan, tpot_speedup: float = math.nan,
                  read_speedup: float = math.nan) -> str:
    """One line: measured speed-up and perplexity change against the claim.

    Speed is judged on the decode compute (worker CPU time per decode step,
    which other work on a shared CPU delays but does not inflate) when it was
    measured, else on the median decode step (ITL); the wall-clock ratios are
    shown beside it, and `read_speedup` (the reference's weight bytes per step
    over the arm's) as what a step bound by memory reads alone would gain."""
    if claim not in CLAIM_SPEEDUP:
        return "no claim"
    want, (lo, hi) = CLAIM_SPEEDUP[claim], CLAIM_LOSS_PCT[claim]
    use_cpu = np.isfinite(compute_speedup)
    speed = compute_speedup if use_cpu else step_speedup
    basis = "decode compute" if use_cpu else "median decode step"
    shown = [("step", step_speedup), ("TPOT", tpot_speedup)] if use_cpu \
        else [("TPOT", tpot_speedup)]
    walls = [f"{n} {v:.2f}x" for n, v in shown if np.isfinite(v)]
    wall = f" (wall clock: {', '.join(walls)})" if walls else ""
    fast = "holds" if speed >= want * 0.95 else "does not hold"
    loss = "within" if ppl_change_pct <= hi else "above"
    claimed = f"< {hi:g}%" if not lo else f"{lo:g}-{hi:g}%"
    reads = (f"; {read_speedup:.2f}x fewer weight bytes per step (a step bound by memory "
             f"reads alone: {read_speedup:.2f}x faster)") if np.isfinite(read_speedup) else ""
    return (f"{basis} speed-up {speed:.2f}x{wall} vs claimed {want:.0f}x: {fast}{reads}; "
            f"perplexity {ppl_change_pct:+.1f}% vs claimed loss {claimed}: {loss} the claim")


# --------------------------------------------------------------------------
# Measuring (needs a server)
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Workload:
    """What every arm is measured with (built once, the same for all arms):
    completions of exactly `prompt_tokens` producing `output_tokens`, prefill-only
    ones of other text, perplexity windows and the number of questions."""
    latency: list[RequestSpec]
    prefill: list[RequestSpec]
    windows: list[list[int]]
    questions: int = 40
    answer_tokens: int = 24
    quality_concurrency: int = 8

    @property
    def output_tokens(self) -> int:
        return self.latency[0].max_tokens if self.latency else 0

    @classmethod
    def build(cls, tok: Tokenizer, *, requests: int = 4, prompt_tokens: int = 256,
              output_tokens: int = 32, ppl_windows: int = 2, ppl_tokens: int = 512,
              questions: int = 40, answer_tokens: int = 24,
              quality_concurrency: int = 8) -> Workload:
        def specs(out: int, seed: int) -> list[RequestSpec]:
            return synthetic_specs(tok, requests, prompt_tokens, max_tokens=out, seed=seed,
                                   tag="latency")
        return cls(specs(output_tokens, 500), specs(1, 900), text_windows(tok, ppl_windows,
                   ppl_tokens), questions, answer_tokens, quality_concurrency)


def measure_arm(ctx, a: Arm, work: Workload, *, progress: bool = True,
                planned: bool = True) -> dict[str, pd.DataFrame]:
    """One arm on one engine start: weight memory, a warm-up, perplexity,
    prefill-only then latency requests (`host.measured_compute`), greedy answers."""
    engine = engine_for(ctx, a, planned=planned)
    if engine is None:
        return {}
    memory = weight_memory(engine)
    read = step_weight_bytes(engine)  # what a memory-bound decode step must read
    memory["step_read_mib"] = None if read is None else read / 2**20
    warm_up(engine)  # not one of the measured prompts: a repeat would be a prefix-cache hit
    ppl = score_text(engine, work.windows).assign(arm=a.name)

    def run(specs, label, **meta):
        return lambda: measure(engine, specs, Load.sequential(), label=f"{a.name}/{label}",
                               results=ctx.results, progress=progress, arm=a.name, **meta)
    meta = {"weight_memory": memory, "perplexity": pooled_perplexity(ppl),
            "perplexity_windows": ppl.drop(columns="arm").to_dict("records")}
    _, lat, cost = measured_compute(engine, run(work.prefill, "prefill"),
                                    run(work.latency, "latency", **meta), len(work.latency),
                                    work.output_tokens)
    cost = {"arm": a.name, **cost}
    ctx.results.data["arms"][f"{a.name}/latency"]["compute"] = cost
    ctx.results.save()
    answers = greedy_answers(engine, work.questions, max_tokens=work.answer_tokens,
                             concurrency=work.quality_concurrency, label=f"{a.name}/answers",
                             results=ctx.results, progress=progress, arm=a.name)
    mem = pd.DataFrame([{"arm": a.name, **{k: v for k, v in memory.items() if k != "kernels"},
                         "kernels": ", ".join(memory.get("kernels", []))}])
    itl = pd.DataFrame({"arm": a.name,
                        "itl_ms": [g * 1e3 for r in lat.records if r.ok for g in r.itl]})
    return {"latency": lat.frame().assign(arm=a.name), "itl": itl, "perplexity": ppl,
            "answers": answers, "memory": mem, "compute": pd.DataFrame([cost])}


def run_arms(ctx, work: Workload, *, progress: bool = True) -> dict[str, pd.DataFrame]:
    """Every arm of the plan in order, one engine start each: concatenated
    frames. An arm the target cannot serve (`ctx.arm`) or that fails while
    measured is skipped and noted."""
    frames: dict[str, list[pd.DataFrame]] = {}
    for n in ctx.plan.names:
        try:
            got = measure_arm(ctx, arm(n), work, progress=progress)
        except (ServerError, RuntimeError) as exc:
            ctx.skip(n, f"failed: {str(exc).splitlines()[0][:300]}")
            got = {}
        for k, v in got.items():
            frames.setdefault(k, []).append(v)
    return {k: pd.concat(frames[k], ignore_index=True) if frames.get(k) else pd.DataFrame()
            for k in ("latency", "itl", "perplexity", "answers", "memory", "compute")}


def summarize(frames: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per arm: TTFT/TPOT median and p90 (ms), the pooled median gap
    between streamed tokens (ITL: the typical decode step), worker CPU ms per
    prefill and decode step and its share of the wall time, checkpoint MiB
    (its files, else vLLM's "Checkpoint size"), MiB of weights a decode step
    reads (`decode_floor.step_weight_bytes`), weights loaded (GiB, GPU),
    worker RSS, perplexity, accuracy, agreement with the reference and the first arm."""
    lat = frames.get("latency", pd.DataFrame())
    if lat.empty:
        return pd.DataFrame()
    g = lat[lat.ok.astype(bool)].groupby("arm", sort=False)
    out = pd.DataFrame({"requests": g.size(), "ttft_ms_median": g.ttft_ms.median(),
                        "ttft_ms_p90": g.ttft_ms.quantile(.9),
                        "tpot_ms_median": g.tpot_ms.median(),
                        "tpot_ms_p90": g.tpot_ms.quantile(.9)})
    itl = frames.get("itl", pd.DataFrame())
    for col, stat in (("itl_ms_median", .5), ("itl_ms_p90", .9)):
        out[col] = itl.groupby("arm").itl_ms.quantile(stat) if len(itl) else np.nan
    compute = frames.get("compute", pd.DataFrame())
    for col in ("prefill_cpu_ms", "decode_cpu_ms", "cpu_share"):
        out[col] = compute.set_index("arm")[col] if col in compute else np.nan
    mem = frames["memory"].set_index("arm")
    for col in ("checkpoint_mib", "step_read_mib", "model_loading_gib", "worker_rss_mib",
                "kv_cache_tokens"):
        out[col] = pd.to_numeric(mem[col], errors="coerce") if col in mem else np.nan
    if "checkpoint_gib" in mem:  # a hub model's files: vLLM's own figure
        out["checkpoint_mib"] = out.checkpoint_mib.fillna(
            pd.to_numeric(mem.checkpoint_gib, errors="coerce") * 1024)
    ppl = frames["perplexity"]
    out["perplexity"] = ppl.groupby("arm").apply(pooled_perplexity, include_groups=False)
    answers = frames["answers"]
    out["accuracy"] = answers.groupby("arm").correct.mean()
    for name in out.index:
        for other in filter(None, {arm(name).reference, out.index[0]} - {name}):
            ag = agreement(answers, name, other)
            out.loc[name, f"identical_vs_{other}"] = ag["identical"]
            out.loc[name, f"same_verdict_vs_{other}"] = ag["same_verdict"]
    return out


def explore_arm(ctx, name: str, work: Workload) -> pd.DataFrame:
    """Explore: measure one arm again (its engine is reused if it is the one
    running) and show its latency percentiles and perplexity."""
    got = measure_arm(ctx, arm(name), work, progress=False,
                      planned=ctx.plan.find(arm(name).role, arm(name).flags) is not None)
    if not got:
        return pd.DataFrame()
    table = got["latency"][["ttft_ms", "tpot_ms"]].describe(percentiles=[.5, .9, .99]).T
    table["perplexity"] = pooled_perplexity(got["perplexity"])
    table["accuracy"] = got["answers"].correct.mean()
    return table


# --------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------

def _fmt(value: Any, spec: str) -> str:
    """`value` formatted with `spec`, or "?" when it is missing (None/NaN)."""
    try:
        return "?" if value is None or not np.isfinite(value) else format(value, spec)
    except TypeError:
        return "?"


#: Below this share of its threads' time the worker waited for cores.
BUSY_SHARE = 0.8


def share_note(*shares: float) -> str:
    """What the worker's CPU shares (`host.measured_compute`) say of the run:
    below BUSY_SHARE other work held the cores and the wall-clock numbers are
    inflated; at or above it the worker had them."""
    known = [x for x in shares if isinstance(x, (int, float)) and math.isfinite(x)]
    if not known:
        return ""
    if min(known) < BUSY_SHARE:
        return f" (below {BUSY_SHARE:.0%}: other work on the machine held the cores)"
    return f" (at least {BUSY_SHARE:.0%}: the worker had its cores)"


def findings(comparison: pd.DataFrame, memory: pd.DataFrame,
             latency: pd.DataFrame | None = None, device: str = "") -> list[dict[str, Any]]:
    """The findings per quantized arm against its reference: TPOT, TTFT, worker
    compute per decode step and prefill (CPU), checkpoint size, weights loaded
    (GPU), perplexity, answer agreement; the mechanism cites vLLM's log. With
    `latency` (per-request rows) TTFT and TPOT carry a bootstrap interval. The
    first INT8 arm answers the checklist's quantization row, its reason citing
    what vLLM chose in this run on `device`, not a table written elsewhere."""
    mem = memory.set_index("arm") if len(memory) else pd.DataFrame()
    where = f" on {device}" if device else ""

    def samples(metric: str, name: str, ref: str) -> tuple | None:
        if latency is None or latency.empty:
            return None
        ok = latency[latency.ok.astype(bool)]
        pair = tuple(ok.loc[ok.arm == n, metric].dropna().to_numpy() for n in (ref, name))
        return pair if all(len(v) >= 2 for v in pair) else None

    out: list[dict[str, Any]] = []
    tagged = False
    for name, c in comparison.iterrows():
        a = arm(name)
        if not a.quantized:
            continue
        m = mem.loc[name] if name in mem.index else {}
        kernels = m.get("kernels") if isinstance(m.get("kernels"), str) else ""
        row: dict[str, Any] = {}
        if a.claim == "int8" and not tagged:
            tagged = True
            row = {"reason": f"{a.title} vs {c.reference}"
                             + (f" (vLLM here{where}: {kernels})" if kernels else where)}
        claim = CLAIMS[a.claim]
        evidence = (f"vLLM log: quantization={m.get('quantization', '?')}, dtype="
                    f"{m.get('dtype', '?')}, kernels: {kernels or '?'}; checkpoint "
                    f"{_fmt(c.checkpoint_mib, '.0f')} MiB vs {_fmt(c.checkpoint_mib_ref, '.0f')} "
                    "MiB")

        def add(metric, baseline, treated, tag=None, **kw):
            out.append({"technique": f"quantization: {a.title} vs {c.reference}",
                        "metric": metric, "baseline": baseline, "treated": treated,
                        "article_claim": kw.pop("article_claim", claim), **kw,
                        **({"checklist": f"quantization:{tag}", **row} if tag and row else {})})
        reads = getattr(c, "read_speedup", math.nan)
        add("TPOT median (ms)", c.tpot_ms_ref, c.tpot_ms, "tpot",
            mechanism=evidence + (f"; weights read per decode step "
                                  f"{_fmt(c.step_read_mib_ref, '.0f')} -> {_fmt(c.step_read_mib, '.0f')} "
                                  f"MiB: a step bound by memory reads would be {reads:.2f}x faster"
                                  if _fmt(reads, "f") != "?" else ""),
            samples=samples("tpot_ms", name, c.reference),
            verdict=claim_verdict(a.claim, c.ppl_change_pct, compute_speedup=c.decode_cpu_speedup,
                                  step_speedup=c.step_speedup, tpot_speedup=c.tpot_speedup,
                                  read_speedup=reads))
        add("TTFT median (ms)", c.ttft_ms_ref, c.ttft_ms, "ttft", mechanism=evidence,
            samples=samples("ttft_ms", name, c.reference))
        if _fmt(c.decode_cpu_ms, "f") != "?" and _fmt(c.decode_cpu_ms_ref, "f") != "?":
            share = (f"{evidence}; worker CPU time per worker thread over the wall time "
                     f"{_fmt(c.cpu_share_ref, '.0%')} -> {_fmt(c.cpu_share, '.0%')}"
                     + share_note(c.cpu_share_ref, c.cpu_share))
            add("decode compute: worker CPU ms per output token", c.decode_cpu_ms_ref,
                c.decode_cpu_ms, mechanism=share)
            add("prefill compute: worker CPU ms per prompt", c.prefill_cpu_ms_ref,
                c.prefill_cpu_ms, mechanism=share)
        add("checkpoint size on disk (MiB)", c.checkpoint_mib_ref, c.checkpoint_mib,
            article_claim="(implied: fewer weight bytes)",
            mechanism=f"worker RSS {_fmt(c.rss_mib_ref, '.0f')} -> {_fmt(c.rss_mib, '.0f')} MiB "
                      "(includes the KV cache and the runtime)")
        if _fmt(c.model_loading_gib, "f") != "?" and _fmt(c.model_loading_gib_ref, "f") != "?":
            add("weight memory vLLM loaded (GiB)", c.model_loading_gib_ref, c.model_loading_gib,
                article_claim="(implied: fewer weight bytes)",
                mechanism="vLLM log: 'Model loading took X GiB' (device memory of the weights)")
        add("perplexity of the fixed text", c.ppl_ref, c.ppl,
            mechanism="vLLM prompt_logprobs, same token ids")
        add("answers identical to the reference (share)", 1.0, c.identical_answers,
            mechanism=f"greedy answers; accuracy {_fmt(c.accuracy_ref, '.0%')} -> "
                      f"{_fmt(c.accuracy, '.0%')}, same verdict {_fmt(c.same_verdict, '.0%')}")
    return out


__all__ = [  # defined here, then the shared names the notebook reads from here
    "ARMS", "DEFAULT_ARMS", "CPU_CHOICE_PROBES", "CLAIMS", "CLAIM_SPEEDUP",
    "CLAIM_LOSS_PCT", "PAIRED", "SPEEDUPS", "Arm", "probe_name", "choose_cpu_arms",
    "default_arms", "runnable_here", "support_table", "arm", "with_references", "arm_table",
    "plan", "prepare_checkpoints", "served_tokenizer", "engine_for", "compare",
    "claim_verdict", "Workload", "measure_arm", "run_arms", "summarize", "explore_arm",
    "findings", "role_reference", "plot_latency", "plot_speed_vs_quality",
]
