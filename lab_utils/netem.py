"""A remote server, emulated on loopback (after Linux's `netem` delay).

On 127.0.0.1 a round trip costs microseconds, so what a new connection costs
against a real remote server (the TCP handshake, the TLS round trips, each
HTTP exchange) is invisible. Two pieces put the round trip back:
- `DelayProxy`: a TCP proxy that delivers every byte a one-way delay late in
  each direction, so every round trip through it costs 2 x the delay;
- `SlowConnect`: an httpcore network backend whose TCP connect waits one RTT
  more, the SYN / SYN-ACK round trip that the kernel completes before any
  user-space proxy sees the connection.
"""
from __future__ import annotations

import asyncio


class SlowConnect:
    """An httpcore network backend whose TCP connect takes `delay_s` longer:
    the SYN / SYN-ACK round trip to a remote server."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    async def connect_tcp(self, host, port, timeout=None, local_address=None,
                          socket_options=None):
        await asyncio.sleep(self.delay_s)
        return await self.inner.connect_tcp(host, port, timeout=timeout,
                                            local_address=local_address,
                                            socket_options=socket_options)

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return await self.inner.connect_unix_socket(path, timeout=timeout,
                                                    socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that delivers every byte `one_way_s` late in
    each direction (in order): one round trip costs 2 x one_way_s, as on a
    link to a remote server. Runs in the caller's event loop."""

    def __init__(self, target_host: str, target_port: int, one_way_s: float):
        self.target = (target_host, target_port)
        self.one_way_s = one_way_s
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.accepted = 0

    async def __aenter__(self) -> DelayProxy:
        self._tasks: set[asyncio.Task] = set()
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in list(self._tasks):  # connections a pool still held open
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader, writer) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        self._tasks.add(task)
        up_writer = None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    async def _pipe(self, src, dst) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    break
                dst.write(data)
                await dst.drain()
            dst.close()

        task = asyncio.create_task(deliver())
        try:
            while data := await src.read(65536):
                queue.put_nowait((loop.time() + self.one_way_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((loop.time() + self.one_way_s, None))
            await asyncio.gather(task, return_exceptions=True)


def delay_connects(transport, delay_s: float):
    """`transport` (an `httpx.AsyncHTTPTransport`) with every TCP connect
    `delay_s` longer (`SlowConnect`). httpcore takes a network backend;
    httpx's transport does not expose it, so it is swapped in its pool."""
    pool = transport._pool
    pool._network_backend = SlowConnect(pool._network_backend, delay_s)
    return transport


__all__ = ["DelayProxy", "SlowConnect", "delay_connects"]
