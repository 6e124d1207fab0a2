"""Engines started side by side (`EnginePool.get(ahead=...)`, which a notebook's
`ctx.arm` uses for the plan's next arm): both servers start before either is
waited for, the one started ahead is handed out later without a start of its
own, a failed start ahead fails nothing, and where it is off each waits for the
one before. Stand-in servers (a Python process answering /health after a set
delay) take the place of vLLM, so the times are known in advance."""
from __future__ import annotations

import dataclasses
import sys
import time

import pytest

from lab_utils import arms
from lab_utils import server as srv
from lab_utils.errors import ServerError
from lab_utils.report import engine_budget

DELAY_S = 3.0

#: Serves /health (and POST /reset_prefix_cache) with 200 after `delay` seconds
#: (argv: --port P --delay D [--fail]); with --fail it exits with code 1 instead.
STAND_IN = r'''
import http.server, sys, time
args = sys.argv[1:]
port, delay = int(args[args.index("--port") + 1]), float(args[args.index("--delay") + 1])
time.sleep(delay)
if "--fail" in args:
    print("stand-in: failing as asked", flush=True)
    sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def do_POST(self):  # the broker's /reset_prefix_cache before it lends one
        self.send_response(200 if self.path == "/reset_prefix_cache" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def pool(cpu, tmp_path, monkeypatch):
    """An EnginePool of the cpu profile whose servers are stand-ins: flag
    `delay` sets how long one takes to start, `fail` makes it exit instead."""
    monkeypatch.delenv("LAB_ENGINE_SHARE", raising=False)   # no broker: this pool starts them

    def argv(profile, flags, *, port, model):
        out = [sys.executable, "-c", STAND_IN, "--port", str(port),
               "--delay", str(flags.get("delay", DELAY_S))]
        return out + (["--fail"] if flags.get("fail") else [])
    monkeypatch.setattr(srv, "engine_argv", argv)
    monkeypatch.setattr(srv, "cache_config", lambda url: {})
    profile = dataclasses.replace(cpu, model=str(tmp_path), startup_timeout_s=30)
    p = srv.EnginePool(profile, log_dir=tmp_path / "logs")
    yield p
    p.close()


def test_the_engine_ahead_starts_beside_the_one_asked_for_and_is_handed_out_later(
        pool, monkeypatch):
    monkeypatch.setenv(srv.START_AHEAD_ENV, "1")   # also on a stream's single CPU
    t0 = time.perf_counter()
    a = pool.get(ahead=[(None, {"delay": DELAY_S + 0.1}, None)], delay=DELAY_S)
    took = time.perf_counter() - t0
    # one after the other: >= 2 x 3 s; side by side: both up in about one delay
    assert took < 2 * DELAY_S - 0.5, f"{took:.1f} s: the engine ahead was not started beside"
    assert a.server.alive and a.server.startup_s >= DELAY_S
    ahead = pool._engines[srv.engine_key(None, {"delay": DELAY_S + 0.1}, {})]
    assert ahead.server.alive and ahead.server.startup_s >= DELAY_S + 0.1
    assert abs(ahead.server.started_at - a.server.started_at) < 1.0
    assert (a.started_beside, ahead.started_beside) == (
        srv.engine_key(None, {"delay": DELAY_S + 0.1}, {}), srv.engine_key(None, {"delay": DELAY_S}, {}))
    assert a.server.alive   # started ahead, not counted against keep=1: both run
    t0 = time.perf_counter()
    b = pool.get(delay=DELAY_S + 0.1)                # its turn: no start of its own
    assert time.perf_counter() - t0 < 1.0 and b is ahead
    assert not a.server.alive                        # now keep=1 stops the one before
    # the run's budget counts the two overlapping starts once
    results = {"nb": {"engines": [{**e.describe(), "command": e.command} for e in (a, b)]}}
    budget = engine_budget(results, {"notebooks": [{"seconds": 60.0}]})
    assert budget["side_by_side"] == 2 and budget["starts"] == 2
    assert budget["startup_s"] < budget["own_s"] - DELAY_S + 1.0


def test_a_failed_start_ahead_fails_nothing_and_fails_in_its_turn(pool, monkeypatch):
    monkeypatch.setenv(srv.START_AHEAD_ENV, "1")
    a = pool.get(ahead=[(None, {"delay": 0.5, "fail": True}, None)], delay=1.0)
    assert a.server.alive and a.started_beside is None
    assert list(pool._engines) == [srv.engine_key(None, {"delay": 1.0}, {})]
    with pytest.raises(ServerError, match="exited with code 1"):
        pool.get(delay=0.5, fail=True)               # started again, alone, in its turn


def test_turned_off_each_engine_waits_for_the_one_before(pool, monkeypatch):
    monkeypatch.setenv(srv.START_AHEAD_ENV, "0")
    assert not pool.starts_side_by_side()
    t0 = time.perf_counter()
    pool.get(ahead=[(None, {"delay": 1.1}, None)], delay=1.0)
    assert len(pool._engines) == 1                   # nothing started ahead
    pool.get(delay=1.1)
    assert time.perf_counter() - t0 >= 2.1


def test_never_on_a_gpu_or_a_remote_server(monkeypatch, tmp_path):
    from lab_utils.profiles import load_profile
    monkeypatch.setenv(srv.START_AHEAD_ENV, "1")
    for name in ("gpu", "remote"):
        p = srv.EnginePool(load_profile(name, base_url="http://127.0.0.1:9"), log_dir=tmp_path)
        assert not p.starts_side_by_side(), name


def test_unset_it_follows_the_cpus_this_process_may_use(pool, monkeypatch):
    monkeypatch.delenv(srv.START_AHEAD_ENV, raising=False)
    monkeypatch.setattr(srv.os, "sched_getaffinity", lambda pid: {0})
    assert not pool.starts_side_by_side()
    monkeypatch.setattr(srv.os, "sched_getaffinity", lambda pid: {0, 1})
    assert pool.starts_side_by_side()


def test_the_arms_ahead_are_the_plans_others_in_turn_unless_a_start_is_measured(cpu, tmp_path):
    from lab_utils.notebook import NotebookContext
    from lab_utils.results import Results

    def ctx(*arm_list):
        plan = arms.Plan("nb", tuple(arm_list))
        return NotebookContext("nb", cpu, srv.EnginePool(cpu, log_dir=tmp_path),
                               Results("nb", tmp_path / "r"), {}, plan=plan)
    a, b, c = (arms.Arm(n, flags={"max_num_seqs": i + 2}) for i, n in enumerate("abc"))
    cold = arms.Arm("cold", flags={"max_num_seqs": 9}, fresh=True)
    plain = ctx(a, b, c)
    assert [plain._arms_after(x) for x in (a, b, c)] == [[b, c], [c, a], [a, b]]
    mixed = ctx(a, cold, b)
    assert mixed._arms_after(a) == [b] and mixed._arms_after(cold) == []


def test_budget_counts_overlapping_starts_once():
    cmd = "vllm serve M --port {} --max-num-seqs {}"
    results = {"nb": {"engines": [
        {"command": cmd.format(1, 2), "startup_s": 30.0, "started_at": 100.0},
        {"command": cmd.format(2, 3), "startup_s": 38.0, "started_at": 102.0},
        {"command": cmd.format(3, 4), "startup_s": 20.0, "started_at": 200.0},
        {"command": cmd.format(4, 5), "startup_s": 10.0}]}}   # no launch time: apart
    b = engine_budget(results, {"notebooks": [{"seconds": 400.0}]})
    # [100, 130] and [102, 140] overlap: 40 s; [200, 220]: 20 s; the untimed one: 10 s
    assert (b["startup_s"], b["own_s"], b["side_by_side"]) == (70.0, 98.0, 2)
    assert b["share"] == 70.0 / 400.0


def test_through_the_runs_broker_both_start_side_by_side_and_are_its_to_lend(
        pool, monkeypatch):
    """In a run the broker starts a kernel's engines: it launches each on its
    one starter thread and waits for each on the call's own thread, so the
    kernel's two calls start side by side."""
    from lab_utils.engine_share import SHARE_ENV, Broker
    monkeypatch.setenv(srv.START_AHEAD_ENV, "1")
    with Broker([("logs", [])], min_free_fraction=0) as broker:
        monkeypatch.setenv(SHARE_ENV, broker.url)
        t0 = time.perf_counter()
        a = pool.get(ahead=[(None, {"delay": DELAY_S + 0.1}, None)], delay=DELAY_S)
        took = time.perf_counter() - t0
        assert took < 2 * DELAY_S - 0.5, f"{took:.1f} s: the broker started them one by one"
        assert broker.starts == 2
        b = pool.get(delay=DELAY_S + 0.1)
        assert b.started_beside and b.server.startup_s >= DELAY_S + 0.1
        assert abs(a.server.started_at - b.server.started_at) < 1.0
        assert not a.server.alive                    # given back when b's turn came


def test_short_of_memory_nothing_starts_ahead(pool, monkeypatch):
    import psutil
    monkeypatch.setenv(srv.START_AHEAD_ENV, "1")
    total = 16 * 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type(
        "Mem", (), {"total": total, "available": int(total * (srv.AHEAD_MIN_FREE - 0.01))})())
    pool.get(ahead=[(None, {"delay": 0.6}, None)], delay=0.5)
    assert len(pool._engines) == 1


@pytest.mark.parametrize("while_starting", ["the one asked for", "the one ahead"])
def test_ctrl_c_while_they_start_leaves_no_server_running(pool, monkeypatch, while_starting):
    import os
    import signal
    import threading
    monkeypatch.setenv(srv.START_AHEAD_ENV, "1")
    # Ctrl-C at 1.5 s: while the first (2.5 s) still starts, or while the
    # first is up (0.5 s) and the one ahead (2.5 s) still starts
    first, second = (2.5, 2.4) if while_starting == "the one asked for" else (0.5, 2.5)
    timer = threading.Timer(1.5, signal.pthread_kill, (threading.main_thread().ident,
                                                        signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.get(ahead=[(None, {"delay": second}, None)], delay=first)
    finally:
        timer.cancel()
    deadline = time.monotonic() + 10
    while srv.lab_server_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.lab_server_processes(os.getpid()) == []
    assert not pool._ahead


def test_when_the_broker_lends_the_one_asked_for_the_next_two_start_side_by_side(
        pool, monkeypatch):
    """04's baseline is 00's engine, lent at once: its next two arms start
    together instead of one beside a start that never happens."""
    from lab_utils.engine_share import SHARE_ENV, Broker
    monkeypatch.setenv(srv.START_AHEAD_ENV, "1")
    with Broker([], min_free_fraction=0) as broker:
        monkeypatch.setenv(SHARE_ENV, broker.url)
        pool.get(delay=0.5)
        broker.demand = [("logs", {e.key for e in broker._engines})]  # a later use: kept idle
        pool.close()
        assert broker.describe()["running"][0]["leased"] is False
        b, c = {"delay": DELAY_S}, {"delay": DELAY_S + 0.1}
        t0 = time.perf_counter()
        a = pool.get(ahead=[(None, b, None), (None, c, None)], delay=0.5)
        took = time.perf_counter() - t0
        assert a.server.reused and broker.reuses == 1
        assert took < 2 * DELAY_S - 0.5, f"{took:.1f} s: the two ahead started one by one"
        kb, kc = srv.engine_key(None, b, {}), srv.engine_key(None, c, {})
        assert pool._ahead == {kb, kc} and broker.starts == 3
        assert (a.started_beside, pool._engines[kb].started_beside,
                pool._engines[kc].started_beside) == (None, kc, kb)


def test_an_engine_started_before_never_starts_ahead_again(pool, monkeypatch):
    """The last arm's candidates wrap round to the plan's first ones, which ran
    and stopped already (keep=1): none of them starts again ahead."""
    monkeypatch.setenv(srv.START_AHEAD_ENV, "1")
    x, y = {"delay": 0.3}, {"delay": 0.4}
    pool.get(ahead=[(None, y, None)], delay=0.3)
    pool.get(**y)
    pool.get(ahead=[(None, x, None), (None, y, None)], delay=0.5)   # the last arm
    assert pool._ahead == set()
    assert [k for k, e in pool._engines.items() if e.server.alive] == [
        srv.engine_key(None, {"delay": 0.5}, {})]
