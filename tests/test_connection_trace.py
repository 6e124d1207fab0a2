"""Connection set-up from httpcore's trace, and one traced streamed request
against a fake OpenAI server (new connection, then a reused one)."""
import httpx
import pytest
from fake_openai import FakeOpenAI

from lab_utils.client import run_sync
from lab_utils.connection_trace import ConnTrace, connection_setup, traced_stream


def test_connection_setup_from_a_trace():
    trace = ConnTrace({"connection.connect_tcp.started": 1.0,
                          "connection.connect_tcp.complete": 1.002,
                          "connection.start_tls.started": 1.002,
                          "connection.start_tls.complete": 1.010})
    setup = connection_setup(trace)
    assert setup["tcp_ms"] == pytest.approx(2.0) and setup["tls_ms"] == pytest.approx(8.0)
    assert setup["setup_ms"] == pytest.approx(10.0) and setup["new_connection"]
    reused = connection_setup(ConnTrace({"http11.send_request_headers.started": 1.0}))
    assert reused == {"tcp_ms": 0.0, "tls_ms": 0.0, "setup_ms": 0.0, "new_connection": False}


def test_traced_stream_counts_a_new_then_a_reused_connection():
    server = FakeOpenAI().start()
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}

    async def go():
        async with httpx.AsyncClient() as client:
            url = server.base_url + "/v1/chat/completions"
            return [await traced_stream(client, url, body) for _ in range(2)]

    try:
        first, second = run_sync(go())
    finally:
        server.stop()
    assert first["ok"] and second["ok"] and first["http_version"] == "HTTP/1.1"
    assert first["new_connection"] and first["tcp_ms"] > 0 and first["tls_ms"] == 0
    assert not second["new_connection"] and second["setup_ms"] == 0
    assert 0 < first["ttft_ms"] <= first["e2e_ms"]
    assert first["tls_version"] is None and first["alpn"] is None
