"""Where a decode step's time goes, by vLLM's own torch profiler.

`00_baseline` compares single-stream TPOT with the floor of a decode step
(`lab_utils.decode_floor`) and times the step's matrix products alone; this
module says what the rest of the step is. An engine started with
`profiler_flags(folder)` (vLLM's `--profiler-config`, torch profiler, the
worker's side only) records every op between `POST /start_profile` and
`POST /stop_profile` (`Profiling`), and its worker writes torch's per-op table
to `<folder>/<worker>.profiler_out.txt`. `read_table` parses that table and
`decode_breakdown` splits the single-request decode steps of a CPU engine in it (vLLM names
each step `execute_context_<n>(<tokens>)_generation_<m>(<tokens>)`) into
milliseconds per step:

- matrix products: the GEMM ops (`_C::onednn_mm` on vLLM's CPU backend);
- attention: the attention and KV-cache ops;
- compiled kernels: what runs inside a torch.compile graph besides the ops above
  (the graph call's self time: Inductor's fused small ops);
- Python in the step: the step's own time outside every op (the model's
  modules, the model runner, sampling in Python) - what an eager engine spends
  on interpretation;
- other ops: the rest of the step (norms, rotary, activations, copies, sampling).

The profiler adds a few ms per step; the shares, not the absolute times, are
the finding. `00_baseline` runs it on its profiled arm (the profile's own
flags with the profiler on), `benchmarks/thread_binding.py --profile` for
each engine configuration it compares.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .http import post_empty

#: The engine flag that turns vLLM's torch profiler on (`vllm serve --profiler-config`).
PROFILER_FLAG = "profiler_config"

#: vLLM's name of a step with one request decoding and none in prefill.
SINGLE_DECODE_STEP = "execute_context_0(0)_generation_1(1)"

#: Op names (substrings) of each category, first match wins: vLLM's CPU backend's
#: ops and torch's own GEMMs.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matrix products", ("onednn_mm", "onednn_scaled_mm", "int8_scaled_mm", "cpu_gemm",
                         # not aten::linear / aten::matmul: wrappers whose GEMM is one of
                         # these, counted once (a torch-linear fallback, e.g. bf16 on AVX2)
                         "aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("attention", "kv_cache", "reshape_and_cache")),
    ("compiled kernels", ("CompiledFxGraph",)),
)

#: vLLM's C kernels of a norm and of an activation (`lab_utils.cpu_kernels`): their
#: calls are counted, not split out (their time stays in "other ops").
NORM_OPS = ("_C::rms_norm", "_C::fused_add_rms_norm")
ACTIVATION_OPS = ("_C::silu_and_mul",)

#: The parts of a step `decode_breakdown` reports, in its order.
PARTS = ("matrix products", "attention", "compiled kernels", "other ops", "python in the step")

_UNITS = {"s": 1e3, "ms": 1.0, "us": 1e-3, "ns": 1e-6}
_TIME = r"([\d.]+)(s|ms|us|ns)"
_ROW = re.compile(rf"^(?P<name>.+?)\s+[\d.]+%\s+{_TIME}\s+[\d.]+%\s+{_TIME}\s+{_TIME}\s+(?P<calls>\d+)\s*$")


class ProfileError(RuntimeError):
    pass


@dataclass(frozen=True)
class OpRow:
    """One row of torch's per-op table: self and total CPU time (ms) over every call."""
    name: str
    self_ms: float
    total_ms: float
    calls: int


def profiler_flags(folder: str | Path) -> dict[str, Any]:
    """Engine flags that make vLLM write its worker's torch profile to `folder`
    (absolute, as vLLM requires): the worker's ops only (not the API server's),
    no Python stacks (they slow every op down), the table as plain text."""
    return {PROFILER_FLAG: {"profiler": "torch", "torch_profiler_dir": str(Path(folder).resolve()),
                            "ignore_frontend": True, "torch_profiler_with_stack": False,
                            "torch_profiler_use_gzip": False}}


def _ms(value: str, unit: str) -> float:
    return float(value) * _UNITS[unit]


def parse_table(text: str) -> list[OpRow]:
    """The rows of torch's `key_averages().table()` (self CPU, CPU total, calls)
    as a CPU engine's worker writes it. A GPU worker's table (device columns:
    Self CUDA, ...) raises ProfileError: there a step's time is the device's,
    which this split of CPU time does not read."""
    rows = []
    for line in text.splitlines():
        if line.lstrip().startswith("Name") and re.search(r"CUDA|XPU|Device", line):
            raise ProfileError("a GPU worker's profile: its steps run on the device, and "
                               "step_profile splits a CPU engine's steps only (read the "
                               "table's device columns, or the trace, directly)")
        m = _ROW.match(line.strip())
        if m and m.group("name") != "Name":
            g = m.groups()
            rows.append(OpRow(name=m.group("name").strip(), self_ms=_ms(g[1], g[2]),
                              total_ms=_ms(g[3], g[4]), calls=int(m.group("calls"))))
    return rows


def read_table(folder: str | Path) -> list[OpRow]:
    """The newest worker table vLLM wrote to `folder` (`*.profiler_out.txt`)."""
    tables = sorted(Path(folder).glob("*.profiler_out.txt"), key=lambda p: p.stat().st_mtime)
    if not tables:
        raise ProfileError(f"no *.profiler_out.txt in {folder}: was the engine started with "
                           f"step_profile.profiler_flags({str(folder)!r}) and the profile stopped?")
    return parse_table(tables[-1].read_text(errors="replace"))


def category(name: str) -> str:
    for label, needles in CATEGORIES:
        if any(n in name for n in needles):
            return label
    return "other ops"


def decode_breakdown(rows: Iterable[OpRow], step: str = SINGLE_DECODE_STEP) -> dict[str, Any]:
    """Milliseconds per single-request decode step: the step in all, and each
    category (module text). Only a profile of single-request decode steps can
    be split (the op rows do not say which step they ran in): a profile that
    also holds other steps (prefill, batches) raises ProfileError."""
    rows = list(rows)
    steps = [r for r in rows if r.name.startswith("execute_context_")]
    mine = [r for r in steps if r.name == step]
    if not mine:
        raise ProfileError(f"no {step!r} step in the profile: profile single-request decoding")
    others = [r.name for r in steps if r.name != step and r.total_ms > 0.05 * mine[0].total_ms]
    if others:
        raise ProfileError(f"the profile also holds {others}: its ops cannot be split per "
                           f"{step!r} step; profile single-request decoding only")
    n = mine[0].calls
    per_step = {"steps": n, "step_ms": mine[0].total_ms / n,
                "python in the step": mine[0].self_ms / n,
                # every GEMM call of the profile, prefill steps included
                "gemm_calls": sum(r.calls for r in rows
                                  if category(r.name) == "matrix products"),
                # and of vLLM's C kernels of norms and activations (none where they
                # run as PyTorch ops, or inside a compiled graph)
                "norm_calls": sum(r.calls for r in rows if r.name in NORM_OPS),
                "activation_calls": sum(r.calls for r in rows if r.name in ACTIVATION_OPS)}
    spent = {label: 0.0 for label, _ in CATEGORIES}
    spent["other ops"] = 0.0
    for r in rows:
        if r.name.startswith("execute_context_"):
            continue
        spent[category(r.name)] += r.self_ms
    # "other ops" is the step's remainder: ops outside the step (before the first
    # one, after the last) are left out that way
    named = sum(spent[label] for label, _ in CATEGORIES) / n
    per_step.update({label: spent[label] / n for label, _ in CATEGORIES})
    per_step["other ops"] = max(0.0, per_step["step_ms"] - per_step["python in the step"] - named)
    return per_step


def folder_of(engine) -> Path:
    """The folder an engine started with `profiler_flags` writes its profile to."""
    cfg = (getattr(engine, "flags", None) or {}).get(PROFILER_FLAG)
    if not cfg:
        raise ProfileError("the engine was started without step_profile.profiler_flags(...)")
    return Path(cfg["torch_profiler_dir"])


def clear(folder: str | Path) -> None:
    """Remove the tables and traces an earlier profile left in `folder` (vLLM
    adds a trace per profile), so that `read_table` cannot read a stale one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("*.profiler_out.txt"), *folder.glob("*.pt.trace.json*")]:
        old.unlink(missing_ok=True)


class Profiling:
    """`with Profiling(engine):` records the worker's ops during the block;
    the table is in the engine's profiler folder when the block ends (vLLM
    writes it on /stop_profile; what an earlier profile left there is removed
    first). Raises ProfileError when the engine was not
    started with `profiler_flags` (vLLM answers 404 or 500)."""

    def __init__(self, engine):
        self.base_url = engine.base_url.rstrip("/")
        self.folder = folder_of(engine)

    def __enter__(self) -> Profiling:
        clear(self.folder)
        status = post_empty(self.base_url + "/start_profile", timeout=300)
        if status != 200:
            raise ProfileError(f"{self.base_url}/start_profile answered HTTP {status}")
        return self

    def __exit__(self, *exc: object) -> None:
        status = post_empty(self.base_url + "/stop_profile", timeout=300)
        if status != 200 and exc[0] is None:
            raise ProfileError(f"{self.base_url}/stop_profile answered HTTP {status}")
