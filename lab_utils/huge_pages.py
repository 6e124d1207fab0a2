"""Transparent huge pages for a CPU engine's memory: its weights above all.

A decode step streams every weight from memory once. With 4 KiB pages that is
~131,000 pages a step for the embedded model's 513 MiB of float32 weights, and
each TLB miss walks the page tables, in a virtual machine twice over (the
guest's and the host's). Linux's transparent huge pages (2 MiB) cut the walks
512-fold, but most distributions set them to "madvise": only memory a process
asks for gets them, and neither tcmalloc, nor glibc's malloc by default, nor
PyTorch's allocator (unless THP_MEM_ALLOC_ENABLE=1) asks. vLLM's CPU GEMM reads
oneDNN's packed copy of each weight, allocated by malloc, not by PyTorch.

glibc 2.35+ asks when told to: `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` makes
malloc advise MADV_HUGEPAGE on the memory it maps, so the pages come in huge as
they are first touched: no copy, no cost at the start. That needs glibc's malloc,
so not tcmalloc (which replaces it: a profile cannot ask for both). No root is
needed. Where glibc is older or THP is "never" the tunable changes nothing and
the engine runs on 4 KiB pages; `status()` says which.

The profile's `[cpu_binding] huge_pages` sets the variable for every process of
a local CPU engine (`cpu_tuning.binding_env`). The measurement scripts of the
decode floor (`cpu_tuning.read_bandwidth`, `decode_linears_ms`) allocate on
huge pages too, so the floor is the memory's bandwidth, not the page walks'.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TUNABLES = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb=1"
#: PyTorch's own switch: its CPU allocator advises MADV_HUGEPAGE on blocks of 2 MiB or more.
TORCH_THP = "THP_MEM_ALLOC_ENABLE"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIN_GLIBC = (2, 35)


def thp_mode(path: Path = THP_SETTING) -> str | None:
    """The kernel's THP setting ("always", "madvise" or "never"); None where
    there is none to read (not Linux, or no THP support)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def glibc_version() -> tuple[int, int] | None:
    """This process's glibc (major, minor); None where the C library is not glibc."""
    lib, version = platform.libc_ver()
    if lib != "glibc" or not version:
        return None
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    return major, minor


_HERE: Any = object()


def status(mode: str | None = _HERE, glibc: tuple[int, int] | None = _HERE) -> str | None:
    """None where huge pages for malloc are available (on this machine, or
    with the THP `mode` and `glibc` version given), else why not (one line)."""
    mode = thp_mode() if mode is _HERE else mode
    glibc = glibc_version() if glibc is _HERE else glibc
    if mode is None:
        return "this kernel has no transparent huge pages"
    if mode == "never":
        return f"the kernel's transparent huge pages are 'never' ({THP_SETTING})"
    if glibc is None or glibc < MIN_GLIBC:
        have = "not glibc" if glibc is None else f"glibc {glibc[0]}.{glibc[1]}"
        return f"malloc's huge pages need glibc 2.35 or later ({have} here)"
    return None


def with_hugetlb(tunables: str | None) -> str:
    """GLIBC_TUNABLES with malloc's huge pages added to what it already sets
    (tunables are colon-separated; a hugetlb setting already there is replaced)."""
    kept = [t for t in (tunables or "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    return ":".join([*kept, HUGETLB])


def env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that put a process's malloc and PyTorch allocations on huge
    pages, merged with `environ`'s GLIBC_TUNABLES (default: this process's)."""
    environ = os.environ if environ is None else environ
    return {TUNABLES: with_hugetlb(environ.get(TUNABLES)), TORCH_THP: "1"}


def anon_huge_bytes(pid: int | str = "self") -> int:
    """Anonymous memory of a process on huge pages (`/proc/<pid>/smaps_rollup`
    AnonHugePages), in bytes; 0 where it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
