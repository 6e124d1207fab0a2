"""What a running engine's weights take: the checkpoint's bytes on disk
(`checkpoint_bytes`), what vLLM's log of the start says about them (checkpoint
size, "Model loading took X GiB" on GPU runners, the quantization method,
dtype and linear kernels: `lab_utils.vllm_logs.parse_server_log`), the
resident memory of a local server's processes (`lab_utils.host.group_rss`),
and the KV-cache tokens it reported (`weight_memory`)."""
from __future__ import annotations

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


__all__ = ["checkpoint_bytes", "weight_memory"]
