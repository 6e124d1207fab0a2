"""The host and a local engine's processes: the load average, the processes,
CPU seconds and resident memory of a process group, and a clock of the CPU
time an engine's processes use during a block.

A local server is one process group (`VLLMServer` starts it in a new session
and stops it with killpg): its leader `engine.server.proc.pid` runs the API
server, its descendants the engine core and the worker(s) that do the
model's arithmetic (vLLM names them `...Worker...`); a CPU worker that runs
inside the engine-core process (`cpu_tuning.in_process_env`) makes that
process (`VLLM::EngineCore`) the one that computes. `compute_cost` turns
the worker's CPU seconds of two runs into CPU time per prefill and per
decode step.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Self

import psutil


def host_load() -> float:
    """The machine's 1-minute load average (nan where unknown): well above the
    core count means other processes competed with the engine, and the times
    measured meanwhile are inflated."""
    try:
        return float(psutil.getloadavg()[0])
    except (AttributeError, OSError):
        return math.nan


def free_memory_fraction() -> float:
    """The share of this machine's memory available now (psutil)."""
    vm = psutil.virtual_memory()
    return vm.available / vm.total


def tlb_shootdowns(path: str = "/proc/interrupts") -> int | None:
    """TLB shootdowns this machine's CPUs have received since boot (the "TLB"
    row of /proc/interrupts, summed over CPUs; x86 Linux), None where there is
    no such row. A process that unmaps memory while its threads run on other
    CPUs sends each of them one: `lab_utils.pystack` is about such a process."""
    try:
        with open(path) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == "TLB:":
                    return sum(int(v) for v in fields[1:] if v.isdigit())
    except OSError:
        return None
    return None


def group_processes(pgid: int, *, zombies: bool = False) -> list[psutil.Process]:
    """The processes of process group `pgid`; exited ones not yet reaped
    (zombies) only with `zombies=True`."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and (zombies or
                                                 proc.status() != psutil.STATUS_ZOMBIE):
                members.append(proc)
        except (OSError, psutil.Error):  # it ended meanwhile
            continue
    return members


def is_worker(proc: psutil.Process) -> bool:
    """Whether `proc` is a vLLM worker (by its process name or command line)."""
    try:
        return "Worker" in proc.name() or any("Worker" in arg for arg in proc.cmdline())
    except psutil.Error:
        return False


def is_engine_core(proc: psutil.Process) -> bool:
    """Whether `proc` is vLLM's engine-core process (`VLLM::EngineCore`)."""
    try:
        return "EngineCore" in proc.name() or any("EngineCore" in arg for arg in proc.cmdline())
    except psutil.Error:
        return False


def model_processes(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of a server's processes that hold the model and compute it: its
    workers, or where it has none (the worker inside the engine core) its
    engine-core process."""
    procs = list(procs)
    return [p for p in procs if is_worker(p)] or [p for p in procs if is_engine_core(p)]


def cpu_seconds(procs: Iterable[psutil.Process]) -> dict[psutil.Process, float]:
    """User + system CPU seconds each process has used so far (ended ones are
    left out). Keyed by the process, so a reused pid is another key."""
    out = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        out[proc] = times.user + times.system
    return out


def group_rss(pgid: int) -> dict[str, float | None]:
    """Resident memory (MiB) of process group `pgid`: the processes holding the
    weights and the KV cache (`model_processes`; None without one) and the
    whole group (None when it has no process)."""
    worker, total = None, 0.0
    procs = group_processes(pgid)
    model = set(model_processes(procs))
    for proc in procs:
        try:
            rss = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
        total += rss
        if proc in model:
            worker = (worker or 0.0) + rss
    return {"worker_rss_mib": worker, "server_rss_mib": total or None}


class EngineCPU:
    """CPU seconds a local engine's processes used between `start()` and
    `stop()` (or inside a `with` block), against the wall time.

    `cpu_s`: all of them (API server, engine core, workers); `worker_cpu_s`:
    those that compute the model only (`model_processes`: its arithmetic, which
    other work on a shared CPU delays but does not inflate); `share`: cpu_s / (wall_s x cores), the
    fraction of the machine the engine got (low on a machine busy with other
    work: the block's latencies are then inflated by contention). The three
    are nan for an engine without a local server. A process started during
    the block counts in full, one that ended during it not at all."""

    def __init__(self, engine):
        server = getattr(engine, "server", None)
        proc = getattr(server, "proc", None)
        self.pgid: int | None = proc.pid if proc is not None else None
        self.cpu_s = self.worker_cpu_s = self.wall_s = math.nan
        self._before: dict[psutil.Process, float] = {}
        self._t0 = time.perf_counter()

    def _read(self) -> dict[psutil.Process, float]:
        # Zombies too: their CPU time is final but was used.
        return cpu_seconds(group_processes(self.pgid, zombies=True)) if self.pgid else {}

    def start(self) -> Self:
        self._t0 = time.perf_counter()
        self._before = self._read()
        return self

    def stop(self) -> Self:
        self.wall_s = time.perf_counter() - self._t0
        if self.pgid:
            used = {p: t - self._before.get(p, 0.0) for p, t in self._read().items()}
            self.cpu_s = sum(used.values())
            model = set(model_processes(used))
            self.worker_cpu_s = sum(t for p, t in used.items() if p in model)
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def share(self) -> float:
        cores = os.cpu_count() or 1
        return self.cpu_s / (self.wall_s * cores) if self.wall_s > 0 else math.nan


def measured_compute(engine, prefill_run: Callable[[], Any], full_run: Callable[[], Any],
                     requests: int, output_tokens: int) -> tuple[Any, Any, dict[str, float]]:
    """Run `prefill_run()` (`requests` prompts, one output token each) and
    then `full_run()` (the same number of same-length prompts producing
    `output_tokens` each), each under `EngineCPU`; returns (the two runs'
    results, their cost): `compute_cost` from the worker's CPU time on a
    local CPU engine (nan elsewhere: a GPU's compute is not CPU time), the
    prefill run's median TTFT and the worker's CPU share of the full run's
    request time per worker thread (`worker_threads`, the threads vLLM gave it, from its
    log): 1 when its threads computed all the time, lower when other work on the
    machine held the cores."""
    with EngineCPU(engine) as pre_cpu:
        pre = prefill_run()
    with EngineCPU(engine) as full_cpu:
        full = full_run()
    local_cpu = engine.profile.device == "cpu" and pre_cpu.pgid
    prefill_s, total_s = (pre_cpu.worker_cpu_s, full_cpu.worker_cpu_s) if local_cpu \
        else (None, None)
    wall = sum(r.e2e or 0.0 for r in full.records)
    threads = worker_threads(engine) if local_cpu else None
    return pre, full, {**compute_cost(prefill_s, total_s, requests, output_tokens),
                       "prefill_ttft_ms": pre.frame().ttft_ms.median(),
                       "worker_threads": threads or math.nan,
                       "cpu_share": total_s / (wall * (threads or 1))
                       if total_s is not None and wall else math.nan}


def worker_threads(engine) -> int | None:
    """How many threads compute the model in a local CPU engine, from its log
    (`machine.parse_engine_binding`): the worker's torch threads, else the
    cores of its binding record; for a worker inside the engine core whose log
    says neither (vLLM logs nothing when OMP_NUM_THREADS is set and 1), the
    OMP_NUM_THREADS it started with, which vLLM's torch threads follow
    (`vllm.utils.torch_utils.set_torch_threads_for_runtime`); None otherwise."""
    from .machine import parse_engine_binding
    try:
        got = parse_engine_binding(engine.server.log_path.read_text(errors="replace"))
    except (AttributeError, OSError):
        return None
    cores = got.get("core_ids") or [[]]
    if not got.get("torch_threads") and got.get("executor") == "uni":
        omp = str((getattr(engine.server, "env", None) or {}).get("OMP_NUM_THREADS", ""))
        return int(omp) if omp.isdigit() and int(omp) > 0 else None
    return int(got.get("torch_threads") or len(cores[-1])) or None


def compute_cost(prefill_cpu_s: float | None, total_cpu_s: float | None, requests: int,
                 output_tokens: int) -> dict[str, float]:
    """Worker CPU ms per prefill and per decode step, from a prefill-only run
    (`requests` prompts, one token each) and a full run of the same number of
    same-length prompts producing `output_tokens` tokens each."""
    if prefill_cpu_s is None or total_cpu_s is None or requests < 1:
        return {"prefill_cpu_ms": math.nan, "decode_cpu_ms": math.nan}
    per_prefill = prefill_cpu_s / requests
    steps = requests * max(output_tokens - 1, 1)
    return {"prefill_cpu_ms": per_prefill * 1e3,
            "decode_cpu_ms": max(total_cpu_s - prefill_cpu_s, 0.0) / steps * 1e3}

def busy_runs_warning(runs, keys: Sequence[str], *, cores: int | None = None,
                      factor: float = 2.0) -> str:
    """A warning naming the runs (rows of `runs`, named by their `keys`
    columns joined by "/") whose `host_load_1m` was above `factor` x cores,
    i.e. other processes competed for the CPU; "" if none was."""
    cores = cores or os.cpu_count() or 1
    if runs.empty or "host_load_1m" not in runs:
        return ""
    busy = runs[runs.host_load_1m > factor * cores]
    if busy.empty:
        return ""
    names = ", ".join("/".join(str(r[k]) for k in keys) + f" ({r.host_load_1m:.1f})"
                      for _, r in busy.iterrows())
    return (f"host load average above {factor * cores:g} on {cores} cores during {len(busy)} of "
            f"{len(runs)} runs: {names}. Their timings include other processes' work; vLLM's "
            "counters do not depend on it.")
