"""The `cpu` profile forks vLLM's engine-core process from its API server
(`[cpu_binding] fork_engine_core`, `lab_utils.vllm_cli.fork_engine_core`) and
still spawns the worker; a `fresh` arm (its start is the measurement) starts
as `vllm serve` does."""
from __future__ import annotations

import dataclasses
import os

import psutil
import pytest

import lab_utils as lab
from lab_utils import cpu_tuning, pystack
from lab_utils.cpu_tuning import FORK_CORE_ENV
from lab_utils.experiments import baseline as baseline_nb
from lab_utils.experiments import prompt_length_and_warmup
from lab_utils.plan import build_engine
from lab_utils.server import lab_server_processes

METHOD = b"VLLM_WORKER_MULTIPROC_METHOD="


def test_the_profile_asks_the_launcher_to_fork_the_engine_core(cpu):
    assert cpu.cpu_binding["fork_engine_core"] is True
    # asked for a worker process of its own, as on 2 or more CPUs
    env = cpu.server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # an engine-core process
    assert env[FORK_CORE_ENV] == "1"
    assert "+forked-core" in cpu_tuning.describe_env(env).split()
    assert FORK_CORE_ENV not in cpu_tuning.binding_env("all")
    # where the worker computes inside the engine core, that process is spawned
    inside = cpu_tuning.binding_env("all", in_process=True, fork_core=True)
    assert inside["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and FORK_CORE_ENV not in inside


def test_a_fresh_arm_spawns_its_engine_core_as_vllm_serve_does(cpu):
    # 03's cold starts are its measurement: vLLM's own start, in its plan too. With
    # the worker in its own process whatever this process's CPUs (on one CPU the
    # profile puts it inside the engine core, which then stays spawned anyway).
    cpu = dataclasses.replace(cpu, cpu_binding={**cpu.cpu_binding, "in_process": False})
    plan = prompt_length_and_warmup.plan(cpu, {})
    assert plan.arms and all(a.fresh for a in plan.arms)
    for arm in plan.arms:
        assert build_engine(cpu, arm, None).env[FORK_CORE_ENV] == "0"
        assert cpu.server_env(cpu_tuning.arm_env(cpu.cpu_binding, arm.env, arm.fresh))[
            FORK_CORE_ENV] == "0"
    assert cpu_tuning.arm_env(cpu.cpu_binding, {"A": "1"}, fresh=False) == {"A": "1"}
    assert cpu_tuning.arm_env({}, None, fresh=True) == {}   # a profile that does not fork
    baseline = baseline_nb.plan(cpu, {}).arms[0]
    assert build_engine(cpu, baseline, None).env[FORK_CORE_ENV] == "1"


def _environ(proc: psutil.Process) -> list[bytes]:
    with open(f"/proc/{proc.pid}/environ", "rb") as f:
        return f.read().split(b"\0")


@pytest.mark.engine
def test_the_engine_core_is_forked_its_worker_spawned_and_both_loop_in_room(cpu, tmp_path):
    # /proc/PID/environ is the environment a process was exec'd with. A spawned
    # process is a new exec that gets the parent's environment at that moment,
    # including the VLLM_WORKER_MULTIPROC_METHOD=spawn vLLM's CPU platform sets;
    # a forked one is no exec and keeps the API server's, which has none.
    with lab.EnginePool(cpu, log_dir=tmp_path) as pool:
        # an engine-core process of its own even where this stream has one CPU
        engine = pool.get(env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        api = psutil.Process(engine.server.proc.pid)
        procs = api.children(recursive=True)
        cores = [p for p in procs if p.name().startswith("VLLM::EngineCor")]
        workers = [p for p in procs if "Worker" in p.name()]
        assert len(cores) == 1 and len(workers) == 1, [p.name() for p in procs]
        core, worker = cores[0], workers[0]
        assert core.ppid() == api.pid and worker.ppid() == core.pid
        assert not any(v.startswith(METHOD) for v in _environ(api))
        assert not any(v.startswith(METHOD) for v in _environ(core)), "the engine core was spawned"
        assert METHOD + b"spawn" in _environ(worker), "the worker was not spawned"
        # both loops run with room on Python's frame stack (`[cpu_binding] stack_room`,
        # lab_utils.pystack), each saying so in the engine's log with its own pid
        log = engine.server.log_path.read_text(errors="replace")
        for loop, proc in (("engine-core", core), ("worker", worker)):
            line = pystack.LOG_LINE.format(loop=loop, pid=proc.pid,
                                           kib=pystack.ROOM_BYTES // 1024)
            assert line in log, (line, [x for x in log.splitlines() if "pystack" in x])
        # and it serves: greedy tokens from the spawned worker
        run = lab.measure(engine, [lab.RequestSpec(prompt="The capital of France is",
                                                   max_tokens=8, ignore_eos=True)],
                          lab.Load.sequential(), label="forked core", progress=False)
        assert run.records[0].ok and run.records[0].output_tokens == 8
    assert lab_server_processes(owner=os.getpid()) == []
