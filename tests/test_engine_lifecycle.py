"""Server lifecycle against the real vLLM CPU engine (marked `engine`): clean
stops, deaths at start and mid-run, interrupts, bad options. Every test checks
that no process it started is left behind."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import lab_utils as lab
from lab_utils.profiles import engine_argv
from lab_utils.server import VLLMServer, free_port, lab_server_processes

pytestmark = pytest.mark.engine


def _mine() -> list:
    return lab_server_processes(owner=os.getpid())


@pytest.fixture(scope="module")
def profile():
    return lab.load_profile("cpu")


def test_server_stops_and_leaves_no_process(profile, tmp_path):
    port = free_port()
    argv = engine_argv(profile, {}, port=port)
    with VLLMServer(argv, port=port, log_path=tmp_path / "s.log", env=profile.env,
                    startup_timeout_s=profile.startup_timeout_s) as server:
        pids = [pid for pid, _ in _mine()]
        assert server.alive and len(pids) >= 2, "expected the API server and its engine core"
    assert _mine() == []
    assert not server.alive
    assert "vllm serve" in (tmp_path / "s.log").read_text().splitlines()[0]


def test_server_killed_mid_run_gives_error_records_not_a_hang(profile, tmp_path):
    results = lab.Results("killed", tmp_path, "cpu")
    with lab.EnginePool(profile, log_dir=tmp_path) as pool:
        eng = pool.get()
        specs = [lab.RequestSpec(prompt="Count slowly:", max_tokens=400, ignore_eos=True)
                 for _ in range(4)]
        killer = threading.Timer(3.0, lambda: os.killpg(eng.server.proc.pid, signal.SIGKILL))
        killer.start()
        t0 = time.perf_counter()
        with pytest.raises(lab.ServerError, match="stopped answering"):
            lab.measure(eng, specs, lab.Load.concurrent(2), label="doomed", results=results,
                        progress=False)
        assert time.perf_counter() - t0 < 120
        saved = list(results.iter_records())
        assert saved and all(not r["ok"] and r["error"] for r in saved[-2:])
    assert _mine() == []


def test_server_dying_at_start_shows_the_log_tail(profile, tmp_path):
    port = free_port()
    # Longer than the model's 8k context: vLLM refuses it while starting.
    argv = engine_argv(profile, {"max_model_len": 100_000}, port=port)
    server = VLLMServer(argv, port=port, log_path=tmp_path / "bad.log", env=profile.env)
    with pytest.raises(lab.ServerError, match="exited with code") as info:
        server.start()
    assert "last lines" in str(info.value) and "max_model_len" in str(info.value).lower()
    assert _mine() == []


def test_interrupt_during_start_leaves_no_process(profile, tmp_path):
    port = free_port()
    server = VLLMServer(engine_argv(profile, {}, port=port), port=port,
                        log_path=tmp_path / "int.log", env=profile.env)
    threading.Timer(5.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert _mine() == []


def test_bad_options_fail_before_launch(profile, tmp_path):
    with lab.EnginePool(profile, log_dir=tmp_path) as pool:
        with pytest.raises(lab.ConfigError, match="did you mean enable_prefix_caching"):
            pool.get(enable_prefix_cachin=True)
        with pytest.raises(lab.ConfigError, match="bfloat16"):
            pool.get(quantization="int8_per_channel_weight_only")
    assert _mine() == []


def test_port_in_use_fails_fast(profile, tmp_path):
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = VLLMServer(engine_argv(profile, {}, port=port), port=port,
                            log_path=tmp_path / "p.log")
        with pytest.raises(lab.ConfigError, match="already in use"):
            server.start()
    assert _mine() == []


def test_missing_model_path_fails_fast(tmp_path):
    profile = lab.load_profile("cpu")
    import dataclasses
    bad = dataclasses.replace(profile, model=str(tmp_path / "no-such-model"))
    with pytest.raises(lab.ConfigError, match="does not exist"):
        lab.EnginePool(bad, log_dir=tmp_path).get()


def test_a_start_whose_picked_port_was_taken_picks_another(profile, tmp_path, monkeypatch):
    """The lab picks a free port, checks the flags (seconds, the first time), then
    starts: a port another process took meanwhile (a connection's source port, in
    make test) must not fail the start. The first pick here is a port held open."""
    import socket

    from lab_utils import server as srv
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        picks = iter([held, free_port()])
        monkeypatch.setattr(srv, "free_port", lambda host="127.0.0.1": next(picks))
        tried = []
        real_launch = VLLMServer.launch

        class Launched(Exception):
            pass

        def launch(self):
            tried.append(self.port)
            if self.port == held:
                return real_launch(self)     # refuses: the port is in use
            raise Launched(self.port)        # where the real launch would start vLLM
        monkeypatch.setattr(VLLMServer, "launch", launch)
        with lab.EnginePool(profile, log_dir=tmp_path) as pool, pytest.raises(Launched):
            pool.get()
    assert tried[0] == held and len(tried) == 2 and tried[1] != held
    assert _mine() == []
