"""A tiny OpenAI-compatible streaming server for the client tests.

It runs an aiohttp web app on 127.0.0.1 in a background thread (its own event
loop), so `Client.run` can be called from the test's thread exactly as a
notebook calls it. The request's `model` field picks the behaviour:

- "chat": vLLM's chat stream shape: a role chunk after 50 ms, then 5 content
  chunks 20 ms apart (each with continuous usage, and with `logprobs` of
  `self.logprob` per token if the request asks for them), a usage-only chunk
  (completion_tokens=5, cached_tokens=8) and `data: [DONE]`.
- "text": completions stream: 3 text chunks 10 ms apart, usage, [DONE].
- "http500": HTTP 500 with a JSON error body.
- "drop": a role chunk and 2 content chunks, then the connection is cut.
- "stream_error": one chunk, then an `{"error": ...}` event, then [DONE].
- "empty": only [DONE].
- "hold": one content chunk after HOLD_S, usage, [DONE] (for concurrency).
- "slow": waits 5 s before answering (for client timeouts).
- "slots": an engine with SLOTS requests' room: each request waits for a slot,
  holds it SLOT_S, then answers one token (capacity SLOTS / SLOT_S req/s).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

CHAT_FIRST_S = 0.050
CHAT_GAP_S = 0.020
CHAT_TOKENS = 5
TEXT_GAP_S = 0.010
HOLD_S = 0.3
SLOTS = 2
SLOT_S = 0.1


class FakeOpenAI:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.probe: Callable[[dict], None] | None = None   # called with each request body
        self.logprob = -0.5   # each chat token's log-prob when a request asks for logprobs
        self._slot_sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Forget earlier requests, after the previous test's handlers (e.g. one
        cancelled by a client timeout) have finished and left `in_flight`."""
        deadline = time.monotonic() + 6
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        self.requests.clear()
        self.in_flight = self.max_in_flight = 0
        self.probe = None
        self.logprob = -0.5

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> FakeOpenAI:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            self.add_routes(app.router)
            self._runner = web.AppRunner(app, shutdown_timeout=1.0, handler_cancellation=True,
                                         access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=serve, name="fake-openai", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fake server did not start")
        return self

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """The endpoints it serves (a subclass adds its own: tests/fake_vllm.py)."""
        router.add_post("/v1/chat/completions", self._handle)
        router.add_post("/v1/completions", self._handle)
        router.add_get("/health", self._health)
        router.add_get("/v1/models", self._models)
        router.add_post("/v1/chat/completions/render", self._render)
        router.add_post("/v1/completions/render", self._render)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    # -- handlers --------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")  # vLLM answers 200 with an empty body

    async def _render(self, request: web.Request) -> web.Response:
        """vLLM's render endpoints (a router asks them for a request's token
        ids): here one "token" per byte of the prompt or the messages' text."""
        body = await request.json()
        text = body.get("prompt") or "".join(m.get("content") or "" for m in body.get("messages", []))
        rendered = {"request_id": "render", "token_ids": list(text.encode()) or [0]}
        return web.json_response(rendered if "messages" in body else [rendered])

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "chat", "object": "model"}]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append({"path": request.path, "body": body, "time": time.perf_counter(),
                              "authorization": request.headers.get("Authorization")})
        if self.probe is not None:
            self.probe(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await getattr(self, "_" + body["model"])(request, body)
        finally:
            self.in_flight -= 1

    @staticmethod
    async def _open(request: web.Request) -> tuple[web.StreamResponse, Callable]:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        return resp, send

    @staticmethod
    def _chunk(content: str | None, usage: dict | None, *, role: bool = False,
               finish: str | None = None, logprob: float | None = None) -> dict:
        delta = {"role": "assistant", "content": ""} if role else {"content": content}
        logprobs = None if logprob is None or role else \
            {"content": [{"token": content, "logprob": logprob, "top_logprobs": []}]}
        out = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
               "model": "chat", "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish}]}
        if usage is not None:
            out["usage"] = usage
        return out

    async def _chat(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp, send = await self._open(request)
        await asyncio.sleep(CHAT_FIRST_S)
        await send(self._chunk(None, {"prompt_tokens": 12, "completion_tokens": 0,
                                      "total_tokens": 12}, role=True))
        for i in range(1, CHAT_TOKENS + 1):
            await asyncio.sleep(CHAT_GAP_S)
            await send(self._chunk(f"w{i} ", {"prompt_tokens": 12, "completion_tokens": i,
                                              "total_tokens": 12 + i},
                                   finish="length" if i == CHAT_TOKENS else None,
                                   logprob=self.logprob if body.get("logprobs") else None))
        await send({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                    "model": "chat", "choices": [],
                    "usage": {"prompt_tokens": 12, "completion_tokens": CHAT_TOKENS,
                              "total_tokens": 12 + CHAT_TOKENS,
                              "prompt_tokens_details": {"cached_tokens": 8}}})
        await send("[DONE]")
        return resp

    async def _text(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp, send = await self._open(request)
        for i, piece in enumerate(["a", "b", "c"]):
            if i:
                await asyncio.sleep(TEXT_GAP_S)
            await send({"id": "cmpl-1", "object": "text_completion", "model": "text",
                        "choices": [{"index": 0, "text": piece, "logprobs": None,
                                     "finish_reason": "stop" if i == 2 else None}]})
        await send({"id": "cmpl-1", "object": "text_completion", "model": "text", "choices": [],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}})
        await send("[DONE]")
        return resp

    async def _http500(self, request: web.Request, body: dict) -> web.StreamResponse:
        return web.json_response({"error": {"message": "engine dead", "code": 500}}, status=500)

    async def _drop(self, request: web.Request, body: dict) -> web.StreamResponse:
        _resp, send = await self._open(request)
        await send(self._chunk(None, None, role=True))
        for i in range(2):
            await asyncio.sleep(0.01)
            await send(self._chunk(f"x{i}", None))
        await asyncio.sleep(0.01)
        request.transport.abort()   # cut the connection mid-stream
        raise asyncio.CancelledError

    async def _stream_error(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp, send = await self._open(request)
        await send(self._chunk(None, None, role=True))
        await send({"error": {"message": "engine overloaded", "code": 503}})
        await send("[DONE]")
        return resp

    async def _empty(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp, send = await self._open(request)
        await send("[DONE]")
        return resp

    async def _hold(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp, send = await self._open(request)
        await asyncio.sleep(HOLD_S)
        await send(self._chunk("held", {"prompt_tokens": 1, "completion_tokens": 1,
                                        "total_tokens": 2}, finish="length"))
        await send("[DONE]")
        return resp

    async def _slow(self, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.sleep(5)
        return web.json_response({})

    async def _slots(self, request: web.Request, body: dict) -> web.StreamResponse:
        if self._slot_sem is None:
            self._slot_sem = asyncio.Semaphore(SLOTS)
        resp, send = await self._open(request)
        async with self._slot_sem:
            await asyncio.sleep(SLOT_S)
        await send(self._chunk("ok", {"prompt_tokens": 1, "completion_tokens": 1,
                                      "total_tokens": 2}, finish="length"))
        await send("[DONE]")
        return resp

