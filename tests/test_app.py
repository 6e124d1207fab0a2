"""The streaming app (`lab_utils.app`) against a fake upstream: SSE framing,
OpenAI-SDK compatibility, disconnects that abort the upstream work, bad input
and upstream failures, the shared upstream pool, the subprocess life cycle,
and HTTPS + HTTP/2. That a hang-up aborts the generation on a real vLLM engine
is checked in tests/test_engine_requests.py, on that module's engine."""
from __future__ import annotations

import asyncio
import json
import os
import ssl
import time

import httpx
import openai
import pytest
from aiohttp import web
from fake_openai import CHAT_TOKENS, FakeOpenAI
from h2.errors import ErrorCodes

from lab_utils.app import (
    DONE,
    AppServer,
    article_stream,
    error_body,
    hypercorn_available,
    pop_sse_blocks,
    pop_sse_data,
    self_signed_certificate,
    sse_comment,
    sse_data,
    sse_event,
    timing_from_comment,
)
from lab_utils.server import free_port, lab_server_processes
from lab_utils.sse import decode_events

LONG_CHUNKS = 200
LONG_GAP_S = 0.02
PREFILL_S = 3.0
MSG = [{"role": "user", "content": "hi"}]


class LabFake(FakeOpenAI):
    """FakeOpenAI plus: non-streamed "chat", vLLM-like 4xx/503 answers, and
    long streams that record whether the app hung up on them."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = 0
        self.long_sent = 0

    def reset(self) -> None:
        super().reset()
        self.cancelled = 0
        self.long_sent = 0

    async def _chat(self, request, body):
        if body.get("stream"):
            return await super()._chat(request, body)
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "chat",
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "w1 w2 w3 w4 w5 "}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}})

    async def _bad_request(self, request, body):
        return web.json_response({"error": {"message": "This model's maximum context length "
                                            "is 4096 tokens.", "type": "BadRequestError",
                                            "code": 400}}, status=400)

    async def _notfound(self, request, body):
        return web.json_response({"error": {"message": "The model `notfound` does not exist.",
                                            "type": "NotFoundError", "code": 404}}, status=404)

    async def _unavailable(self, request, body):
        return web.json_response({"error": {"message": "overloaded", "code": 503}}, status=503)

    async def _long(self, request, body):
        resp, send = await self._open(request)
        try:
            for i in range(LONG_CHUNKS):
                await asyncio.sleep(LONG_GAP_S)
                await send(self._chunk(f"t{i} ", {"prompt_tokens": 3, "completion_tokens": i + 1,
                                                  "total_tokens": 4 + i}))
                self.long_sent += 1
            await send("[DONE]")
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        return resp

    async def _long_json(self, request, body):
        try:
            await asyncio.sleep(PREFILL_S)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return web.json_response({"choices": []})

    async def _prefill(self, request, body):
        resp, send = await self._open(request)
        try:
            await asyncio.sleep(PREFILL_S)
            await send(self._chunk("late", None, finish="length"))
            await send("[DONE]")
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        return resp


@pytest.fixture(scope="module")
def fake():
    server = LabFake().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def app(fake, tmp_path_factory):
    with AppServer(fake.base_url, "chat", log_path=tmp_path_factory.mktemp("app") / "app.log",
                   upstream_timeout_s=2.0) as server:
        yield server


@pytest.fixture
def upstream(fake):
    fake.reset()
    return fake


def sdk(app: AppServer, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key="none", max_retries=0, **kw)


def wait_for(predicate, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --------------------------------------------------------------------------
# Framing (pure)
# --------------------------------------------------------------------------

def test_sse_event_is_one_framed_event():
    assert sse_event({"content": "hi"}) == b'data: {"content":"hi"}\n\n'
    assert sse_event("[DONE]") == DONE == b"data: [DONE]\n\n"
    # Multi-line data needs one data: line per line, or the client sees only the first.
    assert sse_event("a\nb\r\nc", event="x") == b"event: x\ndata: a\ndata: b\ndata: c\n\n"
    assert sse_event({"content": "é\n"}) == 'data: {"content":"é\\n"}\n\n'.encode()
    assert sse_comment("x 1") == b": x 1\n\n"


def test_pop_sse_blocks_and_data_follow_the_spec():
    buf = bytearray(b"data: a\r\ndata: b\r\n\r\n: only a comment\n\ndata:x\n\nevent: e\ndata: ")
    assert list(pop_sse_data(buf)) == ["a\nb", "x"]
    assert buf == b"event: e\ndata: "  # the incomplete event waits for more bytes
    buf += b"tail\n\n"
    assert [sse_data(b) for b in pop_sse_blocks(buf)] == ["tail"]
    assert sse_data(": comment") is None


def test_timing_comment_round_trip():
    block = sse_comment('lab-timing {"upstream_ttft_s": 0.5}').decode().strip("\n")
    assert timing_from_comment(block) == {"upstream_ttft_s": 0.5}
    assert timing_from_comment("data: x") is None


def test_article_framing_is_not_parseable_sse():
    pieces = ["Hel", "lo", " world"]
    article = b"".join(article_stream(pieces))
    assert article == b'data: {"content": "Hel"}\n{"content": "lo"}\n{"content": " world"}\n'
    # No blank line ever ends an event: a spec-following client dispatches nothing.
    assert decode_events(article) == []
    proper = b"".join(sse_event({"content": p}) for p in pieces) + DONE
    assert [json.loads(e)["content"] for e in decode_events(proper)[:-1]] == pieces
    assert decode_events(proper)[-1] == "[DONE]"


def test_error_body_has_openai_shape():
    assert error_body(503, "down", "upstream_error") == {
        "error": {"message": "down", "type": "upstream_error", "code": 503}}


# --------------------------------------------------------------------------
# Streaming through the app
# --------------------------------------------------------------------------

def test_v1_stream_works_with_the_openai_sdk(app, upstream):
    stream = sdk(app).chat.completions.create(model="chat", messages=MSG, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(f"w{i} " for i in range(1, CHAT_TOKENS + 1))
    assert chunks[-1].usage.completion_tokens == CHAT_TOKENS
    assert upstream.requests[-1]["body"]["stream"] is True


def test_v1_stream_wire_format(app, upstream):
    with httpx.stream("POST", app.base_url + "/v1/chat/completions",
                      json={"messages": MSG, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        raw = resp.read()
    assert raw.endswith(b"\n\n" + DONE)
    blocks = list(pop_sse_blocks(bytearray(raw)))
    datas = [sse_data(b) for b in blocks]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas if d and d != "[DONE]"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # The app filled in its model, and told when vLLM's first token came.
    assert upstream.requests[-1]["body"]["model"] == "chat"
    timing = next(timing_from_comment(b) for b in blocks if timing_from_comment(b))
    assert 0.03 < timing["upstream_ttft_s"] < timing["upstream_e2e_s"] < 2


def test_v1_without_stream_returns_json_and_server_timing(app, upstream):
    raw = sdk(app).chat.completions.with_raw_response.create(model="chat", messages=MSG)
    completion = raw.parse()
    assert completion.choices[0].message.content == "w1 w2 w3 w4 w5 "
    assert raw.headers["server-timing"].startswith("upstream;dur=")
    assert upstream.requests[-1]["body"]["stream"] is False


@pytest.mark.parametrize("body", [{"message": "hi"}, {"messages": MSG, "max_tokens": 5}])
def test_chat_article_shape_streams_content_events(app, upstream, body):
    with httpx.stream("POST", app.base_url + "/chat", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = decode_events(resp.read())
    assert events[-1] == "[DONE]"
    data = [json.loads(e) for e in events[:-1]]
    assert "".join(d.get("content", "") for d in data) == "w1 w2 w3 w4 w5 "
    assert data[-1]["finish_reason"] == "length"
    assert data[-1]["usage"]["completion_tokens"] == CHAT_TOKENS
    sent = upstream.requests[-1]["body"]
    assert sent["messages"] == MSG and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}


def test_article_endpoint_reproduces_the_unparseable_stream(app, upstream):
    r = httpx.post(app.base_url + "/chat/article", json={"message": "hi"})
    assert r.status_code == 200
    assert "event-stream" not in r.headers.get("content-type", "")
    assert r.content.startswith(b'data: {"content": "w1 "}\n{"content": "w2 "}\n')
    assert decode_events(r.content) == []


def test_events_arrive_as_they_are_made(app, upstream):
    """Streaming, not buffering: the first content event arrives long before the last."""
    arrivals = []
    with httpx.stream("POST", app.base_url + "/chat", json={"message": "hi"}) as resp:
        buf = bytearray()
        for raw in resp.iter_raw():
            buf += raw
            for data in pop_sse_data(buf):
                if '"content"' in data:
                    arrivals.append(time.perf_counter())
    assert len(arrivals) == CHAT_TOKENS
    assert arrivals[-1] - arrivals[0] > 0.05  # 4 gaps of 20 ms at the upstream


# --------------------------------------------------------------------------
# Disconnects
# --------------------------------------------------------------------------

def test_client_disconnect_aborts_the_upstream_request(app, upstream):
    before = app.stats()["streams"]
    client = httpx.Client(timeout=10)
    with client.stream("POST", app.base_url + "/v1/chat/completions",
                       json={"model": "long", "messages": MSG, "stream": True}) as resp:
        buf, got = bytearray(), 0
        for raw in resp.iter_raw():
            buf += raw
            got += len(list(pop_sse_data(buf)))
            if got >= 3:
                break
    client.close()  # hang up mid-stream
    assert wait_for(lambda: upstream.cancelled == 1), "the upstream stream was not cancelled"
    assert upstream.long_sent < LONG_CHUNKS / 2
    after = app.stats()["streams"]
    assert wait_for(lambda: app.stats()["streams"]["client_disconnects"]
                    == before["client_disconnects"] + 1)
    assert app.stats()["streams"]["upstream_aborted"] == before["upstream_aborted"] + 1
    assert after["started"] >= before["started"] + 1


def test_disconnect_before_the_first_token_aborts_too(app, upstream):
    """A client that gives up during a long prefill must not leave vLLM working."""
    client = httpx.Client(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout), client.stream(
            "POST", app.base_url + "/v1/chat/completions",
            json={"model": "prefill", "messages": MSG, "stream": True},
            timeout=httpx.Timeout(10, read=0.3)) as resp:
        for _ in resp.iter_raw():
            pass
    client.close()
    assert wait_for(lambda: upstream.cancelled == 1, timeout=2.0)
    assert time.monotonic() - t0 < 1.5, "cancelled by a timeout, not by the hang-up"


def test_disconnect_from_a_non_streamed_request_aborts_too(app, upstream):
    before = app.stats()["streams"]
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(app.base_url + "/v1/chat/completions",
                   json={"model": "long_json", "messages": MSG},
                   timeout=httpx.Timeout(10, read=0.3))
    assert wait_for(lambda: upstream.cancelled == 1, timeout=2.0)
    assert time.monotonic() - t0 < 1.5, "cancelled by a timeout, not by the hang-up"
    after = app.stats()["streams"]
    assert after["client_disconnects"] == before["client_disconnects"] + 1


# --------------------------------------------------------------------------
# Bad requests and upstream failures
# --------------------------------------------------------------------------

@pytest.mark.parametrize("path, kw, status, words", [
    ("/chat", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400,
     "not valid JSON"),
    ("/chat", {}, 400, "no body"),
    ("/chat", {"content": b"[1, 2]", "headers": {"Content-Type": "application/json"}}, 422,
     "valid dictionary"),
    ("/chat", {"json": {"messages": []}}, 422, "messages"),
    ("/chat", {"json": {"message": "hi", "max_tokens": 0}}, 422, "max_tokens"),
    ("/chat", {"json": {"message": "hi", "messages": MSG}}, 422, "exactly one"),
    ("/chat", {"json": {"prompt": "hi"}}, 422, "prompt"),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "robot", "content": "x"}]}}, 422,
     "role"),
    ("/v1/chat/completions", {"json": {"messages": MSG, "temperature": 9}}, 422, "temperature"),
    ("/nowhere", {"json": {}}, 404, "Not Found"),
])
def test_bad_requests_get_a_clear_status_and_message(app, upstream, path, kw, status, words):
    r = httpx.post(app.base_url + path, **kw)
    assert r.status_code == status
    assert words in r.json()["error"]["message"]
    assert upstream.requests == [], "a bad request must not reach vLLM"


def test_openai_sdk_shows_the_validation_message(app, upstream):
    with pytest.raises(openai.UnprocessableEntityError, match="max_tokens"):
        sdk(app).chat.completions.create(model="chat", messages=MSG, max_tokens=0, stream=True)


@pytest.mark.parametrize("model, status, words", [
    ("bad_request", 400, "maximum context length"),   # vLLM's 4xx: the request's fault
    ("notfound", 404, "does not exist"),
    ("http500", 502, "engine dead"),                  # vLLM failed: bad gateway
    ("unavailable", 503, "overloaded"),
    ("slow", 504, "did not answer within 2 s"),       # the app's upstream timeout is 2 s
])
@pytest.mark.parametrize("stream", [True, False])
def test_upstream_failures_map_to_gateway_statuses(app, upstream, model, status, words, stream):
    r = httpx.post(app.base_url + "/v1/chat/completions",
                   json={"model": model, "messages": MSG, "stream": stream}, timeout=10)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_upstream_down_is_503(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with AppServer(dead, "chat", log_path=tmp_path / "app.log") as down:
        r = httpx.post(down.base_url + "/chat", json={"message": "hi"})
        assert r.status_code == 503
        assert "not reachable" in r.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError, match="not reachable"):
            sdk(down).chat.completions.create(model="chat", messages=MSG, stream=True)
        assert down.stats()["upstream"]["errors"] == {"unreachable": 2}


def test_mid_stream_failures_become_an_error_event(app, upstream):
    # "drop": vLLM's connection breaks after two tokens; the status line was
    # already 200, so the error arrives as an event and the SDK raises it.
    with pytest.raises(openai.APIError, match="stream broke"):
        list(sdk(app).chat.completions.create(model="drop", messages=MSG, stream=True))
    raw = httpx.post(app.base_url + "/v1/chat/completions",
                     json={"model": "drop", "messages": MSG, "stream": True}).content
    events = decode_events(raw)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 502
    # vLLM's own in-stream error event is passed on as it is.
    with pytest.raises(openai.APIError, match="engine overloaded"):
        list(sdk(app).chat.completions.create(model="stream_error", messages=MSG, stream=True))


# --------------------------------------------------------------------------
# Connections
# --------------------------------------------------------------------------

def test_one_shared_upstream_pool(app, upstream):
    app.reset_stats()
    with httpx.Client() as client:
        for _ in range(4):
            assert client.post(app.base_url + "/chat", json={"message": "hi"}).status_code == 200
    for _ in range(3):  # three more clients, three more client connections
        assert httpx.post(app.base_url + "/chat", json={"message": "hi"}).status_code == 200
    stats = app.stats()
    assert stats["upstream"]["connections_opened"] <= 1  # kept alive from earlier tests
    assert stats["connections"] == {"total": 4, "by_http_version": {"1.1": 4}}
    assert stats["requests"] == {"/chat": 7}
    assert stats["statuses"] == {"200": 7}


def test_app_server_process_lifecycle(fake, tmp_path):
    server = AppServer(fake.base_url, "chat", log_path=tmp_path / "logs" / "app.log")
    assert "python -m lab_utils.app --upstream" in server.command
    with server:
        pid = server.proc.pid
        assert server.alive and server.startup_s < 30
        assert pid in [p for p, _ in lab_server_processes(owner=os.getpid())]
        assert os.getpgid(pid) == pid  # its own process group
    assert not server.alive
    assert pid not in [p for p, _ in lab_server_processes(owner=os.getpid())]
    assert (tmp_path / "logs" / "app.log").read_text().startswith("$ python -m lab_utils.app")


def test_start_app_records_the_engine_and_the_app(fake, tmp_path):
    from types import SimpleNamespace

    from lab_utils.app import start_app
    from lab_utils.results import Results
    engine = SimpleNamespace(base_url=fake.base_url, model="chat", api_key=None, server=None,
                             model_path="", profile=SimpleNamespace(name="fake", device="cpu"),
                             describe=lambda: {"command": "(fake engine)"})
    ctx = SimpleNamespace(name="07_test", results=Results("07_test", tmp_path))
    app = start_app(ctx, engine)
    try:
        assert app.alive and app.upstream == fake.base_url
        assert app.log_path.parent == tmp_path / "logs" / "07_test"
        saved = json.loads(ctx.results.path.read_text())
        assert saved["engines"] == [{"command": "(fake engine)"}]
        assert saved["apps"] == [app.describe()]
        assert saved["apps"][0]["command"].startswith("python -m lab_utils.app --upstream")
    finally:
        app.stop()


def test_self_signed_certificate_verifies(tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    ctx = ssl.create_default_context(cafile=str(cert))
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    from cryptography import x509
    san = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert oct(key.stat().st_mode & 0o777) == "0o600"


@pytest.mark.skipif(not hypercorn_available(), reason="HTTP/2 needs hypercorn (requirements.txt)")
def test_https_and_http2(fake, tmp_path):
    fake.reset()
    with AppServer(fake.base_url, "chat", log_path=tmp_path / "app.log", server="hypercorn",
                   tls=True) as app:
        assert app.base_url.startswith("https://")
        with pytest.raises(httpx.ConnectError):  # verification is real: no trust, no talk
            httpx.post(app.base_url + "/chat", json={"message": "hi"})
        ctx = app.ssl_context()
        with httpx.Client(http2=True, verify=ctx) as c2:
            versions = []
            for _ in range(3):
                r = c2.post(app.base_url + "/chat", json={"message": "hi"})
                versions.append(r.http_version)
                assert decode_events(r.content)[-1] == "[DONE]"
        with httpx.Client(verify=app.ssl_context()) as h1:
            assert h1.post(app.base_url + "/chat", json={"message": "hi"}).http_version \
                == "HTTP/1.1"
        assert versions == ["HTTP/2"] * 3
        stats = app.stats()
        assert stats["connections"]["by_http_version"] == {"2": 1, "1.1": 1}
        # The openai SDK streams over it too.
        client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(http2=True, verify=app.ssl_context()))
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="chat", messages=MSG, stream=True) if c.choices)
        assert text == "w1 w2 w3 w4 w5 "
        # Resetting one HTTP/2 stream (RST_STREAM, the connection stays open)
        # aborts the upstream request too. httpx's HTTP/2 client sends no
        # RST_STREAM when a response is closed early, so speak h2 directly.
        sock, conn, got = h2_open_stream(app, {"model": "long", "messages": MSG, "stream": True})
        try:
            assert got.count(b"\n\n") >= 2
            conn.reset_stream(1, error_code=ErrorCodes.CANCEL)
            sock.sendall(conn.data_to_send())
            assert wait_for(lambda: fake.cancelled == 1), "RST_STREAM did not reach upstream"
            assert fake.long_sent < LONG_CHUNKS / 2
        finally:
            sock.close()


def h2_open_stream(app: AppServer, body: dict, events: int = 2):
    """Open a TLS+h2 connection, POST `body` on stream 1 and read `events` SSE
    events; return (socket, h2 connection, bytes read)."""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    ctx = app.ssl_context()
    ctx.set_alpn_protocols(["h2"])
    sock = ctx.wrap_socket(socket.create_connection((app.host, app.port), timeout=5),
                           server_hostname=app.host)
    assert sock.selected_alpn_protocol() == "h2"
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    payload = json.dumps(body).encode()
    conn.send_headers(1, [(":method", "POST"), (":path", "/v1/chat/completions"),
                          (":scheme", "https"), (":authority", f"{app.host}:{app.port}"),
                          ("content-type", "application/json"),
                          ("content-length", str(len(payload)))])
    conn.send_data(1, payload, end_stream=True)
    sock.sendall(conn.data_to_send())
    got = b""
    while got.count(b"\n\n") < events:
        for event in conn.receive_data(sock.recv(65536)):
            if isinstance(event, h2.events.DataReceived):
                got += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        sock.sendall(conn.data_to_send())
    return sock, conn, got


def test_app_for_starts_one_app_per_engine_and_settings(monkeypatch):
    import lab_utils.app as app_module
    started = []

    class Stub:
        alive = True

    def start(ctx, engine, **kw):
        started.append(kw)
        return Stub()

    monkeypatch.setattr(app_module, "start_app", start)
    monkeypatch.setattr(app_module, "_APPS", {})
    engine = type("E", (), {"base_url": "http://127.0.0.1:1"})()
    first = app_module.app_for(None, engine)
    assert app_module.app_for(None, engine) is first and len(started) == 1
    app_module.app_for(None, engine, tls=True)
    assert started == [{}, {"tls": True}]
    first.alive = False                   # stopped: the next call starts a new one
    assert app_module.app_for(None, engine) is not first and len(started) == 3
