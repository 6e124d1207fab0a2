"""vLLM's speculative decoding, for any notebook that turns it on.

- The `--speculative-config` of each proposer: n-gram prompt lookup
  (`ngram_config`, its method per device: `ngram_method`) and a draft model
  (`draft_model_config`, with `use_heterogeneous_vocab` where the draft's
  vocabulary size differs from the target's: `vocabularies_differ`), checked
  before an engine gets them.
- The draft model a profile names (`draft_source`: the profile's `draft`
  role, the served model itself, or the first N layers of the embedded model,
  which the lab derives): its folder is named without building it, so a plan
  can be printed first, and built before its engine starts (`ensure_draft`);
  `describe_draft` says what a local draft folder is.
- The counters and arithmetic of acceptance: vLLM's accepted tokens per draft
  position (`per_position_counts`, `per_position_rates`), the tokens one
  speculative step emits when each drafted token is accepted with
  probability alpha (`expected_tokens_per_step`), and the alpha at which a
  step of a given cost breaks even (`break_even_acceptance`).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .counters import counter_by_label
from .profiles import ConfigError, Profile

#: The one engine flag a speculative arm adds to its baseline.
SPEC_KNOB = "speculative_config"
#: vLLM's counter of accepted tokens per draft position (without `_total`).
PER_POS_FAMILY = "vllm:spec_decode_num_accepted_tokens_per_pos"
#: The n-gram proposer per device. vLLM 0.32 turns async scheduling off for
#: method "ngram" on CUDA but keeps it on for "ngram_gpu" (`NgramGPUTypes`,
#: vllm/config/vllm.py), so on cuda only "ngram_gpu" changes nothing but the
#: proposer; the CPU build schedules synchronously either way and runs "ngram".
NGRAM_METHODS = {"cuda": "ngram_gpu"}
#: The environment that keeps vLLM on its V1 model runner. vLLM 0.32 runs a
#: draft of another vocabulary (`use_heterogeneous_vocab`) only on the V1
#: runner and falls back to it by itself (`_get_v2_model_runner_unsupported_features`,
#: vllm/config/vllm.py), while an engine without one takes the V2 runner on
#: CUDA: every arm compared with such a draft pins V1 too.
V1_RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


# --------------------------------------------------------------------------
# The proposers' engine flags
# --------------------------------------------------------------------------

def ngram_method(profile: Profile) -> str:
    """The n-gram method an arm on this profile asks for (`NGRAM_METHODS`):
    "ngram_gpu" on cuda, "ngram" elsewhere."""
    return NGRAM_METHODS.get(profile.device, "ngram")


def ngram_config(k: int, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2,
                 method: str = "ngram") -> dict:
    """vLLM `speculative_config` for n-gram prompt lookup with `k` proposed
    tokens (`method` "ngram", or "ngram_gpu" on CUDA: `ngram_method`)."""
    _check_k(k)
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                         f"prompt_lookup_max ({prompt_lookup_max})")
    if method not in ("ngram", "ngram_gpu"):
        raise ValueError(f"n-gram method must be 'ngram' or 'ngram_gpu', got {method!r}")
    return {"method": method, "num_speculative_tokens": int(k),
            "prompt_lookup_max": int(prompt_lookup_max),
            "prompt_lookup_min": int(prompt_lookup_min)}


def draft_model_config(model: str, k: int, heterogeneous_vocab: bool = False) -> dict:
    """vLLM `speculative_config` for a draft model (a local folder or a hub
    id). `heterogeneous_vocab`: the draft's vocabulary size differs from the
    target's, which vLLM accepts only with `use_heterogeneous_vocab` (and
    greedy draft sampling, its default; vllm/config/speculative.py)."""
    _check_k(k)
    if not model:
        raise ValueError("a draft-model arm needs the draft model's path or hub id")
    out = {"model": str(model), "num_speculative_tokens": int(k)}
    if heterogeneous_vocab:
        out["use_heterogeneous_vocab"] = True
    return out


def vocabularies_differ(profile: Profile, draft: str) -> bool:
    """Whether the draft model `draft` (a path or hub id) has another
    vocabulary size than the profile's served model, by their facts
    (`lab_utils.facts`: models.toml or a local config.json); False when
    either is unknown (vLLM then checks at start-up)."""
    from .facts import model_facts
    target, other = model_facts(profile.model), model_facts(draft)
    return bool(target and other and target.vocab_size != other.vocab_size)


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= 16:
        raise ValueError(f"num_speculative_tokens must be an int in 1..16, got {k!r}")


# --------------------------------------------------------------------------
# Draft models
# --------------------------------------------------------------------------

def planned_model_path(profile: Profile, role: str | None) -> str:
    """Where the profile's model for `role` is (None: the served model), without
    building it: the embedded model and its layer cuts are folders the lab
    builds on first use (`ensure_draft` builds them before the engine starts)."""
    ref = profile.model if role is None else profile.models.get(role)
    if ref == "embedded":
        from .model import embedded_model_dir
        return str(embedded_model_dir())
    cut = re.fullmatch(r"embedded-(\d+)L", ref or "")
    if cut:
        from .derived_models import truncated_model_dir
        return str(truncated_model_dir(int(cut.group(1))))
    return profile.model_for(role)  # a hub id or a path: nothing to build


def draft_source(profile: Profile, draft: str, draft_layers: int = 6) -> tuple[str, str]:
    """(path or hub id, short name) of the draft model `draft` names; builds
    nothing, so a plan can name the folder before it exists.

    - "auto": the profile's `draft` role if it has one, else (embedded model) "truncated".
    - "truncated": the first `draft_layers` layers of the embedded model, built
      once by `lab_utils.derived_models.truncated_model` (`ensure_draft`).
    - "self": the served model itself (acceptance upper bound, no speed-up possible).
    - "profile": the profile's `draft` role (e.g. Qwen2.5-0.5B-Instruct on `gpu`).
    - anything else: used as the path or hub id itself.
    """
    if draft == "auto":
        if profile.models.get("draft"):
            draft = "profile"
        elif profile.model == "embedded":
            draft = "truncated"
        else:
            raise ConfigError(f"profile {profile.name!r} names no draft model: add `draft = "
                              "\"HUB_ID_OR_PATH\"` under [models] or pass draft='self'")
    if draft == "profile":
        path = planned_model_path(profile, "draft")
        return path, Path(path).name if Path(path).exists() else path.split("/")[-1]
    if draft == "self":
        if profile.is_remote:
            raise ConfigError("draft='self' needs the model path the server loads; the remote "
                              "profile does not know it")
        return planned_model_path(profile, None), "self"
    if draft == "truncated":
        if profile.model != "embedded":
            raise ConfigError(f"draft='truncated' cuts the embedded model; profile "
                              f"{profile.name!r} serves {profile.model!r}: use 'profile' or a path")
        from .derived_models import truncated_model_dir
        return str(truncated_model_dir(int(draft_layers))), f"{int(draft_layers)}L"
    return draft, Path(draft).name or draft


def ensure_draft(arm) -> None:
    """Build the draft folder a draft arm names (its `draft_path`) if the lab
    derives it (the embedded model, or its first N layers) and it is not built
    yet: vLLM reads the draft when its engine starts. Other arms and drafts:
    nothing to do."""
    path = getattr(arm, "draft_path", "")
    if not path:
        return
    from . import derived_models, model
    if Path(path) == model.embedded_model_dir():
        model.ensure_embedded_model()
        return
    cut = re.search(r"-(\d+)L$", path)
    if cut and Path(path) == derived_models.truncated_model_dir(int(cut.group(1))):
        derived_models.truncated_model(int(cut.group(1)))


def describe_draft(path: str) -> dict[str, Any]:
    """What a local draft folder is: its layer count and, for a model built by
    `lab_utils.derived_models`, the marker that says how it was derived."""
    folder = Path(path)
    if not folder.is_dir():
        return {"draft": path, "local": False}
    info: dict[str, Any] = {"draft": str(folder), "local": True}
    try:
        config = json.loads((folder / "config.json").read_text())
        info.update(layers=config.get("num_hidden_layers"), hidden=config.get("hidden_size"),
                    vocab=config.get("vocab_size"))
    except (OSError, ValueError):
        pass
    marker = folder / "lab_derived.json"
    if marker.is_file():
        info.update({k: v for k, v in json.loads(marker.read_text()).items()
                     if k in ("transform", "source_layers", "note")})
    weights = folder / "model.safetensors"
    if weights.is_file():
        info["weights_mb"] = round(weights.stat().st_size / 1e6, 1)
    return info


# --------------------------------------------------------------------------
# Acceptance: vLLM's counters, and the arithmetic of a speculative step
# --------------------------------------------------------------------------

def per_position_counts(metrics_text: str) -> dict[int, float]:
    """`vllm:spec_decode_num_accepted_tokens_per_pos_total` by draft position
    (summed over engines) from /metrics exposition text."""
    return {int(pos): n for pos, n in
            counter_by_label(metrics_text, PER_POS_FAMILY, "position").items()}


def per_position_rates(before: Mapping[int, float], after: Mapping[int, float],
                       drafts: float | None) -> list[float]:
    """Acceptance rate at each draft position: accepted at position i / drafts
    (vLLM's per-position vector). Empty without drafts."""
    if not drafts:
        return []
    return [(after[p] - before.get(p, 0.0)) / drafts for p in sorted(after)]


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one speculative step emits on average if every drafted token is
    accepted independently with probability `alpha` (Leviathan et al., 2023):
    (1 - alpha^(k+1)) / (1 - alpha); k+1 when alpha = 1."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def break_even_acceptance(step_cost_ratio: float, k: int) -> float:
    """The per-token acceptance `alpha` at which a speculative step that costs
    `step_cost_ratio` plain decode steps emits as many tokens as it costs
    (speculation neither helps nor hurts). nan if even alpha=1 cannot pay it."""
    if step_cost_ratio <= 1:
        return 0.0
    if step_cost_ratio > k + 1:
        return math.nan
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, k) < step_cost_ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


__all__ = [
    "NGRAM_METHODS",
    "PER_POS_FAMILY",
    "SPEC_KNOB",
    "V1_RUNNER_ENV",
    "break_even_acceptance",
    "describe_draft",
    "draft_model_config",
    "draft_source",
    "ensure_draft",
    "expected_tokens_per_step",
    "ngram_config",
    "ngram_method",
    "per_position_counts",
    "per_position_rates",
    "planned_model_path",
    "vocabularies_differ",
]
