"""How close single-stream TPOT comes to the memory-bandwidth floor of a decode step.

With one request in flight, each decode step multiplies one token's activations
by every weight matrix of the model: it reads every weight byte once, and does
two FLOPs per weight, far below what the cores (or a GPU) could compute in the
time the read takes. So a step cannot be faster than

    floor = weight bytes / memory read bandwidth

and single-stream TPOT / floor says how much of the memory system the serving
path uses. This is why the article's TPOT techniques work: quantization reads
fewer bytes per step, speculative decoding and batching emit more tokens per read.

On the `cpu` profile the lab measures both figures on this machine: the read
bandwidth with the worker's thread count (a float32 sum, `cpu_tuning.read_bandwidth`,
measured right before: a shared host's bandwidth drifts; on huge pages where the
machine has them, `lab_utils.huge_pages`: with 4 KiB pages a virtual machine's
sum measured 23 GB/s where huge pages gave 29), and the step's matrix
products alone through the GEMM vLLM picks (`cpu_tuning.decode_linears_ms`): the
part of TPOT no scheduling or small op adds to. On a GPU the floor comes from the
datasheet bandwidth of the GPU `LAB_GPU` names (`lab_utils/profiles/facts/devices.toml`),
split over tensor-parallel ranks; a remote server's hardware is not the lab's to read.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from . import cpu_tuning, host, huge_pages
from .facts import device, model_facts
from .step_profile import PARTS as STEP_PARTS


@dataclass(frozen=True)
class DecodeFloor:
    """The floor of one single-request decode step on one engine, and how it was found.

    `floor_ms` is None where it cannot be known (`why` says why); `linears_ms` is
    None where the lab cannot time the matrix products (`linears_why`)."""
    weight_bytes: int | None
    dtype: str
    bandwidth_gbs: float | None
    bandwidth_source: str
    threads: int | None
    floor_ms: float | None
    linears_ms: float | None = None
    linears_min_ms: float | None = None
    linear_count: int = 0
    why: str = ""
    linears_why: str = ""
    #: The engine's memory on transparent huge pages (its processes' AnonHugePages,
    #: `lab_utils.huge_pages`), bytes; None where the lab cannot read it.
    engine_huge_page_bytes: int | None = None
    #: The same products through ATen's `torch.nn.functional.linear` (median ms of
    #: the steps, timed in turn with vLLM's): how much of the products' distance to
    #: the floor is vLLM's GEMM for one row of activations, not the memory.
    aten_linears_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line: the floor and how it was found, or why there is none."""
        if self.floor_ms is None:
            return f"no decode floor: {self.why}"
        text = (f"decode floor {self.floor_ms:.1f} ms: {self.weight_bytes / 2**20:,.0f} MiB of "
                f"{self.dtype} weights / {self.bandwidth_gbs:.1f} GB/s ({self.bandwidth_source})")
        return text + (f"; matrix products not timed: {self.linears_why}" if self.linears_why else "")


def worker_threads(engine) -> int:
    """The threads vLLM's worker computes with (`host.worker_threads`, from its
    log and environment), else the CPUs this process may use."""
    return host.worker_threads(engine) or len(os.sched_getaffinity(0))


#: vLLM's --dtype spellings of the unquantized dtypes, as torch names them.
_TORCH_DTYPES = {"float": "float32", "fp32": "float32", "float32": "float32", "half": "float16",
                 "fp16": "float16", "float16": "float16", "bf16": "bfloat16",
                 "bfloat16": "bfloat16", "auto": "auto"}


def _engine_dtype(engine) -> str:
    asked = str(engine.flags.get("dtype") or engine.profile.engine.get("dtype") or "auto")
    return _TORCH_DTYPES.get(asked.lower(), asked)


#: vLLM --quantization methods that quantize a full-precision checkpoint's dense
#: projections as it loads (weights 8-bit floats); others (e.g. vLLM 0.32's
#: int8_per_channel_weight_only: MoE experts only) leave a dense model's bytes as they are.
ONLINE_FP8 = ("fp8", "fp8_per_channel", "ptpc_fp8")


def step_facts(engine):
    """(`ModelFacts` of the weights `engine` holds, the dtype of its unquantized
    tensors), or (None, dtype) when the model's geometry is unknown: its checkpoint
    as `facts.model_facts` knows it, with the projections 8-bit floats where the
    engine quantizes them online (`ONLINE_FP8`)."""
    dtype = _engine_dtype(engine)
    facts = model_facts(engine.model_path or engine.model)
    if facts is None:
        return None, dtype
    online = str(engine.flags.get("quantization") or "").lower()
    if facts.quantization == "none" and online in ONLINE_FP8:
        facts = dataclasses.replace(facts, quantization=online, quant_bits=8, quant_type="float",
                                    quant_group_size=0)
    return facts, (facts.torch_dtype if dtype == "auto" else dtype)


def read_bytes(facts, dtype: str) -> int:
    """Bytes of weights one decode step reads: every weight once, except an
    embedding table not tied to the output head, of which a step reads one row."""
    from .kv_memory import ELEMENT_BYTES
    held = facts.weight_bytes(dtype)
    if facts.tie_word_embeddings:
        return held
    return held - (facts.vocab_size - 1) * facts.hidden_size * ELEMENT_BYTES[dtype]


def step_weight_bytes(engine) -> int | None:
    """Bytes of weights one decode step of `engine` reads (`read_bytes`), None
    when the model's geometry is unknown."""
    facts, dtype = step_facts(engine)
    return None if facts is None else read_bytes(facts, dtype)


def measure(engine, *, steps: int = 21, gpu: str | None = None) -> DecodeFloor:
    """The decode floor of `engine` (a lab `Engine`): measured on this machine
    for a local CPU engine (read bandwidth, then `steps` decode steps' matrix
    products alone, each in a fresh process while the engine idles), from the
    datasheet of GPU `gpu` (default: `LAB_GPU`) for a CUDA profile."""
    from .plan import named_gpu
    dtype = _engine_dtype(engine)
    if engine.server is None:
        return DecodeFloor(None, dtype, None, "", None, None,
                           why="a remote server: its memory bandwidth is not the lab's to measure")
    facts, dtype = step_facts(engine)
    if facts is None:
        return DecodeFloor(None, dtype, None, "", None, None,
                           why=f"no geometry known for {engine.model_path or engine.model!r} "
                               "(add it to lab_utils/profiles/facts/models.toml)")
    weights = read_bytes(facts, dtype)
    if engine.profile.device == "cuda":
        name = gpu or named_gpu()
        if not name:
            return DecodeFloor(weights, dtype, None, "", None, None,
                               why="name the GPU: LAB_GPU=<a lab_utils/profiles/facts/devices.toml "
                                   "entry>, e.g. LAB_GPU=h100-80gb")
        gpu_ = device(name)
        tp = int(engine.flags.get("tensor_parallel_size") or 1)
        return DecodeFloor(weights, dtype, gpu_.memory_bandwidth_bytes_s * tp / 1e9,
                           f"datasheet: {gpu_.title}" + (f" x {tp} (tensor parallel)" if tp > 1 else ""),
                           None, gpu_.read_seconds(weights / tp) * 1e3,  # each rank reads its shard
                           linears_why="on a GPU: time them there (torch.profiler of the engine)")
    threads = worker_threads(engine)
    huge = engine_huge_page_bytes(engine)
    read = cpu_tuning.read_bandwidth(threads)
    bandwidth = float(read["gb_per_s"])
    pages = "huge pages" if read.get("huge_page_bytes", 0) >= read["bytes"] // 2 else "4 KiB pages"
    floor = DecodeFloor(weights, dtype, bandwidth,
                        f"measured: float32 sum, {threads} thread(s), {pages}",
                        threads, cpu_tuning.decode_floor_ms(weights, bandwidth),
                        engine_huge_page_bytes=huge)
    if facts.quantization != "none":
        return dataclasses.replace(floor, linears_why="a quantized checkpoint: the lab times unquantized "
                                           "GEMMs only")
    shapes = facts.decode_linear_shapes()
    got = cpu_tuning.decode_linears_ms(shapes, threads, steps, dtype=dtype)
    return dataclasses.replace(floor, linears_ms=got["ms_median"], linears_min_ms=got["ms_min"],
                               aten_linears_ms=got["aten_ms_median"], linear_count=len(shapes))


def engine_huge_page_bytes(engine) -> int | None:
    """How much of a local engine's memory is on transparent huge pages: the
    AnonHugePages of its processes (server, engine core, worker); None where
    there is no local process to read."""
    proc = getattr(getattr(engine, "server", None), "proc", None)
    if proc is None:
        return None
    return sum(huge_pages.anon_huge_bytes(p.pid) for p in host.group_processes(proc.pid))


def single_stream_tpot(tpot: pd.DataFrame) -> pd.Series:
    """TPOT (ms) of the requests that ran alone (`concurrency` 1, or the lowest
    concurrency of `tpot`: rows of `baseline.tpot_vs_output_and_concurrency`)."""
    return tpot[tpot.concurrency == tpot.concurrency.min()].tpot_ms.dropna()


def table(floor: DecodeFloor, tpot: pd.DataFrame) -> pd.DataFrame:
    """One row per figure in ms and as a multiple of the floor: the floor, the
    step's matrix products alone (where timed), single-stream TPOT median and p90."""
    alone = single_stream_tpot(tpot)
    rows = []
    if floor.floor_ms is not None:
        rows.append(("floor: weights / read bandwidth",
                     floor.floor_ms, f"{floor.weight_bytes / 2**20:,.0f} MiB of {floor.dtype} "
                     f"weights / {floor.bandwidth_gbs:.1f} GB/s ({floor.bandwidth_source})"))
    if floor.linears_ms is not None:
        rows.append(("the step's matrix products alone, vLLM's GEMM", floor.linears_ms,
                     f"{floor.linear_count} GEMMs through vLLM's CPU dispatch, "
                     f"{floor.threads} thread(s), median of the steps (min {floor.linears_min_ms:.1f} ms)"))
    if floor.aten_linears_ms is not None:
        rows.append(("the same products alone, ATen's linear", floor.aten_linears_ms,
                     "torch.nn.functional.linear on the same weights, timed in turn with "
                     "vLLM's: the GEMM's share of the distance to the floor"))
    if len(alone):
        median = float(alone.median())
        rows.append(("single-stream TPOT, median", median,
                     f"{len(alone)} requests alone (measured above)"))
        rows.append(("single-stream TPOT, p90", float(alone.quantile(0.9)), ""))
        if floor.linears_ms is not None:
            rows.append(("TPOT median beyond the matrix products", median - floor.linears_ms,
                         "attention, norms, rotary, sampling, scheduling, the API server, the client"))
    out = pd.DataFrame(rows, columns=["figure", "ms", "how"]).set_index("figure")
    out.insert(1, "x floor", out.ms / floor.floor_ms if floor.floor_ms else float("nan"))
    return out.round({"ms": 1, "x floor": 2})


def finding(floor: DecodeFloor, tpot: pd.DataFrame,
            step_split: dict | None = None) -> dict[str, Any]:
    """The finding (`Results.add_finding` keywords): the floor -> single-stream TPOT
    median, with how the floor was found and what the matrix products alone take,
    and, given `step_split` (`baseline.decode_step_split`: vLLM's torch profiler),
    what a decode step is made of."""
    alone = single_stream_tpot(tpot)
    if floor.floor_ms is None:
        mechanism = f"floor unknown: {floor.why}"
    else:
        mechanism = (f"{floor.weight_bytes / 2**20:,.0f} MiB of {floor.dtype} weights read per "
                     f"step / {floor.bandwidth_gbs:.1f} GB/s ({floor.bandwidth_source}) = "
                     f"{floor.floor_ms:.1f} ms")
        if len(alone):
            mechanism += f"; TPOT = {alone.median() / floor.floor_ms:.2f}x the floor"
        if floor.linears_ms is not None:
            mechanism += (f"; the step's {floor.linear_count} matrix products alone "
                          f"{floor.linears_ms:.1f} ms = {floor.linears_ms / floor.floor_ms:.2f}x")
            if floor.aten_linears_ms is not None:
                mechanism += (f" (through ATen's linear {floor.aten_linears_ms:.1f} ms = "
                              f"{floor.aten_linears_ms / floor.floor_ms:.2f}x)")
        if floor.engine_huge_page_bytes is not None:
            mechanism += (f"; the engine's memory on huge pages "
                          f"{floor.engine_huge_page_bytes / 2**20:,.0f} MiB")
    split = step_split if step_split and "step_ms" in step_split else None
    if split:
        mechanism += ("; vLLM's torch profiler, ms per decode step: " + ", ".join(
            f"{part} {split[part]:.1f}" for part in STEP_PARTS if split.get(part)) +
            f" of {split['step_ms']:.1f}")
    return dict(technique="baseline: decode floor",
                metric="single-stream TPOT median (ms), memory-bandwidth floor -> measured",
                baseline=floor.floor_ms, treated=float(alone.median()) if len(alone) else None,
                article_claim="(none; why the TPOT techniques work: each decode step reads "
                              "every weight once)",
                mechanism=mechanism, why_missing=floor.why or None, decode_floor=floor.to_json(),
                step_split=step_split)
