"""Engines shared across a run's notebooks (lab_utils.engine_share): which
returned engines the broker keeps, by the demand the plans declare (hand-worked
cases on stand-in servers), and on a real engine that a lent engine is the same
server with an empty prefix cache, by vLLM's own counters."""
from __future__ import annotations

import time

import psutil
import pytest

import lab_utils as lab
from lab_utils import counters
from lab_utils.engine_share import SHARE_ENV, Broker, _Shared, config_key, key_of
from lab_utils.http import post_json
from lab_utils.profiles import engine_argv


class Stub:
    """Stands in for a running VLLMServer."""

    def __init__(self, port: int):
        self.port, self.host, self.alive, self.stopped = port, "127.0.0.1", True, False

    def stop(self, timeout_s: float = 30) -> None:
        self.stopped, self.alive = True, False


def lent(broker: Broker, key: str, port: int, notebook: str) -> Stub:
    stub = Stub(port)
    broker._seen(notebook)
    broker._trim()  # as an acquire by `notebook` does
    broker._engines.append(_Shared(key, stub, notebook, uses=[notebook]))
    return stub


def test_a_returned_engine_stays_only_while_a_later_notebook_plans_it():
    b = Broker([("a", ["K1", "K2"]), ("b", ["K3"]), ("c", ["K1"])], keep_idle=3,
               min_free_fraction=0)
    k1, k2 = lent(b, "K1", 1, "a"), lent(b, "K2", 2, "a")
    assert b.release("K1", 1) == {"kept": True}    # c plans K1
    assert b.release("K2", 2) == {"kept": True}    # a itself may ask for it again
    k3 = lent(b, "K3", 3, "b")                     # b runs: no notebook from b on plans K2
    assert (k1.stopped, k2.stopped) == (False, True)
    assert b.dropped == []                         # not a lost reuse: nothing plans K2 any more
    assert b.release("K3", 3) == {"kept": True}
    b._seen("c")
    b._trim()                                      # c runs: only K1 is planned from c on
    assert k3.stopped and not k1.stopped
    assert b._next_use("K1") == 2 and b._next_use("K3") is None
    assert [e.key for e in b._engines] == ["K1"]


def test_over_the_idle_cap_the_engine_needed_latest_stops():
    # a: K1, b: K2, c: K2, d: K1; one idle engine at most. After b returns K2,
    # K1 (next needed by d, index 3) goes before K2 (next needed by c, index 2).
    b = Broker([("a", ["K1"]), ("b", ["K2"]), ("c", ["K2"]), ("d", ["K1"])], keep_idle=1,
               min_free_fraction=0)
    k1 = lent(b, "K1", 1, "a")
    assert b.release("K1", 1)["kept"]
    k2 = lent(b, "K2", 2, "b")
    assert b.release("K2", 2)["kept"]
    assert k1.stopped and not k2.stopped
    assert [e.key for e in b._engines] == ["K2"]
    assert [(d["key"], d["planned_by"], d["reason"]) for d in b.describe()["dropped"]] == [
        ("K1", "d", "more than 1 idle")]


def test_unknown_notebooks_and_no_demand_keep_nothing():
    b = Broker([], min_free_fraction=0)
    s = lent(b, "K", 1, "some-test")
    assert b.release("K", 1) == {"kept": False} and s.stopped
    assert b.release("K", 99) == {"kept": False}  # not the broker's: nothing to do


def test_the_key_is_the_command_line_port_aside(cpu):
    a = engine_argv(cpu, {}, port=8000, model="/m")
    b = engine_argv(cpu, {}, port=9123, model="/m")
    assert key_of(a, {"X": "1"}) == key_of(b, {"X": "1"}) != key_of(b, {"X": "2"})
    assert "--port" not in key_of(a, {}) and "--host 127.0.0.1" in key_of(a, {})
    assert config_key("vllm serve m --port 8000 --dtype float32") == "vllm serve m --dtype float32"


def test_a_start_whose_port_was_taken_since_the_kernel_picked_it_moves(cpu, tmp_path,
                                                                      monkeypatch):
    """A kernel picks the port; the broker may stop idle engines first (seconds)
    before it starts the server: a port another process took meanwhile must not
    fail the start. The lease tells the kernel where the server listens."""
    import socket

    from lab_utils import server as srv
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        tried = []
        real_launch = srv.VLLMServer.launch

        class Launched(Exception):
            pass

        def launch(self):
            tried.append((self.port, self.argv[self.argv.index("--port") + 1]))
            if self.port == held:
                return real_launch(self)     # refuses: the port is in use
            raise Launched(self.port)        # where the real launch would start vLLM
        monkeypatch.setattr(srv.VLLMServer, "launch", launch)
        b = Broker([("nb", [])], min_free_fraction=0)
        with pytest.raises(Launched):
            b.acquire(engine_argv(cpu, {}, port=held, model="/m"), {}, str(tmp_path / "v.log"),
                      notebook="nb")
    assert tried[0] == (held, str(held)) and len(tried) == 2
    assert tried[1][0] != held and tried[1][1] == str(tried[1][0])   # argv moved with it
    assert b._engines == []


def _completion(engine, prompt: str) -> dict:
    before = counters.scrape(engine.base_url)
    post_json(engine, "/v1/completions", {"model": engine.model, "prompt": prompt,
                                          "max_tokens": 1, "temperature": 0.0}, timeout=120)
    return counters.delta(before, counters.scrape(engine.base_url))


@pytest.mark.engine
def test_a_lent_engine_is_the_same_server_with_an_empty_prefix_cache(cpu, tmp_path,
                                                                     monkeypatch):
    key = key_of(engine_argv(cpu, {}, port=8000, model=cpu.model_for(None)), cpu.server_env({}))
    prompt = "The lab measures time to first token. " * 40  # several 128-token blocks
    # No memory guard here: under two test streams the other stream's engines
    # once left too little available, and the broker rightly stopped the idle
    # engine (the guard has its own test, with the available memory given).
    with Broker([("nb1", [key]), ("nb2", [key])], min_free_fraction=0) as broker:
        monkeypatch.setenv(SHARE_ENV, broker.url)
        with lab.EnginePool(cpu, log_dir=tmp_path / "nb1") as pool:
            e1 = pool.get()
            assert e1.server.startup_s > 0 and not e1.server.reused
            assert _completion(e1, prompt)["prefix_cache_hits"] == 0
            assert _completion(e1, prompt)["prefix_cache_hits"] > 0  # the cache works
            leader = e1.server.proc.pid
        assert broker.describe()["running"][0]["leased"] is False  # kept for nb2
        with lab.EnginePool(cpu, log_dir=tmp_path / "nb2") as pool:
            e2 = pool.get()
            assert (e2.base_url, e2.server.proc.pid) == (e1.base_url, leader)
            assert e2.server.startup_s is None and e2.server.reused_from == "nb1"
            assert e2.describe()["shared"]["reused_from"] == "nb1"
            assert _completion(e2, prompt)["prefix_cache_hits"] == 0  # emptied when lent
        assert (broker.starts, broker.reuses) == (1, 1)
    deadline = time.monotonic() + 30   # the broker's engines stop with it
    while psutil.pid_exists(leader) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(leader)


def test_short_of_memory_the_idle_engine_needed_latest_stops_first(monkeypatch):
    from lab_utils import engine_share
    b = Broker([("a", ["K1", "K2"]), ("b", ["K2"]), ("c", ["K1"])], keep_idle=3,
               min_free_fraction=0.25)
    k1, k2 = lent(b, "K1", 1, "a"), lent(b, "K2", 2, "a")
    free = iter([0.5, 0.5, 0.1, 0.5])   # enough at both returns, then short once
    monkeypatch.setattr(engine_share, "_free_fraction", lambda: next(free))
    assert b.release("K1", 1)["kept"] and b.release("K2", 2)["kept"]
    b._seen("b")
    b._trim()                           # short: K1 (next needed by c) goes, K2 (b) stays
    assert k1.stopped and not k2.stopped
    assert b.describe()["dropped"] == [{"key": "K1", "uses": ["a"], "planned_by": "c",
                                        "while": "b", "reason": "memory: 10% available, under 25%"}]
