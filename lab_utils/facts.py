"""Device and model figures kept as data beside the profiles
(`lab_utils/profiles/facts/devices.toml`, `models.toml`), each with where it
came from, and the first-principles arithmetic on them: parameter count and
weight bytes from a model's geometry, its KV geometry (`lab_utils.kv_memory`),
prefill time as FLOPs over peak compute and a decode step as bytes over memory
bandwidth. The plan checker (`lab_utils.plan`) sizes engines with these
without hub access or a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .kv_memory import ELEMENT_BYTES, GIB, KVGeometry, safetensors_parameters
from .profiles import PROFILES_DIR, ConfigError

FACTS_DIR = PROFILES_DIR / "facts"
#: The bits of an unquantized weight in `ModelFacts.quant_bits`.
FULL_PRECISION = 16


@dataclass(frozen=True)
class Device:
    """One GPU's datasheet figures (`devices.toml`)."""
    name: str
    title: str
    memory_gib: float
    memory_bandwidth_bytes_s: float
    bf16_dense_flops: float
    fp8_dense_flops: float      # 0: no FP8 Tensor Cores
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    def prefill_seconds(self, flops: float, fp8: bool = False) -> float:
        """The time `flops` of matrix multiplies take at this device's dense
        peak (FP8 where asked for and the device has it, else BF16)."""
        peak = self.fp8_dense_flops if fp8 and self.fp8_dense_flops else self.bf16_dense_flops
        return float(flops) / peak

    def read_seconds(self, nbytes: float) -> float:
        """The time reading `nbytes` from device memory takes at full bandwidth."""
        return float(nbytes) / self.memory_bandwidth_bytes_s

    def summary(self) -> str:
        fp8 = (f", {self.fp8_dense_flops / 1e12:,.0f} TFLOP/s fp8"
               if self.fp8_dense_flops else ", no fp8")
        return (f"{self.title}: {self.memory_gib:g} GiB, "
                f"{self.memory_bandwidth_bytes_s / 1e12:.2f} TB/s, "
                f"{self.bf16_dense_flops / 1e12:,.0f} TFLOP/s bf16 dense{fp8} ({self.source})")


@functools.cache
def devices() -> dict[str, Device]:
    data = tomllib.loads((FACTS_DIR / "devices.toml").read_text())
    return {name: Device(name=name, **entry) for name, entry in data.items()}


def device(name: str) -> Device:
    """The device `name` names, or ConfigError listing the known ones."""
    try:
        return devices()[name]
    except KeyError:
        raise ConfigError(f"unknown GPU {name!r}; choose one of {sorted(devices())} (or add it "
                          f"to {FACTS_DIR / 'devices.toml'} with its datasheet figures)") from None


@dataclass(frozen=True)
class ModelFacts:
    """A decoder-only model's geometry (its config.json) and checkpoint format."""
    name: str
    title: str
    source: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    num_parameters: int
    quantization: str = "none"          # the checkpoint's quant_method
    quant_bits: int = FULL_PRECISION
    quant_group_size: int = 0           # 0: one scale per output channel
    quant_type: str = "int"             # "int" or "float" (FP8) quantized weights

    @property
    def kv(self) -> KVGeometry:
        return KVGeometry(self.num_hidden_layers, self.num_key_value_heads, self.head_dim)

    def linear_parameters(self) -> int:
        """Weights of the decoder layers' projections (q, k, v, o, gate, up,
        down): what AWQ, GPTQ and FP8 checkpoints quantize."""
        return sum(n * k for n, k in self._layer_shapes()) * self.num_hidden_layers

    def _layer_shapes(self) -> list[tuple[int, int]]:
        """(out_features, in_features) of one decoder layer's projections as vLLM
        fuses them: q/k/v, o, gate/up, down."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, \
            self.num_key_value_heads * self.head_dim
        return [(q + 2 * kv, h), (h, q), (2 * self.intermediate_size, h),
                (h, self.intermediate_size)]

    def decode_linear_shapes(self) -> list[tuple[int, int]]:
        """(out_features, in_features) of every matrix one decode step multiplies
        by, in order, as vLLM lays a Llama-style model out: each layer's
        projections (`_layer_shapes`), then the LM head."""
        return self._layer_shapes() * self.num_hidden_layers + [(self.vocab_size, self.hidden_size)]

    def counted_parameters(self) -> int:
        """Parameters of a Llama/Qwen2-style decoder from its geometry:
        embeddings, the LM head unless tied, projections, q/k/v biases where
        the model has them, two RMSNorms per layer and the final one."""
        h = self.hidden_size
        bias = (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim \
            if self.attention_bias else 0
        embed = self.vocab_size * h
        return (embed * (1 if self.tie_word_embeddings else 2) + self.linear_parameters()
                + self.num_hidden_layers * (bias + 2 * h) + h)

    def weight_bytes(self, dtype: str | None = None) -> int:
        """Bytes of the weights an engine holds: unquantized tensors in
        `dtype` (None or "auto": the checkpoint's torch_dtype); a quantized
        checkpoint's projections at `quant_bits` plus a 16-bit scale and a
        zero point per group (group_size 0: per channel, negligible)."""
        dtype = self.torch_dtype if dtype in (None, "auto") else dtype
        element = ELEMENT_BYTES[str(dtype).lower()]
        if self.quantization == "none":
            return self.num_parameters * element
        linear = self.linear_parameters()
        quantized = linear * self.quant_bits / 8
        if self.quant_group_size:
            quantized += linear / self.quant_group_size * (2 + self.quant_bits / 8)
        return int(quantized + (self.num_parameters - linear) * element)

    def prefill_flops(self, tokens: int) -> float:
        """2 x parameters x tokens: the matrix-multiply FLOPs of a prefill
        (attention's own quadratic term left out: small below ~8k tokens)."""
        return 2.0 * self.num_parameters * int(tokens)

    def with_layers(self, layers: int, name: str) -> ModelFacts:
        """This model cut to its first `layers` layers (`lab_utils.derived_models`)."""
        cut = dataclasses.replace(self, name=name, num_hidden_layers=int(layers),
                                  title=f"{self.title}, first {layers} layers",
                                  source=f"{self.source}; cut to {layers} layers")
        return dataclasses.replace(cut, num_parameters=cut.counted_parameters())


def _entries() -> dict[str, dict[str, Any]]:
    return tomllib.loads((FACTS_DIR / "models.toml").read_text())


@functools.cache
def known_models() -> dict[str, ModelFacts]:
    """Every model of `models.toml` by its profile reference (hub id or "embedded")."""
    entries = _entries()
    out = {}
    for name, entry in entries.items():
        entry = dict(entry)
        base = entry.pop("geometry_of", None)
        if base:
            geometry = {k: v for k, v in entries[base].items()
                        if k not in ("title", "source", "quantization", "torch_dtype")}
            entry = {**geometry, **entry}
        out[name] = ModelFacts(name=name, **entry)
    return out


def _from_config(folder: Path) -> ModelFacts:
    config = json.loads((folder / "config.json").read_text())
    geometry = KVGeometry.from_config(config)
    quant = config.get("quantization_config") or {}
    facts = ModelFacts(
        name=str(folder), title=folder.name, source=f"{folder}/config.json",
        num_hidden_layers=geometry.num_layers, hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
        num_parameters=0, quantization=str(quant.get("quant_method") or "none"),
        quant_bits=int(quant.get("bits") or FULL_PRECISION),
        quant_group_size=int(quant.get("group_size") or 0))
    return dataclasses.replace(facts, num_parameters=safetensors_parameters(folder)
                               or facts.counted_parameters())


def model_facts(ref: str | None) -> ModelFacts | None:
    """The facts of a profile's model reference or a model path, without
    building or downloading anything: a `models.toml` entry, a model the lab
    derives from the embedded one ("embedded-<N>L", "quantized:<recipe>", or
    the folders they are built into), any local folder with a config.json;
    None when nothing is known (e.g. a hub id not in `models.toml`)."""
    if not ref:
        return None
    known = known_models()
    if ref in known:
        return known[ref]
    from .derived_models import truncated_model_dir
    from .model import embedded_model_dir
    from .quantize import RECIPES, quantized_model_dir
    embedded = known["embedded"]
    path = Path(ref).expanduser()
    if path == embedded_model_dir():
        return embedded
    cut = re.fullmatch(r"embedded-(\d+)L", ref) or re.search(r"-(\d+)L$", ref)
    if cut and (ref.startswith("embedded-") or path == truncated_model_dir(int(cut.group(1)))):
        return embedded.with_layers(int(cut.group(1)), ref)
    recipe = ref.split(":", 1)[1] if ref.startswith("quantized:") else next(
        (r for r in RECIPES if path == quantized_model_dir(r)), None)
    if recipe in RECIPES:
        r = RECIPES[recipe]
        return dataclasses.replace(
            embedded, name=ref, title=f"{embedded.title}, {r.name} ({r.summary})",
            source=f"{embedded.source}; format: lab_utils.quantize recipe {r.name!r}",
            torch_dtype=r.engine_dtype, quantization=r.layout, quant_bits=r.bits,
            quant_group_size=r.group_size or 0)
    if (path / "config.json").is_file():
        return _from_config(path)
    return None


__all__ = ["FACTS_DIR", "Device", "ModelFacts", "device", "devices", "known_models",
           "model_facts"]
