"""The loopback network emulation: a proxy that adds a round trip, and a
connect that takes one more."""
import asyncio
import time

import httpx

from lab_utils.client import run_sync
from lab_utils.netem import DelayProxy, SlowConnect, delay_connects


def test_delay_proxy_adds_the_round_trip():
    async def echo(reader, writer):
        while data := await reader.read(100):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def go(one_way):
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with DelayProxy("127.0.0.1", port, one_way) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            t0 = time.perf_counter()
            writer.write(b"ping")
            await writer.drain()
            got = await reader.readexactly(4)
            rtt = time.perf_counter() - t0
            writer.close()
        server.close()
        return got, rtt, proxy.accepted

    got, rtt, accepted = run_sync(go(0.05))
    assert got == b"ping" and accepted == 1
    assert 0.1 <= rtt < 0.3


def test_slow_connect_delays_only_the_connect():
    class Inner:
        async def connect_tcp(self, host, port, **kw):
            return (host, port, kw)

        async def sleep(self, s):
            await asyncio.sleep(s)

    async def go():
        t0 = time.perf_counter()
        out = await SlowConnect(Inner(), 0.05).connect_tcp("h", 1, timeout=2)
        return out, time.perf_counter() - t0

    out, took = run_sync(go())
    assert out[:2] == ("h", 1) and out[2]["timeout"] == 2
    assert took >= 0.05


def test_delay_connects_swaps_the_transports_network_backend():
    transport = httpx.AsyncHTTPTransport()
    inner = transport._pool._network_backend
    assert delay_connects(transport, 0.2) is transport
    backend = transport._pool._network_backend
    assert isinstance(backend, SlowConnect) and backend.inner is inner and backend.delay_s == 0.2
