"""Room on Python's frame stack for vLLM's engine-core and worker loops.

CPython 3.11 and 3.12 keep a thread's frames in chunks of 16 KiB and give a
chunk back to the system (munmap) as soon as the call that opened it returns
(CPython issue gh-142183; 3.13 and 3.14 keep one chunk since March 2026). A loop
whose calls go back and forth across a chunk's end therefore maps and unmaps
memory at every crossing. Where the loop is vLLM's CPU worker, each munmap is
also a TLB shootdown: an interrupt to the other core, where the worker's other
OpenMP thread waits, spinning, for the next parallel region; in a virtual
machine that interrupt exits to the hypervisor.

`in_room(fn, *args, **kwargs)` calls `fn` from a frame that opens a chunk of
its own with ~135 KiB free above it, so every call below stays in that chunk
(a decode step's Python is far shallower). `install()` makes vLLM's engine-core
loop and worker loop run that way; `lab_utils.vllm_cli serve` calls it where
the profile asks for it (`[cpu_binding] stack_room`, STACK_ROOM_ENV). Measured
in profiles/cpu.toml and `benchmarks/thread_binding.py` ("+stackroom").
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

#: Set to "1" by the profile's binding (`cpu_tuning.binding_env(stack_room=True)`):
#: `lab_utils.vllm_cli serve` then calls `install()`. Read by the lab's launcher,
#: not by vLLM.
STACK_ROOM_ENV = "LAB_STACK_ROOM"

#: CPython's data-stack chunk (Python/pystate.c, 3.11-3.13): DATA_STACK_CHUNK_SIZE,
#: and the slots push_chunk adds to a frame's before doubling a new chunk's size.
CHUNK_BYTES = 16 * 1024
MINIMUM_OVERHEAD_SLOTS = 1000
SLOT_BYTES = 8 if sys.maxsize > 2**32 else 4
#: Slots of the frame `in_room` calls from: 8 x (15,400 + 1,000) bytes is just
#: over 128 KiB, so the chunk it opens is 256 KiB and ~136 KiB of it is left
#: above the frame.
ROOM_FRAME_SLOTS = 15_400


def chunk_bytes_for(frame_slots: int) -> int:
    """The size of the chunk CPython 3.11-3.13 opens for a frame of
    `frame_slots` slots that does not fit in the current one (`push_chunk`)."""
    size = CHUNK_BYTES
    while size < SLOT_BYTES * (frame_slots + MINIMUM_OVERHEAD_SLOTS):
        size *= 2
    return size


#: Bytes free above the room frame in its chunk.
ROOM_BYTES = chunk_bytes_for(ROOM_FRAME_SLOTS) - SLOT_BYTES * ROOM_FRAME_SLOTS


def _room(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


# A frame's size is its code's locals + evaluation stack (+ a few slots): a
# larger co_stacksize makes the frame larger and changes nothing else.
_room.__code__ = _room.__code__.replace(co_stacksize=ROOM_FRAME_SLOTS)


def in_room(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, every call below it in one chunk of Python's
    frame stack, never mapped and unmapped again while it runs. Meant for a
    process's or thread's outermost loop: the frame that opens the chunk must
    not fit in the chunk in use (true for a new thread, whose first chunk is
    16 KiB)."""
    return _room(fn, args, kwargs)


_ORIGINALS: dict[str, Callable[..., Any]] = {}

#: The vLLM loops `install` routes through this module: name -> (module, class).
_LOOPS = {"run_engine_core": ("vllm.v1.engine.core", "EngineCoreProc"),
          "worker_main": ("vllm.v1.executor.multiproc_executor", "WorkerProc")}


def _owner(name: str) -> type:
    import importlib
    module, cls = _LOOPS[name]
    return getattr(importlib.import_module(module), cls)


def _original(name: str) -> Callable[..., Any]:
    # In a spawned process this module is imported afresh and vLLM's classes are
    # unpatched; in a forked one the parent's originals are here.
    if name in _ORIGINALS:
        return _ORIGINALS[name]
    return getattr(_owner(name), name)


#: What each process in room writes to the engine's log, e.g.
#: "lab_utils.pystack: worker loop (pid 123) runs with 135 KiB of room on Python's frame stack".
LOG_LINE = "lab_utils.pystack: {loop} loop (pid {pid}) runs with {kib} KiB of room on Python's frame stack"


def _say(loop: str) -> None:
    print(LOG_LINE.format(loop=loop, pid=os.getpid(), kib=ROOM_BYTES // 1024),
          file=sys.stderr, flush=True)


def run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """vLLM's engine-core process (`EngineCoreProc.run_engine_core`), in room,
    starting its workers in room too."""
    _patch_worker()
    _say("engine-core")
    return in_room(_original("run_engine_core"), *args, **kwargs)


def worker_main(*args: Any, **kwargs: Any) -> Any:
    """vLLM's worker process (`WorkerProc.worker_main`), in room."""
    _say("worker")
    return in_room(_original("worker_main"), *args, **kwargs)


def _patch(name: str, replacement: Callable[..., Any]) -> None:
    cls = _owner(name)
    if name not in _ORIGINALS:
        found = cls.__dict__[name]   # vLLM 0.32: a staticmethod
        _ORIGINALS[name] = getattr(found, "__func__", found)
    setattr(cls, name, staticmethod(replacement))


def _patch_worker() -> None:
    _patch("worker_main", worker_main)


def install() -> None:
    """Start vLLM's engine-core processes (and so their workers) through
    `run_engine_core`. Both are module-level functions: a spawned process finds
    them by name, as it finds vLLM's own."""
    _patch("run_engine_core", run_engine_core)
    _patch_worker()
