"""A streaming chat app in front of a vLLM server: the article's FastAPI
`/chat` endpoint, done right.

    from lab_utils.app import AppServer
    with AppServer.for_engine(engine, log_dir="logs") as app:
        client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="none")
        for chunk in client.chat.completions.create(model=engine.model, messages=[...],
                                                     stream=True): ...

Endpoints
- `POST /v1/chat/completions`: OpenAI-compatible. `stream=true` answers OpenAI
  chat-chunk Server-Sent Events (vLLM's own chunks, re-framed), so the `openai`
  SDK works against `APP/v1`; `stream=false` answers the JSON body.
- `POST /chat`: the article's simpler shape, `{"messages": [...]}` (or
  `{"message": "text"}`), answering `data: {"content": "..."}` events, one
  `data: {"finish_reason": ..., "usage": ...}` event and `data: [DONE]`.
- `POST /chat/article`: the article's snippet as written (a bare `data: `, then
  one unframed JSON line per token, no `text/event-stream` type). Kept only to
  show that SSE clients cannot parse it: no blank line ever ends an event.
- `GET /health`, `GET /stats` (requests, streams, client disconnects, distinct
  client connections by HTTP version, upstream connections opened),
  `POST /stats/reset`.

What "done right" means here:
- SSE framing by hand: every event is `data: <one line>\\n\\n`; the stream ends
  with `data: [DONE]\\n\\n`.
- One shared upstream `httpx.AsyncClient` (a keep-alive pool with the article's
  limits, idle expiry 4 s, under vLLM's 5 s idle timeout), created at start-up
  and closed at shutdown.
- A client that disconnects cancels the relay; the relay then closes its
  upstream response, which closes that HTTP/1.1 connection to vLLM, and vLLM
  aborts the generation (no orphan work). A non-streamed request whose client
  leaves is cancelled the same way (the app polls for the disconnect).
- Clear errors: 400 (body not JSON), 422 (invalid fields), vLLM's own 4xx
  passed through with its message, 503 (vLLM unreachable, or the upstream pool
  is full), 504 (vLLM timed out), 502 (vLLM failed or answered nonsense). Once
  a stream has started the status line is gone, so a later failure becomes an
  SSE event `data: {"error": {...}}` followed by `data: [DONE]`, which the
  `openai` SDK raises as `APIError`.
- Timing for the overhead measurement: a streamed `/v1` answer ends with an SSE
  comment (`: lab-timing {...}`, ignored by SSE clients) holding the app's own
  view of the upstream TTFT and E2E; a non-streamed answer carries a
  `Server-Timing: upstream;dur=<ms>` header.

`python -m lab_utils.app --upstream URL --model NAME --port N` serves it with
uvicorn (HTTP/1.1) or, with `--server hypercorn`, with Hypercorn, which speaks
HTTP/2 over TLS (`--certfile/--keyfile`, ALPN `h2` then `http/1.1`).
`AppServer` starts that command as a subprocess exactly as `lab_utils.server`
starts vLLM: own process group, log file, health wait, clean stop, context
manager, and the `LAB_UTILS_SERVER_OWNER` mark that leftover checks look for.
"""
# No `from __future__ import annotations`: FastAPI must see the request models
# (built inside create_app) as classes, not as strings it cannot resolve.
import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import shlex
import signal
import ssl
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .server import OWNER_ENV, ServerError, VLLMServer, free_port  # noqa: F401 (OWNER_ENV: see AppServer)
from .sse import pop_sse_blocks, pop_sse_data, sse_comment, sse_data, sse_event  # noqa: F401
from .stream_timer import StreamTimer

#: The article's connection-reuse settings.
ARTICLE_LIMITS = {"max_connections": 100, "max_keepalive_connections": 20,
                  "keepalive_expiry": 30.0}
#: The app's pool to vLLM: the article's limits, but idle connections expire
#: before vLLM drops them (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a request sent on
#: a connection the server is closing at that moment would fail.
UPSTREAM_LIMITS = {**ARTICLE_LIMITS, "keepalive_expiry": 4.0}
#: Environment variable that carries the upstream API key (kept off the command line).
API_KEY_ENV = "LAB_APP_UPSTREAM_API_KEY"
DONE = b"data: [DONE]\n\n"
TIMING_COMMENT = "lab-timing"
#: Paths whose requests are not counted as traffic (the lab's own probes).
_PROBES = ("/health", "/stats", "/stats/reset")


# --------------------------------------------------------------------------
# SSE framing: lab_utils.sse (one parser for the client, the app and the
# delivery experiments); the app's timing comment
# --------------------------------------------------------------------------

def timing_from_comment(block: str) -> dict[str, float] | None:
    """The app's `: lab-timing {...}` comment, parsed (None if `block` is not one)."""
    prefix = f": {TIMING_COMMENT} "
    for line in block.splitlines():
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return None


def article_stream(pieces: Iterable[str]) -> Iterable[bytes]:
    """The bytes of the article's snippet: `yield "data: "` once, then
    `json.dumps({"content": token}) + "\\n"` per token."""
    yield b"data: "
    for piece in pieces:
        yield (json.dumps({"content": piece}) + "\n").encode()


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """OpenAI's error shape (the `openai` SDK shows `error.message`)."""
    return {"error": {"message": message, "type": kind, "code": status}}


# --------------------------------------------------------------------------
# Request shapes
# --------------------------------------------------------------------------

def _models():
    # Built lazily so importing lab_utils.app stays cheap (no pydantic/fastapi).
    from pydantic import BaseModel, ConfigDict, Field, model_validator

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: Literal["system", "user", "assistant", "tool", "developer"]
        content: str | list[Any] | None = None

    class OpenAIChatRequest(BaseModel):
        """OpenAI chat body: the fields checked here, the rest passed through."""
        model_config = ConfigDict(extra="allow")
        model: str | None = None
        messages: list[Message] = Field(min_length=1)
        stream: bool = False
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        temperature: float | None = Field(None, ge=0, le=2)
        top_p: float | None = Field(None, gt=0, le=1)
        n: int | None = Field(None, ge=1, le=1)

    class ChatRequest(BaseModel):
        """The article's `/chat` shape: messages (or one message) and a budget."""
        model_config = ConfigDict(extra="forbid")
        messages: list[Message] | None = Field(None, min_length=1)
        message: str | None = Field(None, min_length=1)
        max_tokens: int = Field(256, ge=1)
        temperature: float = Field(0.0, ge=0, le=2)
        ignore_eos: bool = False

        @model_validator(mode="after")
        def _one_of(self):
            if (self.messages is None) == (self.message is None):
                raise ValueError("give exactly one of 'messages' (a list of "
                                 "{role, content}) or 'message' (a string)")
            return self

        def chat_messages(self) -> list[dict[str, Any]]:
            if self.message is not None:
                return [{"role": "user", "content": self.message}]
            return [m.model_dump(exclude_none=True) for m in self.messages]

    return OpenAIChatRequest, ChatRequest


# --------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------

@dataclass
class AppSettings:
    upstream: str                       # vLLM base URL, e.g. http://127.0.0.1:8000
    model: str                          # served model name (default for requests)
    api_key: str | None = None          # upstream Authorization bearer token
    upstream_timeout_s: float = 120.0   # max wait for vLLM's next bytes
    connect_timeout_s: float = 5.0
    pool_timeout_s: float = 10.0
    limits: dict[str, float] = field(default_factory=lambda: dict(UPSTREAM_LIMITS))


class UpstreamFailure(Exception):
    """vLLM could not be used; `status` is the HTTP status the app answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Stats:
    """What the app saw, for /stats (the notebooks read it)."""
    started: str = field(default_factory=lambda: _dt.datetime.now().isoformat(timespec="seconds"))
    requests: Counter = field(default_factory=Counter)            # by path
    statuses: Counter = field(default_factory=Counter)            # by status code
    connections: dict[str, set] = field(default_factory=dict)     # http version -> client addrs
    streams_started: int = 0
    streams_completed: int = 0
    client_disconnects: int = 0
    upstream_aborted: int = 0      # upstream responses closed before vLLM finished
    upstream_errors: Counter = field(default_factory=Counter)
    upstream_connections: int = 0  # TCP connections the app opened to vLLM

    def as_dict(self, clients: bool = False) -> dict[str, Any]:
        out = self._summary()
        if clients:  # the client addresses themselves, to union counts across resets
            out["connections"]["clients"] = {k: sorted(f"{a[0]}:{a[1]}" for a in s)
                                             for k, s in self.connections.items()}
        return out

    def _summary(self) -> dict[str, Any]:
        return {"started": self.started, "requests": dict(self.requests),
                "statuses": {str(k): v for k, v in self.statuses.items()},
                "connections": {"total": sum(len(s) for s in self.connections.values()),
                                "by_http_version": {k: len(s) for k, s in
                                                    self.connections.items()}},
                "streams": {"started": self.streams_started,
                            "completed": self.streams_completed,
                            "client_disconnects": self.client_disconnects,
                            "upstream_aborted": self.upstream_aborted},
                "upstream": {"errors": dict(self.upstream_errors),
                             "connections_opened": self.upstream_connections}}


def _upstream_message(body: bytes) -> str:
    """vLLM's error message from its JSON body (or the raw text)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return json.dumps(data)[:500]


def create_app(settings: AppSettings):
    """The FastAPI app (one shared upstream client for its whole life)."""
    import anyio
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException

    OpenAIChatRequest, ChatRequest = _models()
    stats = Stats()
    state: dict[str, httpx.AsyncClient] = {}

    async def count_upstream_connect(event: str, info: dict) -> None:
        # httpcore's trace extension: an async callback for an async client.
        if event == "connection.connect_tcp.complete":
            stats.upstream_connections += 1

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        limits = settings.limits
        state["client"] = httpx.AsyncClient(
            base_url=settings.upstream.rstrip("/"), headers=headers,
            limits=httpx.Limits(max_connections=int(limits["max_connections"]),
                                max_keepalive_connections=int(limits["max_keepalive_connections"]),
                                keepalive_expiry=limits["keepalive_expiry"]),
            timeout=httpx.Timeout(settings.upstream_timeout_s, connect=settings.connect_timeout_s,
                                  pool=settings.pool_timeout_s))
        try:
            yield
        finally:
            await state.pop("client").aclose()

    app = FastAPI(title="vLLM Latency Lab streaming app", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.stats = stats

    # -- bookkeeping: requests, statuses and distinct client connections ------
    class Bookkeeping:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http" or scope["path"] in _PROBES:
                return await self.inner(scope, receive, send)
            scope["lab_t_in"] = time.perf_counter()
            stats.requests[scope["path"]] += 1
            client = scope.get("client")
            stats.connections.setdefault(scope.get("http_version", "?"), set()).add(
                tuple(client) if client else ("?", len(stats.requests)))

            async def counting_send(message):
                if message["type"] == "http.response.start":
                    stats.statuses[message["status"]] += 1
                await send(message)

            return await self.inner(scope, receive, counting_send)

    app.add_middleware(Bookkeeping)

    # -- errors ---------------------------------------------------------------
    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(error_body(status, message, kind), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            return error(400, "the request body is not valid JSON "
                              f"({detail.get('ctx', {}).get('error', 'parse error')})")
        if any(e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",)
               for e in errors):
            return error(400, "the request has no body: send a JSON object "
                              "(Content-Type: application/json)")
        parts = []
        for e in errors:
            where = ".".join(str(p) for p in e.get("loc", ())[1:]) or "body"
            parts.append(f"{where}: {e.get('msg', 'invalid')}")
        return error(422, "invalid request: " + "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), "not_found_error"
                     if exc.status_code == 404 else "invalid_request_error")

    # -- upstream -------------------------------------------------------------
    async def open_upstream(body: dict[str, Any], stream: bool) -> tuple[httpx.Response, float]:
        """POST to vLLM; return the response (streaming: headers only) and the
        perf_counter at send. Maps every failure to an UpstreamFailure."""
        client = state["client"]
        request = client.build_request("POST", "/v1/chat/completions", json=body,
                                       extensions={"trace": count_upstream_connect})
        t_send = time.perf_counter()
        try:
            response = await client.send(request, stream=stream)
        except httpx.ConnectError as exc:
            stats.upstream_errors["unreachable"] += 1
            raise UpstreamFailure(503, f"the vLLM server at {settings.upstream} is not "
                                       f"reachable ({exc or 'connection refused'}); is it "
                                       "running?") from exc
        except httpx.PoolTimeout as exc:
            stats.upstream_errors["pool_full"] += 1
            raise UpstreamFailure(503, "every upstream connection is busy (pool of "
                                       f"{settings.limits['max_connections']:.0f}); retry "
                                       "later") from exc
        except httpx.TimeoutException as exc:
            stats.upstream_errors["timeout"] += 1
            raise UpstreamFailure(504, f"the vLLM server at {settings.upstream} did not answer "
                                       f"within {settings.upstream_timeout_s:g} s "
                                       f"({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            stats.upstream_errors["protocol"] += 1
            raise UpstreamFailure(502, f"the vLLM server at {settings.upstream} failed: "
                                       f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raw = await response.aread() if stream else response.content
            await response.aclose()
            message = _upstream_message(raw)
            status = response.status_code
            stats.upstream_errors[f"http_{status}"] += 1
            if 400 <= status < 500:
                raise UpstreamFailure(status, message)  # the request's own fault
            raise UpstreamFailure(503 if status == 503 else 502,
                                  f"the vLLM server answered HTTP {status}: {message}")
        return response, t_send

    async def close_upstream(response: httpx.Response, finished: bool) -> None:
        if response.is_closed:
            return
        if not finished:
            stats.upstream_aborted += 1
        # Shielded: under a cancelled task the close must still reach the socket,
        # or vLLM never learns the client is gone.
        with anyio.CancelScope(shield=True):
            await response.aclose()

    async def relay(response: httpx.Response, t_in: float, t_send: float, progress: dict, *,
                    shape: Literal["openai", "chat"]) -> AsyncIterator[bytes]:
        """Re-frame vLLM's stream to the client; see the module docstring."""
        stats.streams_started += 1
        timer = StreamTimer(t_send)
        finished, finish_reason, usage = False, None, None
        out: list[bytes] = []

        def reframe(data: str, chunk: dict) -> None:
            nonlocal finish_reason, usage
            choices = chunk.get("choices") or []
            if shape == "openai":
                out.append(sse_event(data))
            elif "error" in chunk and not choices:
                out.append(sse_event({"error": chunk["error"]}))
            else:
                usage = chunk.get("usage") or usage
                for choice in choices:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        out.append(sse_event({"content": piece}))
                    finish_reason = choice.get("finish_reason") or finish_reason

        try:
            try:
                async for raw in response.aiter_raw():
                    bad = timer.bad_chunks
                    timer.feed(raw, time.perf_counter(), each=reframe, strict=False)
                    stats.upstream_errors["bad_chunk"] += timer.bad_chunks - bad
                    progress["finished"] = finished = timer.done
                    if out:
                        yield b"".join(out)
                        out.clear()
                if not finished:
                    stats.upstream_errors["truncated"] += 1
                    yield sse_event(error_body(502, "the vLLM stream ended without [DONE]",
                                               "upstream_error"))
            except httpx.TimeoutException:
                stats.upstream_errors["timeout"] += 1
                yield sse_event(error_body(504, "the vLLM server stopped sending for "
                                                f"{settings.upstream_timeout_s:g} s",
                                           "upstream_timeout"))
            except httpx.HTTPError as exc:
                stats.upstream_errors["lost"] += 1
                yield sse_event(error_body(502, f"the vLLM stream broke: {type(exc).__name__}",
                                           "upstream_error"))
            if shape == "chat" and finished:
                yield sse_event({"finish_reason": finish_reason, "usage": usage})
            timing = {"app_to_upstream_s": t_send - t_in,
                      "upstream_ttft_s": timer.ttft, "upstream_e2e_s": timer.e2e}
            yield sse_comment(f"{TIMING_COMMENT} {json.dumps(timing)}") + DONE
            stats.streams_completed += 1
        except BaseException:
            # Cancelled (the client went away) or a failed send: either way the
            # client is gone.
            stats.client_disconnects += 1
            raise
        finally:
            await close_upstream(response, finished)

    def stream_response(response, t_in, t_send, shape) -> StreamingResponse:
        progress = {"finished": False}

        async def close_after() -> None:
            await close_upstream(response, progress["finished"])

        return StreamingResponse(
            relay(response, t_in, t_send, progress, shape=shape), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            # Runs after the response even if the client left before (or while)
            # the relay was suspended: the upstream response is closed either way.
            background=BackgroundTask(close_after))

    async def unless_disconnected(request: Request, work, poll_s: float = 0.1):
        """Await `work` (a whole non-streamed upstream request), but if the
        client disconnects first, cancel it (httpx then closes the upstream
        connection and vLLM aborts) and return None."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, UpstreamFailure):
                    await task
                stats.client_disconnects += 1
                stats.upstream_aborted += 1
                return None

    def t_in_of(request: Request) -> float:
        return request.scope.get("lab_t_in", time.perf_counter())

    # -- endpoints --------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "upstream": settings.upstream, "model": settings.model}

    @app.get("/stats")
    async def get_stats(clients: bool = False):
        return stats.as_dict(clients)

    @app.post("/stats/reset")
    async def reset_stats():
        fresh = Stats()
        for name in ("requests", "statuses", "connections", "streams_started",
                     "streams_completed", "client_disconnects", "upstream_aborted",
                     "upstream_errors", "upstream_connections", "started"):
            setattr(stats, name, getattr(fresh, name))
        return stats.as_dict()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: OpenAIChatRequest, request: Request):
        t_in = t_in_of(request)
        payload = body.model_dump(exclude_unset=True, exclude_none=True)
        payload["model"] = payload.get("model") or settings.model
        payload["stream"] = body.stream
        try:
            if body.stream:
                response, t_send = await open_upstream(payload, stream=True)
                return stream_response(response, t_in, t_send, "openai")
            got = await unless_disconnected(request, open_upstream(payload, stream=False))
            if got is None:  # the client left; nobody reads this answer
                return Response(status_code=499)
            response, t_send = got
        except UpstreamFailure as exc:
            return error(exc.status, exc.message, "upstream_error" if exc.status >= 500
                         else "invalid_request_error")
        upstream_ms = (time.perf_counter() - t_send) * 1e3
        return Response(response.content, media_type="application/json",
                        headers={"Server-Timing": f"upstream;dur={upstream_ms:.3f}, "
                                                  f"app;dur={(t_send - t_in) * 1e3:.3f}"})

    @app.post("/chat")
    async def chat(body: ChatRequest, request: Request):
        t_in = t_in_of(request)
        payload = {"model": settings.model, "messages": body.chat_messages(), "stream": True,
                   "max_tokens": body.max_tokens, "temperature": body.temperature,
                   "stream_options": {"include_usage": True}}
        if body.ignore_eos:
            payload["ignore_eos"] = True
        try:
            response, t_send = await open_upstream(payload, stream=True)
        except UpstreamFailure as exc:
            return error(exc.status, exc.message, "upstream_error" if exc.status >= 500
                         else "invalid_request_error")
        return stream_response(response, t_in, t_send, "chat")

    @app.post("/chat/article")
    async def chat_article(body: ChatRequest):
        """The article's snippet, faithfully: for the notebook's framing demo."""
        payload = {"model": settings.model, "messages": body.chat_messages(), "stream": True,
                   "max_tokens": body.max_tokens, "temperature": body.temperature}
        try:
            response, _ = await open_upstream(payload, stream=True)
        except UpstreamFailure as exc:
            return error(exc.status, exc.message, "upstream_error")

        async def tokens():
            buffer = bytearray()
            async for raw in response.aiter_raw():
                buffer += raw
                for data in pop_sse_data(buffer):
                    if data != "[DONE]":
                        for choice in json.loads(data).get("choices") or []:
                            if (choice.get("delta") or {}).get("content"):
                                yield choice["delta"]["content"]

        async def stream():
            yield b"data: "  # "send the header at once", as the article says
            try:
                async for token in tokens():
                    yield (json.dumps({"content": token}) + "\n").encode()
            finally:
                await close_upstream(response, True)

        return StreamingResponse(stream())  # no media type, as in the article

    return app


# --------------------------------------------------------------------------
# Serving it (the subprocess's side)
# --------------------------------------------------------------------------

def self_signed_certificate(directory: str | Path, hosts: Iterable[str] = ("127.0.0.1",
                                                                         "localhost"),
                            key_type: Literal["ec", "rsa"] = "ec",
                            days: int = 2) -> tuple[Path, Path]:
    """A self-signed certificate for `hosts` (IP addresses and DNS names), made
    now; returns (cert.pem, key.pem). Clients trust it with
    `ssl.create_default_context(cafile=cert)` (real verification, no
    `verify=False`)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if key_type == "ec":
        key = ec.generate_private_key(ec.SECP256R1())
    elif key_type == "rsa":
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    else:
        raise ValueError(f"key_type must be 'ec' or 'rsa', got {key_type!r}")
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vLLM Latency Lab app")])
    now = _dt.datetime.now(_dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def hypercorn_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("hypercorn") is not None


def serve(settings: AppSettings, *, host: str = "127.0.0.1", port: int = 8080,
          server: Literal["uvicorn", "hypercorn"] = "uvicorn", certfile: str | None = None,
          keyfile: str | None = None, keep_alive_s: float = 30.0) -> None:
    """Serve the app in this process until SIGTERM/SIGINT."""
    app = create_app(settings)
    if server == "uvicorn":
        import uvicorn
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                    timeout_keep_alive=int(keep_alive_s), ssl_certfile=certfile,
                    ssl_keyfile=keyfile)
        return
    if server != "hypercorn":
        raise ValueError(f"server must be 'uvicorn' or 'hypercorn', got {server!r}")
    if not hypercorn_available():
        raise SystemExit("HTTP/2 needs Hypercorn (uvicorn speaks HTTP/1.1 only): "
                         "pip install hypercorn==0.18.0")
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.keep_alive_timeout = keep_alive_s
    config.accesslog = None
    config.loglevel = "WARNING"
    if certfile:
        config.certfile, config.keyfile = certfile, keyfile
        config.alpn_protocols = ["h2", "http/1.1"]

    config.graceful_timeout = 1.0

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        async def shutdown_trigger() -> None:
            await stop.wait()
            # Hypercorn's shutdown waits for idle keep-alive connections to
            # time out (up to keep_alive_s); an app that was told to stop exits.
            loop.call_later(config.graceful_timeout + 0.5, os._exit, 0)

        await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger)

    asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab_utils.app", description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="vLLM base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--server", choices=("uvicorn", "hypercorn"), default="uvicorn")
    p.add_argument("--certfile")
    p.add_argument("--keyfile")
    p.add_argument("--keep-alive-s", type=float, default=30.0,
                   help="idle keep-alive of client connections (the article's client keeps 30 s)")
    p.add_argument("--upstream-timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    settings = AppSettings(args.upstream, args.model, api_key=os.environ.get(API_KEY_ENV) or None,
                           upstream_timeout_s=args.upstream_timeout_s)
    serve(settings, host=args.host, port=args.port, server=args.server, certfile=args.certfile,
          keyfile=args.keyfile, keep_alive_s=args.keep_alive_s)


# --------------------------------------------------------------------------
# Starting it (the notebook's side)
# --------------------------------------------------------------------------

class AppServer(VLLMServer):
    """The app as a subprocess on 127.0.0.1: `VLLMServer`'s process handling
    (own process group, SIGTERM when the starter dies, log file, clean stop of
    the group, `LAB_UTILS_SERVER_OWNER` in its environment, stopped at exit)
    with the app's own command, URL scheme and health check."""

    def __init__(self, upstream: str, model: str, *, log_path: str | Path,
                 api_key: str | None = None, port: int | None = None,
                 server: Literal["uvicorn", "hypercorn"] = "uvicorn", tls: bool = False,
                 cert_dir: str | Path | None = None, keep_alive_s: float = 30.0,
                 upstream_timeout_s: float = 120.0, startup_timeout_s: float = 60.0,
                 host: str = "127.0.0.1"):
        if server == "hypercorn" and not hypercorn_available():
            raise ServerError("serving the app over HTTP/2 needs Hypercorn (uvicorn speaks "
                              "HTTP/1.1 only): pip install hypercorn==0.18.0")
        port = port or free_port(host)
        self.upstream, self.model, self.server, self.tls = upstream, model, server, tls
        self.cert_path = self.key_path = None
        argv = [sys.executable, "-m", "lab_utils.app", "--upstream", upstream, "--model", model,
                "--host", host, "--port", str(port), "--server", server,
                "--keep-alive-s", f"{keep_alive_s:g}",
                "--upstream-timeout-s", f"{upstream_timeout_s:g}"]
        if tls:
            cert_dir = Path(cert_dir or Path(log_path).parent / f"tls-{port}")
            self.cert_path, self.key_path = self_signed_certificate(cert_dir)
            argv += ["--certfile", str(self.cert_path), "--keyfile", str(self.key_path)]
        env = {API_KEY_ENV: api_key} if api_key else {}
        super().__init__(argv, port=port, log_path=Path(log_path), env=env,
                         startup_timeout_s=startup_timeout_s, served_model_name=model, host=host)

    @classmethod
    def for_engine(cls, engine, log_dir: str | Path = "logs", **kw: Any) -> "AppServer":
        """An app in front of a lab `Engine` (local or remote)."""
        log_dir = Path(log_dir)
        tag = f"{kw.get('server', 'uvicorn')}{'-tls' if kw.get('tls') else ''}"
        n = len(list(log_dir.glob("app-*.log"))) if log_dir.exists() else 0
        return cls(engine.base_url, engine.model, api_key=engine.api_key,
                   log_path=log_dir / f"app-{n:02d}-{tag}.log", **kw)

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def command(self) -> str:
        shown = ["python", *self.argv[1:]]
        return shlex.join(shown) + (f"  (upstream key in ${API_KEY_ENV})" if self.env else "")

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context that trusts exactly this app's certificate."""
        return ssl.create_default_context(cafile=str(self.cert_path)) if self.tls else None

    def get_json(self, path: str, method: str = "GET", timeout: float = 5.0) -> dict[str, Any]:
        req = urllib.request.Request(self.base_url + path, method=method,
                                     data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context()) as resp:
            return json.loads(resp.read())

    def stats(self, clients: bool = False) -> dict[str, Any]:
        """The app's /stats; `clients=True` adds the client addresses it saw."""
        return self.get_json("/stats?clients=true" if clients else "/stats")

    def reset_stats(self) -> dict[str, Any]:
        return self.get_json("/stats/reset", method="POST")

    what, poll_s = "the app", 0.1

    def _healthy(self) -> bool:
        return self.get_json("/health", timeout=2).get("status") == "ok"

    def describe(self) -> dict[str, Any]:
        """The app for the results file (`Results.add_app`)."""
        return {"command": self.command, "base_url": self.base_url, "server": self.server,
                "tls": self.tls, "upstream": self.upstream, "startup_s": self.startup_s}

    def __repr__(self) -> str:
        state = "running" if self.alive else "stopped"
        return f"<AppServer {state} {self.base_url} -> {self.upstream}>"


def start_app(ctx, engine, **kw: Any) -> AppServer:
    """A notebook's app in front of `engine`, started (`kw` as for
    `AppServer`; its log under the notebook's logs), with the engine's and
    the app's exact commands in the notebook's results file."""
    app = AppServer.for_engine(engine, log_dir=ctx.results.dir / "logs" / ctx.name, **kw)
    app.start()
    print(f"[app] {app.command}  (ready in {app.startup_s:.1f} s)")
    ctx.results.add_engine(engine)
    ctx.results.add_app(app)
    return app


_APPS: dict[str, AppServer] = {}


def app_for(ctx, engine, **kw: Any) -> AppServer:
    """The notebook's app in front of `engine` (`start_app` once for each
    engine and settings, then the same app while it runs)."""
    key = f"{engine.base_url}|{sorted(kw.items())}"
    app = _APPS.get(key)
    if app is None or not app.alive:
        app = _APPS[key] = start_app(ctx, engine, **kw)
    return app


def dead_upstream_app(ctx) -> AppServer:
    """An app whose vLLM is not running (a free port nobody listens on): what
    a client sees when the engine behind the app is down."""
    app = AppServer(f"http://127.0.0.1:{free_port()}", "none",
                    log_path=ctx.results.dir / "logs" / ctx.name / "app-dead-upstream.log")
    return app.start()


if __name__ == "__main__":
    main()
