"""lab_utils.huge_pages: malloc's memory on transparent huge pages, checked
against what the kernel reports for a real process (AnonHugePages)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lab_utils import cpu_tuning, huge_pages

# A process that mallocs 64 MiB, touches every page, and reports how much of its
# memory the kernel holds on huge pages.
MALLOC_64_MIB = r"""
import ctypes, json
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
n = 64 << 20
p = libc.malloc(n)
ctypes.memset(p, 1, n)
huge = [int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup")
        if l.startswith("AnonHugePages:")]
print(json.dumps({"huge": huge[0] if huge else 0}))
"""


def huge_bytes_of_malloc(env: dict[str, str]) -> int:
    base = {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", huge_pages.TUNABLES, huge_pages.TORCH_THP)}
    out = subprocess.run([sys.executable, "-c", MALLOC_64_MIB], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["huge"]


needs_huge_pages = pytest.mark.skipif(huge_pages.status() is not None,
                                      reason=f"{huge_pages.status()}")


@needs_huge_pages
def test_the_tunable_puts_mallocs_memory_on_huge_pages():
    assert huge_bytes_of_malloc(huge_pages.env({})) >= 32 << 20
    if huge_pages.thp_mode() == "madvise":   # only what is asked for
        assert huge_bytes_of_malloc({}) < 8 << 20


@needs_huge_pages
def test_tcmalloc_replaces_the_malloc_the_tunable_tells():
    # why a profile cannot ask for both (cpu_tuning.binding_env refuses)
    path = cpu_tuning.tcmalloc_path()
    if path is None or huge_pages.thp_mode() != "madvise":
        pytest.skip("needs tcmalloc and THP 'madvise'")
    assert huge_bytes_of_malloc({**huge_pages.env({}), "LD_PRELOAD": path}) < 8 << 20
    with pytest.raises(ValueError, match="tcmalloc"):
        cpu_tuning.binding_env("all", tcmalloc=True, huge_pages=True)


def test_the_tunable_keeps_what_glibc_tunables_already_set():
    assert huge_pages.with_hugetlb(None) == "glibc.malloc.hugetlb=1"
    assert (huge_pages.with_hugetlb("glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=0")
            == "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1")
    env = cpu_tuning.binding_env("all", huge_pages=True)
    assert "hugetlb=1" in env[huge_pages.TUNABLES] and "LD_PRELOAD" not in env
    assert "+huge-pages" in cpu_tuning.describe_env(env)
    assert "+huge-pages" not in cpu_tuning.describe_env(cpu_tuning.binding_env("all"))


def test_thp_setting_and_glibc_decide_whether_there_are_huge_pages(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(setting) == "madvise"
    assert huge_pages.thp_mode(tmp_path / "missing") is None
    assert huge_pages.status("madvise", (2, 36)) is None
    assert huge_pages.status("always", (2, 35)) is None
    assert "glibc 2.35" in huge_pages.status("madvise", (2, 31))
    assert "'never'" in huge_pages.status("never", (2, 36))
    assert "no transparent huge pages" in huge_pages.status(None, (2, 36))


@needs_huge_pages
def test_the_floors_bandwidth_sum_runs_on_huge_pages():
    read = cpu_tuning.read_bandwidth(1, mib=64)
    assert read["huge_page_bytes"] >= read["bytes"] // 2, read
