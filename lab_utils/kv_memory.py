"""KV-cache memory arithmetic: bytes per cached element and per token, the
tokens a byte budget holds in whole blocks, the requests that fit, and the
bytes one decode step must read. Pure functions of a model's geometry (its
`config.json`), used by `06_fp8_kv_cache` and by the plan checker's
estimates; vLLM does the same division (`kv_cache_utils.py`: budget ÷ bytes of
one block in all layers).
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GIB = 1 << 30

#: On vLLM's CPU build this variable overwrites `--kv-cache-memory-bytes`
#: (`platforms/cpu.py`), in whole GiB only.
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"

#: vLLM's KV block size when the flags set none: CacheConfig.DEFAULT_BLOCK_SIZE
#: on GPUs, 128 tokens on the CPU backend (vllm/platforms/cpu.py).
DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}

#: Bytes per element of the dtypes a model or its KV cache runs in.
ELEMENT_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
                  "half": 2, "fp16": 2}

# --------------------------------------------------------------------------
# Pure helpers (unit-tested without a server)
# --------------------------------------------------------------------------


def kv_element_bytes(kv_cache_dtype: str, model_dtype: str = "float32") -> int:
    """Bytes per cached K or V element: 1 for any fp8 format, else the model's
    dtype (`auto` stores the KV cache in the dtype the model runs in)."""
    kv = str(kv_cache_dtype).lower()
    if kv.startswith("fp8"):
        return 1
    if kv not in ("auto", *ELEMENT_BYTES):
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    dtype = str(model_dtype if kv == "auto" else kv).lower()
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"cannot size a {dtype!r} KV cache: give the model dtype explicitly "
                         f"(one of {sorted(ELEMENT_BYTES)})")
    return ELEMENT_BYTES[dtype]


@dataclass(frozen=True)
class KVGeometry:
    """What one token's KV cache holds: K and V for every layer and KV head."""
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * int(element_bytes)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KVGeometry:
        """From a Hugging Face `config.json` (Llama-style attention)."""
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
        return cls(int(config["num_hidden_layers"]),
                   int(config.get("num_key_value_heads") or heads), int(head_dim))


def kv_geometry(model_dir: str | Path) -> KVGeometry | None:
    """The KV geometry of a local model folder, or None (hub id, remote)."""
    path = Path(model_dir or "") / "config.json"
    if not model_dir or not path.is_file():
        return None
    return KVGeometry.from_config(json.loads(path.read_text()))


def expected_capacity_tokens(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Tokens a KV cache of `budget_bytes` holds: whole blocks of `block_size`
    tokens (vLLM divides the budget by the bytes of one block in all layers)."""
    if bytes_per_token <= 0 or block_size <= 0:
        raise ValueError("bytes_per_token and block_size must be positive")
    return int(budget_bytes) // (int(bytes_per_token) * int(block_size)) * int(block_size)


def blocks_needed(tokens: int, block_size: int) -> int:
    """KV blocks a sequence of `tokens` tokens occupies."""
    return -(-int(tokens) // int(block_size))


def requests_that_fit(capacity_tokens: int, block_size: int, prompt_tokens: int,
                      output_tokens: int) -> int:
    """How many requests of this shape can be in the cache at their full length."""
    per_request = blocks_needed(prompt_tokens + output_tokens, block_size)
    return (int(capacity_tokens) // int(block_size)) // per_request if per_request else 0


def byte_budget_profile(profile):
    """`profile` without VLLM_CPU_KVCACHE_SPACE in its servers' environment,
    so `--kv-cache-memory-bytes` counts; ConfigError when this process's own
    environment sets it (a local CPU server would inherit it)."""
    import dataclasses
    import os

    from .profiles import ConfigError
    if CPU_KV_ENV in os.environ and profile.device == "cpu" and not profile.is_remote:
        raise ConfigError(f"{CPU_KV_ENV} is set in this kernel's environment "
                          f"({os.environ[CPU_KV_ENV]!r}); vLLM's CPU build would use it instead "
                          "of --kv-cache-memory-bytes. Unset it and restart the kernel.")
    return dataclasses.replace(profile, env={k: v for k, v in profile.env.items()
                                             if k != CPU_KV_ENV})


def gib_to_bytes(gib: float) -> int:
    """A KV budget in GiB as the whole number of bytes vLLM's flag takes."""
    if not gib > 0:
        raise ValueError(f"the KV-cache budget must be > 0 GiB, got {gib!r}")
    return round(float(gib) * GIB)


def safetensors_parameters(model_dir: str | Path) -> int | None:
    """Parameter count of a local safetensors checkpoint, from the file headers only."""
    files = sorted(Path(model_dir or ".").glob("*.safetensors")) if model_dir else []
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(int(np.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")
    return total


def decode_step_traffic(weight_bytes: float, kv_bytes_per_token: float, context_tokens: int,
                        batch: int = 1) -> dict[str, float]:
    """Bytes one decode step must read at least: all weights once, plus the KV
    cache of every sequence in the batch, and the KV share of that traffic."""
    kv = float(kv_bytes_per_token) * int(context_tokens) * int(batch)
    total = float(weight_bytes) + kv
    return {"weights_mb": weight_bytes / 1e6, "kv_mb": kv / 1e6, "total_mb": total / 1e6,
            "kv_share_pct": kv / total * 100 if total else math.nan}


def predicted_capacity(geometry: KVGeometry, budget_bytes: int, block_size: int,
                       max_model_len: int, kv_dtypes: Sequence[str],
                       model_dtype: str = "float32"):
    """Per KV dtype, what a byte budget holds (a DataFrame indexed by dtype):
    bytes per token, tokens in whole blocks, and the maximum concurrency vLLM
    would report at `max_model_len` (tokens / max_model_len)."""
    import pandas as pd
    rows = {}
    for dtype in kv_dtypes:
        per_token = geometry.bytes_per_token(kv_element_bytes(dtype, model_dtype))
        tokens = expected_capacity_tokens(budget_bytes, per_token, block_size)
        rows[dtype] = {"bytes_per_token": per_token, "kv_cache_size_tokens": tokens,
                       "max_concurrency": tokens / max_model_len}
    return pd.DataFrame.from_dict(rows, orient="index")


def default_block_size(device: str) -> int:
    """vLLM's default KV block size on a device: 128 tokens on the CPU backend
    (`platforms/cpu.py`), 16 on GPUs."""
    return DEFAULT_BLOCK_SIZE.get(device, DEFAULT_BLOCK_SIZE["cuda"])
