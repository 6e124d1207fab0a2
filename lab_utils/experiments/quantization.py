"""Experiments of `05_quantization`: full-precision against quantized weights
on the same engine and workload, for latency (TTFT, TPOT), weight memory and
quality (perplexity of a fixed text, greedy answers to fixed questions).

Arms come from a catalogue (`ARMS`); each names the engine flags it layers on
the profile and, for a pre-quantized checkpoint, the profile model *role* that
serves it (`awq`, `gptq_int4`, ... as in `profiles/gpu.toml`). On the `cpu`
profile the roles are checkpoints of the embedded model that
`lab_utils.quantize` builds on this machine (round-to-nearest, no
calibration); `engine_for` builds them on demand until the profile names them.
Every quantized arm has a `reference` arm that differs from it in one knob:
the weights (same dtype, same model, same flags otherwise).

What this machine's vLLM build runs is not written here: it differs between
CPUs (AVX2-only builds have no 4-bit GEMM; bfloat16 is fast only with
AVX512-BF16). Each arm maps to a `lab_utils.capabilities` candidate; on the
`cpu` profile the default arms are chosen from that probe (the fastest
full-precision dtype as the reference) and an arm whose candidate did not run
here is skipped with the probe's reason.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .. import arms
from ..arms import ROLE
from ..client import Load, RequestSpec
from ..figures.quantization import plot_latency, plot_speed_vs_quality
from ..host import EngineCPU, compute_cost
from ..metrics import change_pct
from ..profiles import ConfigError, Profile
from ..quality import agreement, answer_specs, answers_frame, perplexity, score_text, text_windows
from ..results import measure
from ..server import ServerError
from ..weight_memory import weight_memory
from ..workloads import Tokenizer, local_tokenizer, synthetic_specs, tokenizer_for, warm_up

# --------------------------------------------------------------------------
# The arms
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arm:
    """One engine configuration. `role` None = the profile's main model."""
    name: str
    title: str
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    role: str | None = None
    reference: str | None = None      # the arm it differs from in one knob
    weights: str = "full"             # "full", "int8", "int4", "fp8"
    claim: str | None = None          # the article's claim it tests: "int8" / "int4"
    #: what it changes against `reference` (lab_utils.arms): a GPTQ/AWQ
    #: checkpoint is read only with its --quantization, so those move together
    knob: str | tuple[str, ...] | None = None

    @property
    def quantized(self) -> bool:
        return self.weights != "full"


_BF16 = {"dtype": "bfloat16"}
_CKPT = (ROLE, "quantization")

ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("full", "full precision (profile dtype)"),
    Arm("full_bf16", "full precision, bfloat16", dict(_BF16), reference="full", knob="dtype"),
    Arm("int8_w8a8", "W8A8-INT8 checkpoint", role="int8_w8a8", reference="full",
        weights="int8", claim="int8", knob=ROLE),
    Arm("int8_w8a8_bf16", "W8A8-INT8 checkpoint, bfloat16", dict(_BF16), role="int8_w8a8",
        reference="full_bf16", weights="int8", claim="int8", knob=ROLE),
    # vLLM 0.32's int8_per_channel_weight_only quantizes MoE experts only
    # (vllm/config/quantization.py: "linear stays unquantized"): on a dense
    # model like SmolLM2 or Qwen2.5 it changes no weight. Kept as a control.
    Arm("int8_online", "online INT8 weight-only (MoE layers only), profile dtype",
        {"quantization": "int8_per_channel_weight_only"}, reference="full", weights="int8-moe",
        knob="quantization"),
    Arm("int4_w4a16", "W4A16-INT4 checkpoint (profile dtype)", role="int4_w4a16",
        reference="full", weights="int4", claim="int4", knob=ROLE),
    Arm("int8_online_bf16", "online INT8 weight-only (MoE layers only), bfloat16",
        {**_BF16, "quantization": "int8_per_channel_weight_only"}, reference="full_bf16",
        weights="int8-moe", knob="quantization"),
    Arm("int4_w4a16_bf16", "W4A16-INT4 checkpoint, bfloat16", dict(_BF16), role="int4_w4a16",
        reference="full_bf16", weights="int4", claim="int4", knob=ROLE),
    Arm("gptq_int4_bf16", "GPTQ-format INT4 checkpoint, bfloat16",
        {**_BF16, "quantization": "gptq"}, role="gptq_int4", reference="full_bf16",
        weights="int4", claim="int4", knob=_CKPT),
    Arm("awq_bf16", "AWQ-format INT4 checkpoint, bfloat16", {**_BF16, "quantization": "awq"},
        role="awq", reference="full_bf16", weights="int4", claim="int4", knob=_CKPT),
    Arm("gptq_int8_bf16", "GPTQ-format INT8 checkpoint, bfloat16",
        {**_BF16, "quantization": "gptq"}, role="gptq_int8", reference="full_bf16",
        weights="int8", claim="int8", knob=_CKPT),
    Arm("int8_w8a16_bf16", "W8A16-INT8 checkpoint, bfloat16", dict(_BF16), role="int8_w8a16",
        reference="full_bf16", weights="int8", claim="int8", knob=ROLE),
    Arm("fp8_online_bf16", "online FP8 per channel (weights + dynamic activations), bfloat16",
        {**_BF16, "quantization": "fp8_per_channel"}, reference="full_bf16", weights="fp8",
        knob="quantization"),
    Arm("fp8_bf16", "FP8 checkpoint, bfloat16", dict(_BF16), role="fp8", reference="full_bf16",
        weights="fp8", knob=ROLE),
)}

#: The quantized arms a notebook run compares by default on GPUs (each brings
#: its reference): the gpu profile names real AWQ / GPTQ / FP8 checkpoints.
DEFAULT_ARMS: dict[str, list[str]] = {
    "cuda": ["awq_bf16", "gptq_int4_bf16", "gptq_int8_bf16", "fp8_bf16"],
    "remote": [],
}

#: The `lab_utils.capabilities` candidate that says whether an arm runs on
#: this CPU ("full" is the profile's dtype: see `probe_name`).
PROBE_OF: dict[str, str] = {
    "full_bf16": "bfloat16", "int8_w8a8": "w8a8", "int8_w8a8_bf16": "w8a8_bf16",
    "int4_w4a16": "w4a16", "int4_w4a16_bf16": "w4a16_bf16", "gptq_int4_bf16": "gptq_w4_bf16",
    "awq_bf16": "awq_w4_bf16", "gptq_int8_bf16": "gptq_w8_bf16",
    "int8_w8a16_bf16": "w8a16_bf16", "int8_online_bf16": "int8_online_bf16",
    "fp8_online_bf16": "fp8_online_bf16"}


def probe_name(profile: Profile, name: str) -> str | None:
    """The capability candidate of arm `name` on `profile` (None: no candidate)."""
    if name == "full":
        dtype = str(profile.engine.get("dtype", "float32"))
        return dtype if dtype in ("float32", "bfloat16") else None
    return PROBE_OF.get(name)


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
        from .. import capabilities
        caps = capabilities.probe(profile, CPU_CHOICE_PROBES)
    return choose_cpu_arms(caps)


def runnable_here(profile: Profile, name: str, caps=None) -> str:
    """"" if arm `name` runs on this machine (or nothing says otherwise), else the
    probe's reason (`caps`, or this machine's probe, run if needed)."""
    from .. import capabilities
    return capabilities.why_not(profile, probe_name(profile, name), caps)


def support_table(profile: Profile, names: Sequence[str] | None = None, caps=None) -> pd.DataFrame:
    """What this machine's vLLM build did with each arm's candidate
    (`lab_utils.capabilities.support_table`), titled with the machine."""
    from .. import capabilities
    return capabilities.support_table({n: (arm(n).title, probe_name(profile, n))
                                       for n in (names if names is not None else ARMS)}, caps)


#: On the `cpu` profile, the `lab_utils.quantize` recipe that builds each
#: role's checkpoint of the embedded model (profiles name them "quantized:<recipe>").
CPU_ROLE_RECIPES: dict[str, str] = {
    "int8_w8a8": "w8a8", "int4_w4a16": "w4a16", "int8_w8a16": "w8a16",
    "gptq_int4": "gptq_w4", "gptq_int8": "gptq_w8", "awq": "awq_w4"}

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
    out: list[str] = []
    for n in names:
        ref = arm(n).reference
        if arm(n).quantized and ref not in out:
            out.append(ref)
        if n not in out:
            out.append(n)
    return out


def role_model(profile: Profile, role: str | None) -> str | None:
    """What the profile serves for `role`: a `[models]` entry, the quantize
    recipe's reference on the cpu profile ("quantized:<recipe>"), or None."""
    if role is None:
        return profile.model
    if role in profile.models:
        return profile.models[role]
    if profile.device == "cpu" and role in CPU_ROLE_RECIPES:
        return f"quantized:{CPU_ROLE_RECIPES[role]}"
    return None


def arm_table(profile: Profile, names: Sequence[str]) -> pd.DataFrame:
    """Which arms of `names` (with their references) the profile can serve and
    why not: its models and flags, before starting anything."""
    rows = []
    for n in with_references(names):
        a = arm(n)
        model = role_model(profile, a.role)
        reason = ""
        if model is None:
            reason = f"profile {profile.name!r} names no model for role {a.role!r}"
        elif profile.is_remote and (a.role or a.flags):
            reason = "the remote server serves one model with fixed flags"
        rows.append({"arm": n, "title": a.title, "reference": a.reference or "",
                     "weights": a.weights, "role": a.role or "", "model": model or "",
                     "flags": json.dumps(dict(a.flags)), "available": not reason,
                     "skip_reason": reason})
    return pd.DataFrame(rows).set_index("arm")


def plan(profile: Profile, params: Mapping[str, Any], caps=None) -> arms.Plan:
    """The notebook's engines: the arms asked for (`params["arms"]`, or
    `default_arms`), each preceded by its one-knob reference, without the arms
    this target cannot serve (each in the plan's notes with the reason: this
    machine's probe, a role the profile has no model for, a remote server).
    The first arm is the baseline; a reference left out leaves its arms out."""
    asked = list(params.get("arms") or default_arms(profile, caps))
    notes, keep = [], []
    table = arm_table(profile, asked)
    for n in with_references(asked):
        why = runnable_here(profile, n, caps) or table.loc[n, "skip_reason"]
        ref = arm(n).reference if arm(n).quantized else None
        if not why and ref and ref not in keep:
            why = f"its reference {ref!r} cannot run here"
        if why:
            notes.append(f"arm {n!r} skipped: {why}")
        else:
            keep.append(n)
    out = []
    for i, n in enumerate(keep):
        a, ref, knob = arm(n), None, None
        if a.reference in keep[:i]:
            ref, knob = a.reference, a.knob
        elif i:  # e.g. float32 after bfloat16: compared the other way round
            back = next((m for m in keep[:i] if arm(m).reference == n), None)
            if back is None:
                raise ConfigError(f"arm {n!r} has no one-knob reference among {keep[:i]}: "
                                  f"ask for {a.reference!r} too")
            ref, knob = back, arm(back).knob
        out.append(arms.Arm(n, dict(a.flags), a.role, knob=knob, reference=ref, title=a.title))
    if not out:
        raise ConfigError(f"05_quantization: no arm of {asked} can run on profile "
                          f"{profile.name!r}: " + "; ".join(notes))
    return arms.Plan("05_quantization", tuple(out), notes=tuple(notes))


def _with_role(profile: Profile, role: str, model: str) -> Profile:
    return dataclasses.replace(profile, models={**profile.models, role: model})


def prepare_checkpoints(profile: Profile, names: Sequence[str], *,
                        progress: bool = True) -> pd.DataFrame:
    """The model each arm's role serves; on the cpu profile, build the missing
    `lab_utils.quantize` checkpoints now (first time ~10-60 s each, then cached)
    and show their build record (recipe, size, digest, build time)."""
    import time

    from .. import quantize
    rows = []
    for role in dict.fromkeys(arm(n).role for n in names if arm(n).role):
        ref = role_model(profile, role)
        row = {"role": role, "model": ref}
        if ref and ref.startswith("quantized:") and not profile.is_remote:
            recipe = ref.split(":", 1)[1]
            cached = quantize.is_ready(recipe)
            t0 = time.perf_counter()
            path = quantize.ensure_quantized_model(recipe, progress=progress)
            info = quantize.build_info(path)
            row.update(model=str(path), recipe=recipe, method=info.get("method"),
                       weights_mib=info.get("weights_bytes", 0) / 2**20,
                       sha256=info.get("weights_sha256", "")[:12],
                       build_s=info.get("build_seconds"),
                       this_call_s=round(time.perf_counter() - t0, 1), cached=cached)
        rows.append(row)
    return pd.DataFrame(rows).set_index("role") if rows else pd.DataFrame()


def workload_tokenizer(ctx) -> Tokenizer:
    """The main model's tokenizer, without starting an engine on local
    profiles (every arm serves the same tokenizer)."""
    if not ctx.profile.is_remote:
        return local_tokenizer(ctx.profile.model_for())
    return tokenizer_for(ctx.engine())


def engine_for(ctx, a: Arm, *, progress: bool = True, planned: bool = True):
    """Start (or reuse) the engine of arm `a` (`ctx.arm`: one of the plan's,
    or, `planned=False`, any arm for Explore), or None (noted) if this target
    cannot serve it. On the cpu profile a role the profile does not name yet is
    built with `lab_utils.quantize` and added to the profile in memory."""
    profile = ctx.profile
    if not planned:
        why = runnable_here(profile, a.name) or arm_table(profile, [a.name]).loc[a.name,
                                                                               "skip_reason"]
        if why:
            print(f"arm {a.name!r} cannot run here: {why}")
            return None
    if a.role and a.role not in profile.models:
        from .. import quantize
        recipe = CPU_ROLE_RECIPES[a.role]
        if not quantize.is_ready(recipe):
            print(f"building the {recipe!r} checkpoint once (RTN, cached under "
                  f"{quantize.quantized_model_dir(recipe).parent}) ...")
        path = quantize.ensure_quantized_model(recipe, progress=progress)
        ctx.profile = ctx.engines.profile = _with_role(profile, a.role, str(path))
    print(f"arm {a.name}: {a.title}" + (f" (model role {a.role!r})" if a.role else ""))
    if planned:
        return ctx.arm(a.name)
    return ctx.any_engine(a.role, **dict(a.flags))


# --------------------------------------------------------------------------
# Pure helpers (unit-tested without a server)
# --------------------------------------------------------------------------

def compare(summary: pd.DataFrame) -> pd.DataFrame:
    """Each measured arm against its one-knob reference: TTFT/TPOT medians and
    speed-ups, checkpoint size, RSS, perplexity change, accuracy and agreement.
    `summary` is `summarize`'s table (arms as index)."""
    rows = []
    for name, row in summary.iterrows():
        ref = arm(name).reference
        if not ref or ref not in summary.index:
            continue
        r = summary.loc[ref]
        rows.append({
            "arm": name, "reference": ref, "claim": arm(name).claim or "",
            "ttft_ms_ref": r.ttft_ms_median, "ttft_ms": row.ttft_ms_median,
            "ttft_change_pct": change_pct(r.ttft_ms_median, row.ttft_ms_median),
            "tpot_ms_ref": r.tpot_ms_median, "tpot_ms": row.tpot_ms_median,
            "tpot_speedup": r.tpot_ms_median / row.tpot_ms_median
            if row.tpot_ms_median else math.nan,
            "itl_ms_ref": r.itl_ms_median, "itl_ms": row.itl_ms_median,
            "step_speedup": r.itl_ms_median / row.itl_ms_median
            if row.itl_ms_median else math.nan,
            "decode_cpu_ms_ref": r.decode_cpu_ms, "decode_cpu_ms": row.decode_cpu_ms,
            "decode_cpu_speedup": r.decode_cpu_ms / row.decode_cpu_ms
            if row.decode_cpu_ms else math.nan,
            "prefill_cpu_ms_ref": r.prefill_cpu_ms, "prefill_cpu_ms": row.prefill_cpu_ms,
            "prefill_cpu_speedup": r.prefill_cpu_ms / row.prefill_cpu_ms
            if row.prefill_cpu_ms else math.nan,
            "cpu_share_ref": r.cpu_share, "cpu_share": row.cpu_share,
            "checkpoint_mib_ref": r.checkpoint_mib, "checkpoint_mib": row.checkpoint_mib,
            "rss_mib_ref": r.worker_rss_mib, "rss_mib": row.worker_rss_mib,
            "ppl_ref": r.perplexity, "ppl": row.perplexity,
            "ppl_change_pct": change_pct(r.perplexity, row.perplexity),
            "accuracy_ref": r.accuracy, "accuracy": row.accuracy,
            "identical_answers": row.get(f"identical_vs_{ref}", math.nan),
            "same_verdict": row.get(f"same_verdict_vs_{ref}", math.nan),
        })
    return pd.DataFrame(rows).set_index("arm") if rows else pd.DataFrame()


def claim_verdict(claim: str | None, ppl_change_pct: float, *, compute_speedup: float = math.nan,
                  step_speedup: float = math.nan, tpot_speedup: float = math.nan) -> str:
    """One line: measured speed-up and perplexity change against the claim.

    Speed is judged on the decode compute (worker CPU time per decode step,
    which other work on a shared CPU delays but does not inflate) when it was
    measured, else on the median decode step (ITL); the wall-clock ratios are
    shown beside it."""
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
    return (f"{basis} speed-up {speed:.2f}x{wall} vs claimed {want:.0f}x: {fast}; "
            f"perplexity {ppl_change_pct:+.1f}% vs claimed loss {claimed}: {loss} the claim")


# --------------------------------------------------------------------------
# Talking to the server
# --------------------------------------------------------------------------

def latency_specs(tok: Tokenizer, n: int, prompt_tokens: int, output_tokens: int,
                  seed: int = 500) -> list[RequestSpec]:
    """`n` completions requests of exactly `prompt_tokens` tokens (different
    text each, the same for every arm) producing exactly `output_tokens`."""
    return synthetic_specs(tok, n, prompt_tokens, max_tokens=output_tokens, seed=seed,
                           tag="latency")


# --------------------------------------------------------------------------
# Measuring (needs a server)
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Workload:
    """What every arm is measured with (built once, identical for all arms)."""
    latency: list[RequestSpec]
    prefill: list[RequestSpec]        # same lengths, other text, one output token
    windows: list[list[int]]
    questions: list[RequestSpec]
    quality_concurrency: int = 8

    @property
    def output_tokens(self) -> int:
        return self.latency[0].max_tokens if self.latency else 0

    @classmethod
    def build(cls, tok: Tokenizer, *, requests: int = 4, prompt_tokens: int = 256,
              output_tokens: int = 32, ppl_windows: int = 2, ppl_tokens: int = 512,
              questions: int = 40, answer_tokens: int = 24,
              quality_concurrency: int = 8) -> Workload:
        return cls(latency_specs(tok, requests, prompt_tokens, output_tokens),
                   latency_specs(tok, requests, prompt_tokens, 1, seed=900),
                   text_windows(tok, ppl_windows, ppl_tokens),
                   answer_specs(questions, answer_tokens), quality_concurrency)


def measure_arm(ctx, a: Arm, work: Workload, *, progress: bool = True,
                planned: bool = True) -> dict[str, pd.DataFrame]:
    """All measurements of one arm on one engine start: weight memory, one
    warm-up request, perplexity windows, sequential latency requests, and the
    quality questions (a few in flight: answers are greedy either way)."""
    engine = engine_for(ctx, a, progress=progress, planned=planned)
    if engine is None:
        return {}
    memory = weight_memory(engine)
    warm_up(engine)  # not one of the measured prompts: a repeat would be a prefix-cache hit
    ppl = score_text(engine, work.windows).assign(arm=a.name)
    ppl_total = perplexity(ppl.nll_sum.sum(), int(ppl.tokens.sum()))
    with EngineCPU(engine) as pre_cpu:
        pre = measure(engine, work.prefill, Load.sequential(), label=f"{a.name}/prefill",
                      results=ctx.results, progress=progress, arm=a.name)
    with EngineCPU(engine) as lat_cpu:
        lat = measure(engine, work.latency, Load.sequential(), label=f"{a.name}/latency",
                      results=ctx.results, progress=progress, arm=a.name,
                      weight_memory=memory, perplexity=ppl_total,
                      perplexity_windows=ppl.drop(columns="arm").to_dict("records"))
    # The worker's CPU time is the compute the arm really used (other work on a
    # shared CPU delays it, does not inflate it); not on a GPU, nor remote.
    prefill_cpu, total_cpu = ((pre_cpu.worker_cpu_s, lat_cpu.worker_cpu_s)
                              if engine.profile.device == "cpu" and pre_cpu.pgid else (None, None))
    wall = sum(r.e2e or 0.0 for r in lat.records)
    cost = {"arm": a.name, **compute_cost(prefill_cpu, total_cpu, len(work.latency),
                                          work.output_tokens),
            "prefill_ttft_ms": pre.frame().ttft_ms.median(),
            "cpu_share": total_cpu / wall if total_cpu is not None and wall else math.nan}
    ctx.results.data["arms"][f"{a.name}/latency"]["compute"] = cost
    ctx.results.save()
    ans = measure(engine, work.questions, Load.concurrent(work.quality_concurrency),
                  label=f"{a.name}/answers", results=ctx.results, progress=progress, arm=a.name)
    answers = answers_frame(ans.records, arm=a.name)
    mem = pd.DataFrame([{"arm": a.name, **{k: v for k, v in memory.items() if k != "kernels"},
                         "kernels": ", ".join(memory.get("kernels", []))}])
    itl = pd.DataFrame({"arm": a.name,
                        "itl_ms": [g * 1e3 for r in lat.records if r.ok for g in r.itl]})
    return {"latency": lat.frame().assign(arm=a.name), "itl": itl, "perplexity": ppl,
            "answers": answers, "memory": mem, "compute": pd.DataFrame([cost])}


def run_arms(ctx, work: Workload, *, progress: bool = True) -> dict[str, pd.DataFrame]:
    """Every arm of the notebook's plan, one engine start each, in order.
    Returns concatenated frames: latency, perplexity, answers, memory. Arms
    the target cannot serve are skipped and noted."""
    frames: dict[str, list[pd.DataFrame]] = {"latency": [], "itl": [], "perplexity": [],
                                             "answers": [], "memory": [], "compute": []}
    for n in ctx.plan.names:
        try:
            got = measure_arm(ctx, arm(n), work, progress=progress)
        except (ServerError, RuntimeError) as exc:
            msg = f"arm {n!r} failed: {str(exc).splitlines()[0][:300]}"
            ctx.results.note(msg)
            print(msg)
            got = {}
        for k, v in got.items():
            frames[k].append(v)
    return {k: pd.concat(v, ignore_index=True) if v else pd.DataFrame() for k, v in frames.items()}


def summarize(frames: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per arm: TTFT/TPOT median and p90 (ms), the median gap between
    streamed tokens (ITL, pooled over the requests: the typical decode step,
    robust to a few steps slowed down by other work on a shared machine),
    worker CPU ms per prefill and per decode step (the compute, which a busy
    machine delays but does not inflate) and the worker's share of the wall
    time (1 = it had a core to itself), checkpoint MiB, worker RSS MiB,
    perplexity, accuracy, and agreement with each arm's reference and with
    the first arm."""
    lat = frames.get("latency", pd.DataFrame())
    if lat.empty:
        return pd.DataFrame()
    ok = lat[lat.ok.astype(bool)]
    g = ok.groupby("arm", sort=False)
    out = pd.DataFrame({"requests": g.size(),
                        "ttft_ms_median": g.ttft_ms.median(),
                        "ttft_ms_p90": g.ttft_ms.quantile(.9),
                        "tpot_ms_median": g.tpot_ms.median(),
                        "tpot_ms_p90": g.tpot_ms.quantile(.9)})
    itl = frames.get("itl", pd.DataFrame())
    if len(itl):
        out["itl_ms_median"] = itl.groupby("arm").itl_ms.median()
        out["itl_ms_p90"] = itl.groupby("arm").itl_ms.quantile(.9)
    else:
        out["itl_ms_median"] = out["itl_ms_p90"] = np.nan
    compute = frames.get("compute", pd.DataFrame())
    for col in ("prefill_cpu_ms", "decode_cpu_ms", "cpu_share"):
        out[col] = compute.set_index("arm")[col] if col in compute else np.nan
    mem = frames["memory"].set_index("arm")
    for col in ("checkpoint_mib", "worker_rss_mib", "kv_cache_tokens"):
        out[col] = mem.get(col, np.nan)
    ppl = frames["perplexity"]
    out["perplexity"] = ppl.groupby("arm").apply(
        lambda d: perplexity(d.nll_sum.sum(), int(d.tokens.sum())), include_groups=False)
    answers = frames["answers"]
    out["accuracy"] = answers.groupby("arm").correct.mean()
    for name in out.index:
        ref = arm(name).reference
        for other in filter(None, {ref, out.index[0]} - {name}):
            ag = agreement(answers, name, other)
            out.loc[name, f"identical_vs_{other}"] = ag["identical"]
            out.loc[name, f"same_verdict_vs_{other}"] = ag["same_verdict"]
    return out


# --------------------------------------------------------------------------
# Support check and Explore
# --------------------------------------------------------------------------

def explore_arm(ctx, name: str, work: Workload) -> pd.DataFrame:
    """Explore: measure one arm again (its engine is reused if it is the one
    running) and show its latency percentiles and perplexity."""
    got = measure_arm(ctx, arm(name), work, progress=False,
                      planned=ctx.plan.find(arm(name).role, arm(name).flags) is not None)
    if not got:
        return pd.DataFrame()
    lat = got["latency"]
    table = lat[["ttft_ms", "tpot_ms"]].describe(percentiles=[.5, .9, .99]).T
    table["perplexity"] = perplexity(got["perplexity"].nll_sum.sum(),
                                     int(got["perplexity"].tokens.sum()))
    table["accuracy"] = got["answers"].correct.mean()
    return table


# --------------------------------------------------------------------------
# Findings and figures
# --------------------------------------------------------------------------

def _fmt(value: Any, spec: str) -> str:
    """`value` formatted with `spec`, or "?" when it is missing (None/NaN)."""
    try:
        return "?" if value is None or not np.isfinite(value) else format(value, spec)
    except TypeError:
        return "?"


def findings(comparison: pd.DataFrame, memory: pd.DataFrame,
             latency: pd.DataFrame | None = None) -> list[dict[str, Any]]:
    """The notebook's findings (`Results.add_findings`), per quantized arm against its reference: TPOT, TTFT, worker
    compute per decode step and per prefill (CPU profile), checkpoint size,
    perplexity and answer agreement; the mechanism cites vLLM's log
    (quantization method and linear kernel), the weight bytes and the worker's
    CPU share. With `latency` (per-request rows: arm, ok, ttft_ms, tpot_ms) the
    TTFT and TPOT findings carry a bootstrap interval of their change."""
    mem = memory.set_index("arm") if len(memory) else pd.DataFrame()
    # The reason cites what vLLM chose in this run (its log), not a table.
    support = {n: f"vLLM here: {r.get('kernels')}" for n, r in mem.iterrows()
               if isinstance(r.get("kernels"), str) and r.get("kernels")} if len(mem) else {}

    def samples(metric: str, name: str, ref: str) -> tuple | None:
        if latency is None or latency.empty:
            return None
        ok = latency[latency.ok.astype(bool)]
        pair = tuple(ok.loc[ok.arm == n, metric].dropna().to_numpy() for n in (ref, name))
        return pair if all(len(v) >= 2 for v in pair) else None

    # The checklist's quantization row is answered by the first INT8 arm (the
    # article's table has one row for quantization; INT8 is its first claim).
    out: list[dict[str, Any]] = []
    tagged = False
    for name, c in comparison.iterrows():
        a = arm(name)
        if not a.quantized:
            continue
        row: dict[str, Any] = {}
        if a.claim == "int8" and not tagged:
            tagged = True
            row = {"reason": f"{a.title} vs {c.reference}"
                             + (f" ({support[name]})" if support.get(name) else "")}
        claim = CLAIMS[a.claim]
        m = mem.loc[name] if name in mem.index else {}
        evidence = (f"vLLM log: quantization={m.get('quantization', '?')}, dtype="
                    f"{m.get('dtype', '?')}, kernels: {m.get('kernels') or '?'}; checkpoint "
                    f"{_fmt(c.checkpoint_mib, '.0f')} MiB vs "
                    f"{_fmt(c.checkpoint_mib_ref, '.0f')} MiB")
        tech = f"quantization: {a.title} vs {c.reference}"

        def add(metric, baseline, treated, tech=tech, **kw):
            out.append(dict(technique=tech, metric=metric, baseline=baseline, treated=treated,
                            **kw))
        add("TPOT median (ms)", c.tpot_ms_ref, c.tpot_ms,
                            article_claim=claim, mechanism=evidence,
                            samples=samples("tpot_ms", name, c.reference),
                            verdict=claim_verdict(a.claim, c.ppl_change_pct,
                                                  compute_speedup=c.decode_cpu_speedup,
                                                  step_speedup=c.step_speedup,
                                                  tpot_speedup=c.tpot_speedup),
                            **({"checklist": "quantization:tpot", **row} if row else {}))
        add("TTFT median (ms)", c.ttft_ms_ref, c.ttft_ms,
                            article_claim=claim, mechanism=evidence,
                            samples=samples("ttft_ms", name, c.reference),
                            **({"checklist": "quantization:ttft", **row} if row else {}))
        if _fmt(c.decode_cpu_ms, "f") != "?" and _fmt(c.decode_cpu_ms_ref, "f") != "?":
            share = (f"worker CPU share of the wall time {_fmt(c.cpu_share_ref, '.0%')} -> "
                     f"{_fmt(c.cpu_share, '.0%')} (well below 100%: other work on the machine "
                     "delayed it)")
            add("decode compute: worker CPU ms per output token",
                                c.decode_cpu_ms_ref, c.decode_cpu_ms, article_claim=claim,
                                mechanism=f"{evidence}; {share}")
            add("prefill compute: worker CPU ms per prompt",
                                c.prefill_cpu_ms_ref, c.prefill_cpu_ms, article_claim=claim,
                                mechanism=f"{evidence}; {share}")
        add("checkpoint size on disk (MiB)", c.checkpoint_mib_ref,
                            c.checkpoint_mib, article_claim="(implied: fewer weight bytes)",
                            mechanism=f"worker RSS {_fmt(c.rss_mib_ref, '.0f')} -> "
                                      f"{_fmt(c.rss_mib, '.0f')} MiB "
                                      "(includes the KV cache and the runtime)")
        add("perplexity of the fixed text", c.ppl_ref, c.ppl,
                            article_claim=claim, mechanism="vLLM prompt_logprobs, same token ids")
        add("answers identical to the reference (share)", 1.0,
                            c.identical_answers, article_claim=claim,
                            mechanism=f"greedy answers; accuracy {_fmt(c.accuracy_ref, '.0%')}"
                                      f" -> {_fmt(c.accuracy, '.0%')}, same verdict "
                                      f"{_fmt(c.same_verdict, '.0%')}")
    return out


__all__ = [  # defined here, then the shared names the notebook reads from here
    "ARMS", "DEFAULT_ARMS", "PROBE_OF", "CPU_CHOICE_PROBES", "CPU_ROLE_RECIPES", "CLAIMS",
    "CLAIM_SPEEDUP", "CLAIM_LOSS_PCT", "Arm", "probe_name", "choose_cpu_arms", "default_arms",
    "runnable_here", "support_table", "arm", "with_references", "role_model", "arm_table",
    "plan", "prepare_checkpoints", "workload_tokenizer", "engine_for", "compare",
    "claim_verdict", "latency_specs", "Workload", "measure_arm", "run_arms", "summarize",
    "explore_arm", "findings",
    "plot_latency", "plot_speed_vs_quality",
]
