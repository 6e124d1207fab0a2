"""Ports of the lab's servers: picked where no outgoing connection takes them,
and a start whose port was taken before the server bound it moves to another.
A stand-in server binds its port as vLLM's `create_server_socket` does, after
a second of "imports"; no model, no engine."""
from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

import lab_utils as lab
from lab_utils import server as srv
from lab_utils.engine_lease import SHARE_ENV
from lab_utils.server import VLLMServer, ephemeral_ports, free_port, start_on_a_free_port

#: Binds argv[1] as vLLM 0.32's `create_server_socket` does (SO_REUSEADDR, then
#: bind; checked against its source below) after a second, then answers every
#: GET with 200 until killed.
STAND_IN = """
import http.server, socket, sys, time
time.sleep(1.0)  # vLLM's imports, before it binds
sock = socket.socket(family=socket.AF_INET, type=socket.SOCK_STREAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"")
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H, bind_and_activate=False)
server.socket.close(); server.socket = sock
server.server_activate()
server.serve_forever()
"""


def test_vllm_binds_its_port_as_the_stand_in_does():
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = (Path(spec.submodule_search_locations[0]) / "entrypoints" / "launchers"
              / "launcher.py").read_text()
    body = source[source.index("def create_server_socket("):]
    body = body[:body.index("\ndef ", 1)]
    assert "socket.SO_REUSEADDR, 1)" in body and "sock.bind(addr)" in body, body


def test_bind_to_port_zero_stays_in_the_ephemeral_range_and_free_port_stays_out_of_it():
    low, high = ephemeral_ports()
    given = []
    for _ in range(200):  # the kernel's picks: where connections' source ports come from too
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            given.append(s.getsockname()[1])
    assert all(low <= p <= high for p in given), (low, high, sorted(given)[:5])
    picked = [free_port() for _ in range(200)]
    assert all(srv.PICK_LOW <= p < low for p in picked), sorted(picked)[-5:]
    assert len(set(picked)) > 150, "picks should spread over the range"
    for p in picked[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free indeed


def _stand_in_on(tmp_path: Path):
    def server_on(port: int) -> VLLMServer:
        return VLLMServer([sys.executable, "-c", STAND_IN, str(port)], port=port,
                          log_path=tmp_path / "server.log", startup_timeout_s=30)
    return server_on


def _take(port: int, holders: list[socket.socket]) -> None:
    """Another process's listening socket on `port` (closed by the test)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    holders.append(holder)


def _taken_after_launch(first: int, holders: list[socket.socket]):
    """A launch that, for the port `first`, lets another process bind it right
    after the launch's own check, before the server does."""
    def launch(server: VLLMServer) -> VLLMServer:
        VLLMServer.launch(server)
        if server.port == first:
            _take(first, holders)
        return server
    return launch


def test_a_server_whose_port_was_taken_before_it_bound_it_starts_on_another(tmp_path):
    first, holders = free_port(), []
    launch = _taken_after_launch(first, holders)
    try:
        server = start_on_a_free_port(_stand_in_on(tmp_path), first,
                                      start=lambda s: launch(s).wait_ready())
        try:
            assert server.port != first and server.alive and server._healthy()
        finally:
            server.stop()
    finally:
        for h in holders:
            h.close()
    log = (tmp_path / "server.log").read_text()
    assert "[Errno 98] Address already in use" in log, log  # Python's words, not the lab's
    assert log.count("$ ") == 2, "one launch on the taken port, one on the next"


def test_without_another_port_the_start_fails_naming_the_taken_port(tmp_path, monkeypatch):
    first, holders = free_port(), []
    monkeypatch.setattr(srv, "PORT_ATTEMPTS", 1)
    try:
        with pytest.raises(srv.PortInUse, match=f"port {first} was taken after the launch"):
            start_on_a_free_port(_stand_in_on(tmp_path), first,
                                 start=lambda s: _taken_after_launch(first, holders)(s)
                                 .wait_ready())
    finally:
        for h in holders:
            h.close()


def test_an_engine_pool_start_moves_off_a_port_taken_before_the_server_bound_it(
        tmp_path, monkeypatch):
    """EnginePool launches, then waits (`_Pending.finish`): the wait is where
    the lost port shows, and the engine must still come up."""
    holders: list[socket.socket] = []
    launched: list[int] = []
    first = free_port()
    picks = iter([first])
    monkeypatch.setattr(srv, "free_port",
                        lambda host="127.0.0.1": next(picks, None) or free_port(host))

    class StandIn(VLLMServer):
        def __init__(self, argv, *, port, **kw):
            kw["startup_timeout_s"] = 30
            super().__init__([sys.executable, "-c", STAND_IN, str(port)], port=port, **kw)

        def launch(self):
            out = super().launch()
            launched.append(self.port)
            if self.port == first:
                _take(first, holders)
            return out
    monkeypatch.setattr(srv, "VLLMServer", StandIn)
    monkeypatch.setenv("LAB_START_AHEAD", "0")
    monkeypatch.delenv(SHARE_ENV, raising=False)  # this pool's own start, not a broker's
    profile = lab.load_profile("cpu")
    try:
        with lab.EnginePool(profile, log_dir=tmp_path) as pool:
            engine = pool.get()
            assert engine.server.port != first and engine.server.alive
            assert engine.base_url.endswith(f":{engine.server.port}")
    finally:
        for h in holders:
            h.close()
    assert launched[0] == first and len(launched) == 2, launched

