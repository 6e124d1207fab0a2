"""Models derived from the embedded one, built once into the cache, offline.

`truncated_model(6)` keeps the first 6 of SmolLM2-135M-Instruct's 30 decoder
layers (plus its embeddings, final norm and tied output head) and saves them as
an ordinary Hugging Face folder that vLLM serves, e.g. as a speculative-decoding
draft or a "small tier" model. No training happens: the cut model reads the
hidden state of layer N as if it were the last layer's, so its predictions are
much worse than the full model's. That is the honest point of building it:
whatever it is used for, measure how often it agrees with the full model.

    python -m lab_utils.derived_models 6    # build (if needed) and print the folder
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from .paths import cache_dir, partial_dir, publish_dir

MARKER = "lab_derived.json"
WEIGHTS = "model.safetensors"
#: Files copied unchanged from the source folder (those that exist).
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt")
_LAYER_PREFIX = "model.layers."


def truncated_model_dir(num_layers: int, source: Path | None = None) -> Path:
    """Where `truncated_model(num_layers)` keeps its folder."""
    src = Path(source) if source is not None else _embedded_dir()
    return cache_dir() / "models" / f"{src.name}-{int(num_layers)}L"


def _embedded_dir() -> Path:
    from .model import embedded_model_dir
    return embedded_model_dir()


def kept_layers(num_layers: int, total_layers: int) -> list[int]:
    """Indices of the source layers a `num_layers`-layer truncation keeps (the first ones)."""
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    if num_layers > total_layers:
        raise ValueError(f"num_layers={num_layers} but the source model has only "
                         f"{total_layers} layers")
    return list(range(num_layers))


def rename_tensor(name: str, keep: Sequence[int]) -> str | None:
    """The tensor's name in the truncated model, or None if it is dropped.

    Layer tensors (`model.layers.<i>.…`) are kept when `i` is in `keep` and
    renumbered to their position in `keep`; every other tensor is kept as is."""
    if not name.startswith(_LAYER_PREFIX):
        return name
    index, _, rest = name[len(_LAYER_PREFIX):].partition(".")
    if not index.isdigit():
        return name
    new = {old: i for i, old in enumerate(keep)}.get(int(index))
    return None if new is None else f"{_LAYER_PREFIX}{new}.{rest}"


def truncated_config(config: dict, num_layers: int) -> dict:
    """The source `config.json` with `num_layers` layers (per-layer lists cut too)."""
    total = int(config["num_hidden_layers"])
    keep = kept_layers(num_layers, total)
    out = dict(config)
    out["num_hidden_layers"] = num_layers
    for key, value in config.items():  # e.g. layer_types in newer configs
        if isinstance(value, list) and len(value) == total and key != "architectures":
            out[key] = [value[i] for i in keep]
    out["_lab_derived_from"] = f"{config.get('_name_or_path') or 'source'}: first {num_layers} " \
                               f"of {total} layers"
    return out


def _source_digest(source: Path) -> str:
    """The source's weights identity: its own marker's digest, else size + mtime."""
    for name in ("lab_model.json", MARKER):
        marker = source / name
        if marker.is_file():
            try:
                return json.loads(marker.read_text())["weights_sha256"]
            except (ValueError, KeyError):
                pass
    st = (source / WEIGHTS).stat()
    return f"size={st.st_size},mtime={int(st.st_mtime)}"


def is_ready(folder: Path, num_layers: int | None = None) -> bool:
    """True if `folder` holds a finished derived model (marker + weights of the recorded size)."""
    marker = Path(folder) / MARKER
    try:
        info = json.loads(marker.read_text())
        weights = Path(folder) / WEIGHTS
        if num_layers is not None and info.get("num_layers") != num_layers:
            return False
        return weights.is_file() and weights.stat().st_size == info["weights_bytes"]
    except (OSError, ValueError, KeyError):
        return False


def build_truncated(source: Path, target: Path, num_layers: int) -> Path:
    """Write the first `num_layers` layers of the model in `source` to `target`.

    Works on any single-file safetensors folder of a decoder whose layers are
    named `model.layers.<i>.…` (Llama, Qwen2, Mistral …). Written into a
    temporary sibling folder and renamed at the end, so an interrupted build
    never leaves a half-written model behind."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text())
    new_config = truncated_config(config, num_layers)
    keep = kept_layers(num_layers, int(config["num_hidden_layers"]))
    tmp = partial_dir(target)
    try:
        tensors = {}
        with safe_open(str(source / WEIGHTS), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            for name in f.keys():
                new = rename_tensor(name, keep)
                if new is not None:
                    tensors[new] = f.get_tensor(name).contiguous()
        save_file(tensors, str(tmp / WEIGHTS), metadata=metadata)
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2))
        for name in COPIED:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
        weights = tmp / WEIGHTS
        (tmp / MARKER).write_text(json.dumps({
            "derived_from": str(source),
            "source_weights": _source_digest(source),
            "transform": f"layer truncation: kept layers {keep[0]}..{keep[-1]} of "
                         f"{config['num_hidden_layers']}, embeddings, final norm, output head",
            "num_layers": num_layers,
            "source_layers": int(config["num_hidden_layers"]),
            "tensors": len(tensors),
            "weights_bytes": weights.stat().st_size,
            "note": "No training: an untrained early exit. Measure its agreement with the "
                    "source model before relying on it.",
        }, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_dir(tmp, target, lambda t: is_ready(t, num_layers))


def truncated_model(num_layers: int, *, source: Path | None = None, force: bool = False) -> Path:
    """A layer-truncated copy of the embedded model (or of `source`), built once.

    Returns `cache_dir()/models/<source name>-<num_layers>L`; a finished folder
    (marker file present, weights of the recorded size) is reused as is."""
    src = Path(source) if source is not None else None
    if src is None:
        from .model import ensure_embedded_model
        src = ensure_embedded_model()
    target = truncated_model_dir(num_layers, src)
    if not force and is_ready(target, num_layers):
        return target
    return build_truncated(src, target, num_layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a layer-truncated copy of the "
                                                 "embedded model (cached).")
    parser.add_argument("num_layers", type=int, help="decoder layers to keep (the first N)")
    parser.add_argument("--force", action="store_true", help="build again even if present")
    args = parser.parse_args(argv)
    print(truncated_model(args.num_layers, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build_truncated", "is_ready", "kept_layers", "rename_tensor", "truncated_config",
           "truncated_model", "truncated_model_dir"]
