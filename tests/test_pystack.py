"""`lab_utils.pystack`: room on Python's frame stack for vLLM's loops.

What CPython does is checked against the kernel's own count: the minor page
faults of a thread that calls, again and again, a function whose frame does
not fit in the chunk of frame stack in use. Each such call maps a new chunk
and touches it (a fault); on return the chunk is unmapped (CPython 3.11 and
3.12; gh-142183)."""
from __future__ import annotations

import pickle
import resource
import sys
import threading

import pytest

from lab_utils import cpu_tuning, pystack
from lab_utils.cpu_tuning import describe_env
from lab_utils.profiles import load_profile

CALLS = 2000


def _big_leaf():
    return None


# 2,500 slots (20,000 bytes) never fit in a 16 KiB chunk: every call outside
# in_room opens one
_big_leaf.__code__ = _big_leaf.__code__.replace(co_stacksize=2500)


def _calls():
    for _ in range(CALLS):
        _big_leaf()


def _faults_in_new_thread(fn) -> int:
    """Minor page faults of this process while a new thread (a fresh frame
    stack, as a process's main thread has) runs `fn`."""
    out = {}

    def run():
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        fn()
        out["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["faults"]


CHURNS = sys.version_info[:2] in ((3, 11), (3, 12))


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="needs Linux's RUSAGE_THREAD")
def test_calls_below_in_room_stay_in_one_chunk():
    bare = _faults_in_new_thread(_calls)
    roomy = _faults_in_new_thread(lambda: pystack.in_room(_calls))
    if CHURNS:
        # the fact pystack is about: a chunk mapped and touched at every call
        assert bare >= CALLS, bare
    # the room frame's chunk is touched once (a few pages), its calls fault no more
    assert roomy < CALLS / 10, (bare, roomy)


def test_in_room_passes_arguments_and_results_and_exceptions():
    assert pystack.in_room(lambda a, b=0: a - b, 5, b=2) == 3
    with pytest.raises(KeyError):
        pystack.in_room({}.__getitem__, "x")


def test_chunk_sizes_by_hand():
    # push_chunk: 16 KiB, doubled while smaller than 8 x (slots + 1000) bytes
    assert pystack.chunk_bytes_for(0) == 16384
    assert pystack.chunk_bytes_for(1048) == 16384      # 8 x 2048 = 16384 exactly
    assert pystack.chunk_bytes_for(1049) == 32768
    assert pystack.chunk_bytes_for(2500) == 32768      # _big_leaf's: > 16 KiB
    # the room frame: 8 x 16,400 = 131,200 > 128 KiB, so a 256 KiB chunk, and
    # 262,144 - 8 x 15,400 = 138,944 bytes above the frame
    assert pystack.chunk_bytes_for(pystack.ROOM_FRAME_SLOTS) == 262144
    assert pystack.ROOM_BYTES == 138944


def test_install_routes_vllm_loops_through_functions_a_spawned_process_finds(monkeypatch):
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc
    core, worker = EngineCoreProc.run_engine_core, WorkerProc.worker_main
    monkeypatch.setattr(pystack, "_ORIGINALS", {})
    monkeypatch.setattr(EngineCoreProc, "run_engine_core", staticmethod(core))
    monkeypatch.setattr(WorkerProc, "worker_main", staticmethod(worker))
    pystack.install()
    pystack.install()  # twice: the originals are still vLLM's, not the lab's
    assert EngineCoreProc.run_engine_core is pystack.run_engine_core
    assert WorkerProc.worker_main is pystack.worker_main
    assert pystack._original("run_engine_core") is core
    assert pystack._original("worker_main") is worker
    # multiprocessing's spawn pickles a Process target by name
    for fn in (EngineCoreProc.run_engine_core, WorkerProc.worker_main):
        assert pickle.loads(pickle.dumps(fn)) is fn


def test_the_profile_asks_for_room_and_the_binding_carries_it():
    cpu = load_profile("cpu")
    assert cpu.cpu_binding.get("stack_room") is True
    env = cpu_tuning.profile_binding_env(cpu.cpu_binding)
    assert env[pystack.STACK_ROOM_ENV] == "1"
    assert "+stack-room" in describe_env(env)
    assert pystack.STACK_ROOM_ENV not in cpu_tuning.binding_env("all")
