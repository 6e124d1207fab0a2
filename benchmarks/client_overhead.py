#!/usr/bin/env python3
"""How much latency the lab's own client adds, and how many streams it holds.

    .venv/bin/python benchmarks/client_overhead.py
    .venv/bin/python benchmarks/client_overhead.py --requests 2000 --streams 500

A minimal OpenAI-compatible server (raw asyncio, in a background thread of
this process, on a free 127.0.0.1 port) answers `/v1/chat/completions` the
moment a request arrives, with every SSE chunk (role chunk, N token chunks,
usage chunk, `data: [DONE]`) in ONE write. So whatever E2E the client measures
is the client's own cost (plus loopback and the tiny server):

(a) added latency: sequential requests (warm-up discarded), client-measured
    E2E p50/p99. Goal: p50 < 1 ms.
(b) concurrency: N requests released at once against a server that sends the
    first chunk at once and holds each stream open ~1 s before finishing.
    Goal: all N (>= 200) in flight together, and all succeed.

Exits 1 if a goal is missed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from lab_utils.client import Client, Load, RequestSpec

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations only

P50_GOAL_MS = 1.0
MIN_STREAMS = 200


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def build_stream(tokens: int) -> tuple[bytes, bytes]:
    """(first part, rest) of a vLLM-shaped chat stream with `tokens` tokens."""
    def chunk(delta, finish=None, usage=None):
        out = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
               "model": "bench", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]}
        if usage:
            out["usage"] = usage
        return out

    first = _sse(chunk({"role": "assistant", "content": ""})) + _sse(chunk({"content": "t0 "}))
    rest = b"".join(_sse(chunk({"content": f"t{i} "}, "length" if i == tokens - 1 else None))
                    for i in range(1, tokens))
    rest += _sse({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                  "model": "bench", "choices": [],
                  "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                            "total_tokens": 8 + tokens}})
    rest += _sse(b"[DONE]")
    return first, rest


class _Connection(asyncio.Protocol):
    """HTTP/1.1 keep-alive, just enough for aiohttp's POSTs."""

    def __init__(self, server: StreamServer) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = 0
            for line in bytes(self.buf[:end]).split(b"\r\n")[1:]:
                key, _, value = line.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            del self.buf[:end + 4 + length]
            self.server.respond(self.transport)


class StreamServer:
    """The benchmark's server, in a background thread with its own event loop.

    hold_s == 0: the whole stream in one write (Content-Length, keep-alive).
    hold_s > 0: chunked; the first chunks at once, the rest hold_s later."""

    def __init__(self, tokens: int = 16, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        self.first, self.rest = build_stream(tokens)
        body = self.first + self.rest
        self.instant = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.chunked_head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def respond(self, transport) -> None:
        self.requests += 1
        if not self.hold_s:
            transport.write(self.instant)
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        transport.write(self.chunked_head + _chunked(self.first))

        def finish() -> None:
            self.in_flight -= 1
            if not transport.is_closing():
                transport.write(_chunked(self.rest) + b"0\r\n\r\n")

        self._loop.call_later(self.hold_s, finish)

    def __enter__(self) -> Self:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            server = self._loop.run_until_complete(self._loop.create_server(
                lambda: _Connection(self), "127.0.0.1", 0, backlog=4096))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            server.close()
            self._loop.run_until_complete(server.wait_closed())
            self._loop.close()

        self._thread = threading.Thread(target=serve, name="bench-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the benchmark server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _spec() -> RequestSpec:
    return RequestSpec(messages=[{"role": "user", "content": "hi"}], max_tokens=16)


def measure_latency(requests: int = 500, warmup: int = 50, tokens: int = 16) -> dict:
    """(a) Sequential requests to the instant server; E2E/TTFT stats of the
    measured ones (the warm-up requests share the session and are dropped)."""
    with StreamServer(tokens=tokens) as server:
        client = Client(server.base_url, "bench")
        run = client.run([_spec() for _ in range(warmup + requests)], Load.sequential(),
                         progress=False)
    recs = run.records[warmup:]
    ok = [r for r in recs if r.ok]
    e2e = np.array([r.e2e for r in ok]) * 1e3
    ttft = np.array([r.ttft for r in ok]) * 1e3
    # wall time per request as seen by the caller (send() call to return, incl. JSON parse)
    starts = np.array([r.start for r in recs])
    return {"requests": len(recs), "ok": len(ok), "tokens": tokens,
            "all_tokens": all(r.output_tokens == tokens for r in ok),
            "e2e_p50_ms": float(np.percentile(e2e, 50)) if ok else float("nan"),
            "e2e_p99_ms": float(np.percentile(e2e, 99)) if ok else float("nan"),
            "e2e_max_ms": float(e2e.max()) if ok else float("nan"),
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if ok else float("nan"),
            "per_request_ms": float(np.median(np.diff(starts)) * 1e3) if len(recs) > 1
            else float("nan")}


def measure_concurrency(streams: int = MIN_STREAMS, hold_s: float = 1.0) -> dict:
    """(b) `streams` requests released together; each held open `hold_s`."""
    with StreamServer(tokens=16, hold_s=hold_s) as server:
        client = Client(server.base_url, "bench", timeout_s=60 + hold_s)
        t0 = time.perf_counter()
        run = client.run([_spec() for _ in range(streams)], Load.concurrent(streams),
                         progress=False)
        wall = time.perf_counter() - t0
        max_in_flight = server.max_in_flight
    ok = [r for r in run.records if r.ok]
    errors = sorted({r.error for r in run.records if not r.ok})
    return {"streams": streams, "ok": len(ok), "max_in_flight": max_in_flight,
            "hold_s": hold_s, "wall_s": wall,
            "ttft_p50_ms": float(np.median([r.ttft for r in ok]) * 1e3) if ok else float("nan"),
            "ttft_max_ms": float(max(r.ttft for r in ok) * 1e3) if ok else float("nan"),
            "e2e_max_s": float(max(r.e2e for r in ok)) if ok else float("nan"),
            "errors": errors[:3]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="measured sequential requests")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up requests (discarded)")
    parser.add_argument("--tokens", type=int, default=16, help="token chunks per answer")
    parser.add_argument("--streams", type=int, default=MIN_STREAMS,
                        help=f"concurrent streams (goal: >= {MIN_STREAMS})")
    parser.add_argument("--hold", type=float, default=1.0, help="seconds each stream stays open")
    args = parser.parse_args(argv)

    import aiohttp
    print(f"lab client overhead · Python {platform.python_version()} · aiohttp "
          f"{aiohttp.__version__} · {os.cpu_count()} CPUs · loopback, in-process server")
    lat = measure_latency(args.requests, args.warmup, args.tokens)
    con = measure_concurrency(args.streams, args.hold)

    lat_ok = lat["ok"] == lat["requests"] and lat["e2e_p50_ms"] < P50_GOAL_MS
    con_ok = (con["ok"] == con["streams"] and con["max_in_flight"] >= con["streams"]
              and con["streams"] >= MIN_STREAMS)
    rows = [
        ("(a) added latency", (f"{lat['requests']} sequential after {args.warmup} warm-up, "
                               f"{args.tokens} chunks in one write"), ""),
        ("    E2E p50", f"{lat['e2e_p50_ms']:.3f} ms", f"< {P50_GOAL_MS:g} ms"),
        ("    E2E p99", f"{lat['e2e_p99_ms']:.3f} ms", ""),
        ("    E2E max", f"{lat['e2e_max_ms']:.3f} ms", ""),
        ("    TTFT p50", f"{lat['ttft_p50_ms']:.3f} ms", ""),
        ("    send-to-send p50", f"{lat['per_request_ms']:.3f} ms", ""),
        ("    succeeded", f"{lat['ok']}/{lat['requests']}", "all"),
        ("(b) concurrent streams", f"{con['streams']} at once, held {con['hold_s']:g} s", ""),
        ("    succeeded", f"{con['ok']}/{con['streams']}", "all"),
        ("    max in flight (server)", f"{con['max_in_flight']}", f">= {MIN_STREAMS}"),
        ("    TTFT p50 / max", f"{con['ttft_p50_ms']:.1f} / {con['ttft_max_ms']:.1f} ms", ""),
        ("    E2E max", f"{con['e2e_max_s']:.3f} s", ""),
        ("    wall", f"{con['wall_s']:.2f} s", ""),
    ]
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    print(f"{'measure':<{width}}  {'value':<{vwidth}}  goal")
    print("-" * (width + vwidth + 12))
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:<{vwidth}}  {goal}")
    if con["errors"]:
        print("errors:", *con["errors"], sep="\n  ")
    print(f"(a) {'PASS' if lat_ok else 'FAIL'}  (b) {'PASS' if con_ok else 'FAIL'}")
    return 0 if lat_ok and con_ok else 1


if __name__ == "__main__":
    sys.exit(main())
