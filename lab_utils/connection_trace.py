"""What opening a connection costs a request, as httpx reports it.

httpcore's `trace` extension calls back at each step of a request:
`connection.connect_tcp.*` and `connection.start_tls.*` only when the request
had to open its connection (a request on a reused keep-alive connection
reports neither). `ConnTrace` records those steps, `connection_setup` turns
them into the TCP connect and TLS handshake times, and `traced_stream` times
one streamed chat request (TTFT and E2E as `vllm bench serve` counts them)
together with the set-up it paid.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .stream_timer import StreamTimer


@dataclass
class ConnTrace:
    """What httpcore reported for one request (seconds, perf_counter based)."""
    events: dict[str, float] = field(default_factory=dict)
    tls_version: str | None = None
    alpn: str | None = None

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        self.events.setdefault(name, time.perf_counter())
        if name == "connection.start_tls.complete":
            ssl_object = info["return_value"].get_extra_info("ssl_object")
            if ssl_object is not None:
                self.tls_version = ssl_object.version()
                self.alpn = ssl_object.selected_alpn_protocol()

    def span(self, step: str) -> float | None:
        start = self.events.get(f"connection.{step}.started")
        end = self.events.get(f"connection.{step}.complete")
        return end - start if start is not None and end is not None else None

    @property
    def opened_connection(self) -> bool:
        return "connection.connect_tcp.complete" in self.events


def connection_setup(trace: ConnTrace) -> dict[str, float]:
    """TCP connect and TLS handshake of the request's new connection, in ms
    (0 when it reused one)."""
    tcp, tls = trace.span("connect_tcp"), trace.span("start_tls")
    return {"tcp_ms": (tcp or 0.0) * 1e3, "tls_ms": (tls or 0.0) * 1e3,
            "setup_ms": ((tcp or 0.0) + (tls or 0.0)) * 1e3,
            "new_connection": trace.opened_connection}


async def traced_stream(client, url: str, body: dict, headers: dict | None = None
                        ) -> dict[str, Any]:
    """Stream one chat request through the httpx `client`: TTFT as `vllm bench
    serve` counts it (first chunk with choices), E2E to the last, the HTTP
    version, and the connection set-up the request paid (`connection_setup`,
    with the TLS version and ALPN protocol of a new TLS connection)."""
    trace = ConnTrace()
    row: dict[str, Any] = {"ok": False, "error": ""}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers,
                                 extensions={"trace": trace}) as resp:
            row["http_version"] = resp.http_version
            row["status"] = resp.status_code
            if resp.status_code != 200:
                row["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                timer = StreamTimer(t0)
                async for raw in resp.aiter_raw():
                    timer.feed(raw, time.perf_counter())
                if timer.times:
                    row["ttft_ms"], row["e2e_ms"] = timer.ttft * 1e3, timer.e2e * 1e3
                row["error"] = timer.close()
                row["ok"] = not row["error"]
    except Exception as exc:  # refused, reset, TLS failure
        row["error"] = f"{type(exc).__name__}: {exc}"
    row.update(connection_setup(trace), tls_version=trace.tls_version, alpn=trace.alpn)
    return row


__all__ = ["ConnTrace", "connection_setup", "traced_stream"]
