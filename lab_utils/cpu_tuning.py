"""How vLLM's CPU backend uses the machine: thread binding, allocator and
OpenMP runtime, and the memory-bandwidth floor of a decode step.

On x86 vLLM binds its worker's OpenMP threads to one logical CPU per physical
core of the first NUMA node and *reserves* one core for the engine-core
process (`vllm/utils/ompmultiprocessing.py`): on a 2-core machine the worker
gets one core. `VLLM_CPU_OMP_THREADS_BIND` overrides that list ("0-1" = both
cores, "nobind" = no binding); vLLM also reads `LD_PRELOAD` to pick the
OpenMP runtime's affinity variables (Intel OpenMP: `KMP_AFFINITY`), and warns
when neither tcmalloc nor Intel OpenMP is preloaded ("For best performance").

vLLM runs that worker in a process of its own (its "mp" executor), whose
shared-memory queue the engine-core process polls, spinning, while the worker
computes. On the CPU backend it allows the worker inside the engine-core
process (the "uni" executor) only with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, and
then applies no binding of its own. `in_process_env(env)` does that where the
worker has every core anyway, with the OpenMP variables vLLM would have given
the worker's process: one process fewer to start (~6 s on 2 cores), but decode
that collapses when another job computes on the same cores, so the `cpu`
profile does it only where the engine has one core (`wants_in_process`,
"one-core"; the numbers are in `profiles/cpu.toml`).

`binding_env(...)` builds those environments from libraries found on this
machine; `benchmarks/thread_binding.py` measures them against each other and
against `decode_floor_ms` (weight bytes read per decode step / measured read
bandwidth).
"""
from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from .cpu_kernels import C_KERNELS_ENV
from . import huge_pages as thp
from .pystack import STACK_ROOM_ENV

#: Where Debian's `libtcmalloc-minimal4` and PyPI's `intel-openmp` put them.
_TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                        "/usr/lib64/libtcmalloc_minimal.so.4",
                        "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def tcmalloc_path() -> str | None:
    """tcmalloc (minimal) on this machine, or None (Debian: libtcmalloc-minimal4)."""
    for cand in _TCMALLOC_CANDIDATES:
        if Path(cand).is_file():
            return cand
    found = ctypes.util.find_library("tcmalloc_minimal")
    return found if found and Path(found).is_absolute() else None


def iomp_path() -> str | None:
    """Intel's OpenMP runtime from the `intel-openmp` wheel in this environment."""
    for base in {sys.prefix, sys.base_prefix}:
        cand = Path(base) / "lib" / "libiomp5.so"
        if cand.is_file():
            return str(cand)
    return None


def all_cores() -> str:
    """The CPUs this process may run on, as vLLM's list syntax ("0-1" or "0,2,5")."""
    cpus = sorted(os.sched_getaffinity(0))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def parse_cpu_list(spec: str) -> list[int]:
    """CPU ids of one rank's list in vLLM's VLLM_CPU_OMP_THREADS_BIND syntax
    ("0-3", "0,2,5", "0-1,4"); ValueError for anything else ("auto", "nobind",
    several ranks "0-1|2-3")."""
    out: list[int] = []
    for part in spec.strip().split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {spec!r}")
        out += range(int(lo), int(hi) + 1) if sep else [int(lo)]
    return sorted(set(out))


#: vLLM's switch for its engine-core process (V1): "0" runs the engine core in the
#: API server's process for the offline API, and lets the CPU backend keep its
#: worker in the engine core (`vllm/platforms/cpu.py`; the server keeps its
#: engine-core process).
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: "1": `lab_utils.vllm_cli serve` forks vLLM's engine-core process from its API
#: server instead of spawning it (`vllm_cli.fork_engine_core`); the worker is
#: still spawned. Read by the lab's launcher, not by vLLM. Not where the worker
#: computes inside the engine core (`in_process_env` drops it): forked, that
#: process decoded slower (profiles/cpu.toml).
FORK_CORE_ENV = "LAB_FORK_ENGINE_CORE"


#: The flag whose per-step times need the worker in its own process: with the
#: worker inside the engine core, vLLM's step timer starts after the forward pass
#: (`EngineCore.step`: `execute_model` runs before `capture_iteration_details`)
#: and times the sampling alone.
STEP_TIMING_FLAG = "enable_logging_iteration_details"


def in_process_env(env: Mapping[str, str], cpus: list[int] | None = None,
                   flags: Mapping[str, object] | None = None) -> dict[str, str]:
    """`env` plus what puts vLLM's CPU worker inside the engine-core process,
    where the engine's binding gives the worker every CPU this process may use
    and reserves none (VLLM_CPU_OMP_THREADS_BIND equal to them, or "all" cores
    through `binding_env`): VLLM_ENABLE_V1_MULTIPROCESSING=0 and the OpenMP
    variables vLLM would give that worker's process itself
    (`OMPProcessManager.configure_omp_envs`: thread count and affinity for the
    OpenMP runtime LD_PRELOAD selects), which it sets only for a process of its own.

    Otherwise `env` is returned unchanged: a worker bound to a share of the
    cores (two engines side by side), a reserved core or vLLM's automatic
    binding need vLLM's own binding, which only its worker process applies.
    So is an engine whose `flags` ask for vLLM's per-step times
    (STEP_TIMING_FLAG), which time the forward pass only in the worker's own
    process. A VLLM_ENABLE_V1_MULTIPROCESSING already in `env` is kept as it is."""
    env = dict(env)
    if MULTIPROCESSING in env or (flags or {}).get(STEP_TIMING_FLAG):
        return env
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    try:
        bound = parse_cpu_list(env.get("VLLM_CPU_OMP_THREADS_BIND", ""))
    except ValueError:
        return env
    if bound != cpus or env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") != "0":
        return env
    env.pop(FORK_CORE_ENV, None)  # an engine core that computes is spawned (FORK_CORE_ENV)
    return {**env, MULTIPROCESSING: "0", **worker_omp_env(cpus, env.get("LD_PRELOAD", ""))}


#: `[cpu_binding] in_process = "one-core"`: the worker inside the engine core only
#: where this process may use a single CPU (each stream of `make test`, a 1-core
#: machine). There a worker process of its own only adds a process to start and
#: an engine core that polls it on the same core; one OpenMP thread has no barrier
#: to wait at, so nothing collapses when another job shares the core.
ONE_CORE = "one-core"


def wants_in_process(mode: object, cpus: list[int] | None = None) -> bool:
    """Whether a profile's `[cpu_binding] in_process` (true, false or
    "one-core") puts the worker inside the engine core on `cpus` (default:
    the CPUs this process may use); `in_process_env` still decides whether
    the engine's binding and flags allow it."""
    if mode == ONE_CORE:
        return len(cpus if cpus is not None else os.sched_getaffinity(0)) == 1
    return mode is True


def worker_omp_env(cpus: list[int], ld_preload: str = "") -> dict[str, str]:
    """The OpenMP variables vLLM 0.32 sets for a CPU worker process bound to
    `cpus` (`vllm/utils/ompmultiprocessing.py`, `configure_omp_envs`): Intel
    OpenMP's when LD_PRELOAD holds it, GNU OpenMP's when it holds libgomp, the
    standard ones otherwise."""
    ids = [str(c) for c in cpus]
    env = {"OMP_NUM_THREADS": str(len(ids))}
    if "libiomp" in ld_preload or "libomp" in ld_preload:
        env.update(KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{','.join(ids)}]",
                   KMP_BLOCKTIME="5", KMP_TPAUSE="0")
    elif "libgomp" in ld_preload:
        env["GOMP_CPU_AFFINITY"] = " ".join(ids)
    else:
        env.update(OMP_PLACES="{" + ",".join(ids) + "}", OMP_PROC_BIND="true")
    return env


def core_shares(n: int, cpus: list[int] | None = None) -> list[str]:
    """This process's CPUs split into `n` contiguous shares, one
    VLLM_CPU_OMP_THREADS_BIND list each ("0", "1" for two engines on a
    2-core machine; the first shares get the extra CPUs of an uneven split):
    engines that run side by side each on their own cores."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if n > len(cpus):
        raise ValueError(f"{n} engines cannot each have their own core: this process may use "
                         f"{len(cpus)} CPU(s) {cpus}")
    size, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        part = cpus[start:start + size + (i < extra)]
        start += len(part)
        out.append(",".join(map(str, part)))
    return out


_SHIM_DIR = Path(__file__).resolve().parent / "isa_shim"


def isa_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment that makes a vLLM CPU engine run as on an AVX2-only CPU when
    `LAB_CPU_ISA=avx2` (else {}): vLLM loads its AVX2 kernel library and
    refuses what needs AVX-512 (`lab_utils/isa_shim/sitecustomize.py` hides
    AVX-512 and AMX from `torch.cpu`), torch's kernels stop at AVX2
    (ATEN_CPU_CAPABILITY) and so does oneDNN (ONEDNN_MAX_CPU_ISA).

    This reproduces which kernels and paths an AVX2-only machine has, not its
    speed: the cores, caches and memory are still this machine's."""
    from .errors import ConfigError
    from .machine import ISA_ENV, cpu_facts, emulated_isa
    environ = os.environ if environ is None else environ
    isa = emulated_isa(environ)
    if isa is None:
        return {}
    if not cpu_facts()["isa"].get("avx2"):
        raise ConfigError(f"{ISA_ENV}=avx2: this CPU has no AVX2 itself; unset {ISA_ENV}")
    path = [str(_SHIM_DIR), *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {ISA_ENV: isa, "PYTHONPATH": os.pathsep.join(path),
            "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


_TCMALLOC_FIX = ("tcmalloc is not installed: `apt-get install libtcmalloc-minimal4` "
                 "(Debian/Ubuntu; `make setup` does it when run as root)")
_IOMP_FIX = "Intel OpenMP is not installed in this environment: `pip install intel-openmp`"


def _preloads() -> dict:
    # Looked up when called, so tests can replace the finders.
    return {"tcmalloc": (tcmalloc_path, _TCMALLOC_FIX), "iomp": (iomp_path, _IOMP_FIX)}


class LibraryMissing(RuntimeError):
    """A preload library the configuration asks for is not installed here."""


def binding_env(bind: str = "auto", *, tcmalloc: bool = False,
                iomp: bool = False, in_process: bool = False,
                fork_core: bool = False, stack_room: bool = False,
                c_kernels: bool = False, huge_pages: bool = False) -> dict[str, str]:
    """Environment for a vLLM CPU server.

    `bind`: "auto" (vLLM's default: one core per rank, one reserved), "all"
    (every CPU this process may use, nothing reserved) or an explicit list for
    VLLM_CPU_OMP_THREADS_BIND. `tcmalloc` / `iomp` preload those libraries;
    a missing one raises LibraryMissing naming the package that provides it.
    `in_process`: the worker inside the engine-core process where `bind`
    gives it every core (`in_process_env`). `fork_core`: the engine-core
    process forked from the API server, its worker still spawned
    (FORK_CORE_ENV, read by `lab_utils.vllm_cli`). `stack_room`: vLLM's
    engine-core and worker loops with room on Python's frame stack
    (`lab_utils.pystack`, STACK_ROOM_ENV, read by `lab_utils.vllm_cli`).
    `c_kernels`: an eager engine's RMSNorm and SiLU-and-mul in vLLM's C kernels
    (`lab_utils.cpu_kernels`, C_KERNELS_ENV, read by `lab_utils.vllm_cli`).
    `huge_pages`: malloc's and PyTorch's memory on transparent huge pages
    (`lab_utils.huge_pages`; glibc's malloc, so not with `tcmalloc`)."""
    env: dict[str, str] = {FORK_CORE_ENV: "1"} if fork_core else {}
    if stack_room:
        env[STACK_ROOM_ENV] = "1"
    if c_kernels:
        env[C_KERNELS_ENV] = "1"
    if huge_pages:
        if tcmalloc:
            raise ValueError("huge_pages needs glibc's malloc, which tcmalloc replaces: "
                             "choose one")
        env.update(thp.env())
    if bind == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = all_cores()
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    elif bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    preload = []
    for lib, wanted in (("tcmalloc", tcmalloc), ("iomp", iomp)):
        if wanted:
            find, fix = _preloads()[lib]
            path = find()
            if path is None:
                raise LibraryMissing(fix)
            preload.append(path)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return in_process_env(env) if in_process else env


def arm_env(binding: Mapping[str, object], env: Mapping[str, str] | None,
            fresh: bool = False) -> dict[str, str]:
    """An arm's own environment (`env`) on a profile with this [cpu_binding];
    a `fresh` arm (its start is what a notebook measures, e.g. 03's cold
    starts) starts as `vllm serve` does, with vLLM's spawned engine core,
    where the profile forks it (`fork_engine_core`)."""
    out = {str(k): str(v) for k, v in (env or {}).items()}
    if fresh and binding.get("fork_engine_core"):
        out[FORK_CORE_ENV] = "0"
    return out


_WARNED: set[str] = set()


def profile_binding_env(binding: Mapping[str, object]) -> dict[str, str]:
    """`binding_env(**binding)` for a profile's [cpu_binding]; a preload library
    missing on this machine is left out with a warning (once) naming the fix:
    it makes the engine slower, not wrong."""
    kw = {"bind": str(binding.get("bind", "auto")),
          "fork_core": bool(binding.get("fork_engine_core")),
          "stack_room": bool(binding.get("stack_room")),
          "c_kernels": bool(binding.get("c_kernels")),
          "huge_pages": bool(binding.get("huge_pages"))}
    if kw["huge_pages"] and (why := thp.status()) and why not in _WARNED:
        _WARNED.add(why)
        import warnings
        warnings.warn(f"huge pages: {why}; the engine runs on 4 KiB pages (slower decode)",
                      stacklevel=2)
    for lib, (find, fix) in _preloads().items():
        kw[lib] = bool(binding.get(lib)) and find() is not None
        if binding.get(lib) and not kw[lib] and fix not in _WARNED:
            _WARNED.add(fix)
            import warnings
            warnings.warn(f"{fix}; the engine starts without it (slower prefill)", stacklevel=2)
    return binding_env(**kw)


def describe_env(env: Mapping[str, str]) -> str:
    """Short label of a binding environment, e.g. 'bind=0-1 +tcmalloc +iomp'."""
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    parts = [f"bind={bind}"]
    preload = env.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        parts.append("+tcmalloc")
    if "iomp" in preload:
        parts.append("+iomp")
    if env.get(MULTIPROCESSING) == "0":
        parts.append("+in-process")
    elif env.get(FORK_CORE_ENV) == "1":
        parts.append("+forked-core")
    if env.get(STACK_ROOM_ENV) == "1":
        parts.append("+stack-room")
    if env.get(C_KERNELS_ENV) == "1":
        parts.append("+c-kernels")
    if thp.HUGETLB in env.get(thp.TUNABLES, "").split(":"):
        parts.append("+huge-pages")
    return " ".join(parts)


_BANDWIDTH_SCRIPT = r"""
import json, sys, time, torch
threads, mib = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
x.sum()  # touch every page first
times = []
for _ in range(7):
    t0 = time.perf_counter(); x.sum(); times.append(time.perf_counter() - t0)
times.sort()
huge = [int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup")
        if l.startswith("AnonHugePages:")]
print(json.dumps({"threads": threads, "bytes": x.numel() * 4, "seconds_median": times[3],
                  "gb_per_s": x.numel() * 4 / times[3] / 1e9,
                  "huge_page_bytes": huge[0] if huge else 0}))
"""


def read_bandwidth(threads: int = 1, mib: int = 1024) -> dict:
    """Measured memory read bandwidth of a `mib`-MiB float32 sum with `threads`
    torch threads, in a fresh process, the median of 7: `gb_per_s` (1e9 bytes),
    and `huge_page_bytes`, how much of that process's memory was on huge pages
    (`_run_script`)."""
    return _run_script(_BANDWIDTH_SCRIPT, threads, mib, timeout=300)


def read_bandwidth_gbs(threads: int = 1, mib: int = 1024) -> float:
    """`read_bandwidth`'s GB/s."""
    return float(read_bandwidth(threads, mib)["gb_per_s"])


def _run_script(script: str, *args, timeout: float) -> dict:
    """Run a measurement `script` in a fresh Python process (its own threads,
    nothing of this process's allocations) and read the JSON of its last line.
    It computes with the kernels the lab's engines use: under `LAB_CPU_ISA=avx2`,
    AVX2's (`isa_env`), and on transparent huge pages where the machine has
    them (`lab_utils.huge_pages`): what it measures is the memory and the
    kernels, not 4 KiB pages' TLB misses."""
    pages = thp.env() if thp.status() is None else {}
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                          env={**os.environ, **isa_env(), **pages},
                          capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


_LINEARS_SCRIPT = r"""
import json, sys, time, torch
shapes, threads, steps = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dtype = getattr(torch, sys.argv[4])
torch.set_num_threads(threads)
F = torch.nn.functional
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
layers = []
for n, k in shapes:  # distinct weights per layer: they stream from memory as in a step
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k) * 0.02).to(dtype), requires_grad=False)
    layer.bias = None
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)  # the engine's own choice
    layers.append((layer, torch.randn(1, k).to(dtype)))
def rel_diff(layer, x):
    ours, ref = layer.cpu_linear(x, layer.weight, None).float(), F.linear(x, layer.weight).float()
    return float((ours - ref).abs().max() / ref.abs().max())
diff = max(rel_diff(layer, x) for layer, x in layers)
times, aten = [], []
for _ in range(steps + 3):  # the two paths in turn, so drift of the machine hits both alike
    t0 = time.perf_counter()
    for layer, x in layers:
        layer.cpu_linear(x, layer.weight, None)
    t1 = time.perf_counter()
    for layer, x in layers:
        F.linear(x, layer.weight)
    times.append(t1 - t0)
    aten.append(time.perf_counter() - t1)
times, aten = sorted(times[3:]), sorted(aten[3:])
print(json.dumps({"ms_median": times[len(times) // 2] * 1e3, "ms_min": times[0] * 1e3,
                  "aten_ms_median": aten[len(aten) // 2] * 1e3, "aten_ms_min": aten[0] * 1e3,
                  "max_rel_diff": diff,
                  "bytes": sum(n * k for n, k in shapes) * dtype.itemsize}))
"""


def decode_linears_ms(shapes: list[tuple[int, int]], threads: int, steps: int = 21,
                      dtype: str = "float32") -> dict:
    """The matrix products of one single-request decode step (`shapes`:
    `ModelFacts.decode_linear_shapes()`, weights and activations in `dtype`) alone, through the GEMM vLLM's
    CPU backend picks for them (`dispatch_cpu_unquantized_gemm`: oneDNN, SGL or
    zentorch), in a fresh process with `threads` torch threads: `ms_median` and
    `ms_min` over `steps` steps, and the weight `bytes` they read. What the
    engine's forward pass cannot beat with these kernels, however little else
    it does. Beside them, in turn with them, the same products through ATen's
    `torch.nn.functional.linear` on the same weights (`aten_ms_median`,
    `aten_ms_min`): vLLM packs each weight for oneDNN, whose kernel is not
    always the fastest for one row of activations. `max_rel_diff`: the largest
    difference between the two paths' outputs, relative to the output's
    largest value (the same product, summed in another order)."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16 (unquantized weights), "
                         f"got {dtype!r}")
    return _run_script(_LINEARS_SCRIPT, json.dumps(shapes), threads, steps, dtype, timeout=600)


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of the safetensors weights in a model folder (read once per decode step)."""
    files = list(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return sum(f.stat().st_size for f in files)


def decode_floor_ms(weight_bytes_: int, bandwidth_gbs: float) -> float:
    """The memory-bandwidth floor of one decode step: every weight byte is read
    once per step, so a step cannot take less than bytes / bandwidth."""
    if bandwidth_gbs <= 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {bandwidth_gbs!r}")
    return weight_bytes_ / (bandwidth_gbs * 1e9) * 1e3
