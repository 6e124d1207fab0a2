"""What a running engine's weights take: the checkpoint's bytes on disk
(`checkpoint_bytes`), what vLLM's log of the start says about them (checkpoint
size, "Model loading took X GiB" on GPU runners, the quantization method,
dtype and linear kernels: `lab_utils.vllm_logs.parse_server_log`), the
resident memory of a local server's processes (`lab_utils.host.group_rss`),
and the KV-cache tokens it reported (`weight_memory`); and, before any engine
starts, the checkpoint each model role serves (`checkpoint_table`: the lab's
quantized builds, or a hub model's format and size from the facts data)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .host import group_rss
from .vllm_logs import parse_server_log


def checkpoint_bytes(model_dir: str | Path) -> int | None:
    """Bytes of the weight files of a local model folder (None for hub ids)."""
    path = Path(model_dir)
    if not path.is_dir():
        return None
    files = list(path.glob("*.safetensors")) or list(path.glob("*.bin"))
    return sum(f.stat().st_size for f in files) or None


def weight_memory(engine) -> dict[str, Any]:
    """Weight memory of a running arm: checkpoint bytes on disk, what vLLM's
    log says (checkpoint size, "Model loading took" on GPU runners, kernels),
    and the resident memory of its processes (local servers only)."""
    out: dict[str, Any] = {"model": engine.model_path or engine.model}
    size = checkpoint_bytes(engine.model_path) if engine.model_path else None
    out["checkpoint_mib"] = size / 2**20 if size else None
    if engine.server is not None:
        try:
            out.update(parse_server_log(Path(engine.server.log_path).read_text(errors="replace")))
        except OSError:
            pass
        if engine.server.proc is not None:
            out.update(group_rss(engine.server.proc.pid))
    cache = engine.info.get("cache_config", {}) if engine.info else {}
    if "kv_cache_tokens" not in out and cache.get("num_gpu_blocks") and cache.get("block_size"):
        out["kv_cache_tokens"] = int(cache["num_gpu_blocks"]) * int(cache["block_size"])
    return out


def checkpoint_table(profile, refs, *, progress: bool = True):
    """One row per role of `refs` {role: the profile's model reference}: a
    `quantized:<recipe>` checkpoint is built now if missing (on local
    profiles) and shows its build record (recipe, method, size, digest, build
    time); any other model its format and estimated weights from the facts
    data (`lab_utils.facts`; a hub model's checkpoint is not on disk here)."""
    import pandas as pd

    from .facts import model_facts
    from .quantize import build_info, ensure_quantized_model, is_ready
    rows = []
    for role, ref in refs.items():
        row = {"role": role, "model": ref}
        if ref and ref.startswith("quantized:") and not profile.is_remote:
            name = ref.split(":", 1)[1]
            cached, t0 = is_ready(name), time.perf_counter()
            path = ensure_quantized_model(name, progress=progress)
            info = build_info(path)
            row.update(model=str(path), recipe=name, method=info.get("method"),
                       weights_mib=info.get("weights_bytes", 0) / 2**20,
                       sha256=info.get("weights_sha256", "")[:12],
                       build_s=info.get("build_seconds"),
                       this_call_s=round(time.perf_counter() - t0, 1), cached=cached)
        elif (facts := model_facts(ref)) is not None:
            row.update(method=facts.quantization, bits=facts.quant_bits,
                       weights_mib_estimate=round(facts.weight_bytes() / 2**20),
                       source="facts data (lab_utils/profiles/facts/models.toml), not measured")
        rows.append(row)
    return pd.DataFrame(rows).set_index("role") if rows else pd.DataFrame()


__all__ = ["checkpoint_bytes", "checkpoint_table", "weight_memory"]
