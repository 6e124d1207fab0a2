"""Experiments of `08_connection_reuse`: what one shared keep-alive client
(the article's `httpx.AsyncClient(http2=True, limits=...)`) saves against a
new client and connection per request.

One engine (the plan's baseline arm: the profile's flags) serves every arm;
the arms are clients of it, and the client side is the only thing that changes:
- `new`: a new `httpx.AsyncClient` per request, so a new TCP connection (and
  TLS handshake) per request, closed after it;
- `pooled`: one shared client with the article's limits (100 connections, 20
  kept alive, 30 s expiry), HTTP/1.1;
- `http2`: the same shared client with `http2=True`. HTTP/2 is negotiated by
  ALPN inside TLS, so it only happens against a TLS server that offers `h2`:
  vLLM's own server (uvicorn, `vllm/entrypoints/launchers/api_server/entry.py`)
  speaks HTTP/1.1 only, so against vLLM this arm is HTTP/1.1 again, and the
  real HTTP/2 arm runs against the project's app served by Hypercorn over TLS
  with a self-signed certificate made at run time.

Every request carries httpcore's `trace` extension, which reports the TCP
connect and the TLS handshake of the connection a request had to open (a
request on a reused connection reports neither), so set-up cost per request
and connections opened are counted, not assumed. The app also counts the
distinct client connections it accepted (`/stats`).

A remote server is emulated on loopback by `lab_utils.netem`: `DelayProxy`
(every byte waits a one-way delay in each direction, so TLS and HTTP round
trips pay the RTT) and `SlowConnect` (the TCP handshake's round trip, which
the kernel completes before any user-space proxy sees the connection). The
set-up tracing and the timed request are `lab_utils.connection_trace`'s;
the figures are `lab_utils.figures.connection_reuse`'s.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..app import AppServer
from ..arms import Arm, Plan
from ..client import run_sync
from ..connection_trace import traced_stream
from ..figures.connection_reuse import plot_remote, plot_ttft
from ..metrics import percentile_stats
from ..netem import DelayProxy, delay_connects
from ..results import Results
from ..workloads import chat_specs


def plan(profile, params) -> Plan:
    """One engine, the profile's own flags: the arms below differ only in the
    client (and the app over HTTPS is a client of the same engine)."""
    return Plan("08_connection_reuse", (Arm(
        "baseline", title="the profile's engine flags (reuse is the client's choice)"),))


#: The article's pool settings (connection reuse section).
ARTICLE_LIMITS = {"max_connections": 100, "max_keepalive_connections": 20,
                  "keepalive_expiry": 30.0}
#: The client arms (not engine arms: all three talk to the plan's one engine).
ARMS: dict[str, str] = {
    "new": "new client + connection per request",
    "pooled": "one shared keep-alive pool (HTTP/1.1)",
    "http2": "one shared client, http2=True",
}


# --------------------------------------------------------------------------
# Clients per arm
# --------------------------------------------------------------------------

_PLAIN = None


def _plain_context() -> ssl.SSLContext:
    # Plain-HTTP targets never use it, but httpx builds a default context (and
    # loads the CA bundle, ~tens of ms) for every client not given one.
    global _PLAIN
    if _PLAIN is None:
        _PLAIN = ssl.create_default_context()
    return _PLAIN


def make_client(arm: str, *, ssl_context: ssl.SSLContext | None = None,
                connect_delay_s: float = 0.0, timeout_s: float = 300.0):
    """The httpx client of an arm (for `new`, the one built per request), with
    the article's limits. The SSL context is shared: building one per client
    is a cost of its own (see `client_build_cost`), not a connection's."""
    import httpx
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {sorted(ARMS)}, got {arm!r}")
    limits = httpx.Limits(max_connections=ARTICLE_LIMITS["max_connections"],
                          max_keepalive_connections=ARTICLE_LIMITS["max_keepalive_connections"],
                          keepalive_expiry=ARTICLE_LIMITS["keepalive_expiry"])
    transport = httpx.AsyncHTTPTransport(verify=ssl_context or _plain_context(),
                                         http2=arm == "http2", limits=limits, retries=0)
    if connect_delay_s:
        delay_connects(transport, connect_delay_s)
    return httpx.AsyncClient(transport=transport, timeout=timeout_s)


@dataclass
class Target:
    """Where an arm's requests go."""
    name: str
    base_url: str
    model: str
    ssl_context: ssl.SSLContext | None = None
    api_key: str | None = None
    app: AppServer | None = None      # set when the app counts connections


def engine_target(engine) -> Target:
    return Target("vLLM (HTTP, loopback)", engine.base_url, engine.model,
                  api_key=engine.api_key)


def app_target(app: AppServer, name: str | None = None) -> Target:
    scheme = "HTTPS" if app.tls else "HTTP"
    return Target(name or f"app ({scheme}, {app.server})", app.base_url, app.model,
                  app.ssl_context(), app=app)


# --------------------------------------------------------------------------
# Timed requests
# --------------------------------------------------------------------------

async def run_arm(target: Target, arm: str, n: int, concurrency: int, *, max_tokens: int = 4,
                  seed: int = 0, base_url: str | None = None, connect_delay_s: float = 0.0,
                  client=None, first_index: int = 0) -> list[dict[str, Any]]:
    """`n` streamed requests with `concurrency` in flight, all through the arm's
    client(s): `client` if given (a shared one, kept open), else a new shared
    client for `pooled`/`http2` (closed after) or one per request for `new`.
    `base_url` overrides the target's (e.g. a DelayProxy)."""
    url = (base_url or target.base_url) + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else None
    msgs = [s.messages for s in chat_specs(first_index + n, seed=seed)[first_index:]]
    rows: list[dict[str, Any]] = []
    counter = itertools.count()
    own = client is None and arm != "new"
    shared = client if client is not None else (
        make_client(arm, ssl_context=target.ssl_context, connect_delay_s=connect_delay_s)
        if own else None)

    async def worker() -> None:
        while (i := next(counter)) < n:
            body = {"model": target.model, "messages": msgs[i], "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True}
            if shared is None:
                t_build = time.perf_counter()
                async with make_client(arm, ssl_context=target.ssl_context,
                                       connect_delay_s=connect_delay_s) as new_client:
                    build_ms = (time.perf_counter() - t_build) * 1e3
                    row = await traced_stream(new_client, url, body, headers)
                row["client_build_ms"] = build_ms
            else:
                row = await traced_stream(shared, url, body, headers)
                row["client_build_ms"] = 0.0
            rows.append({"index": first_index + i, **row})

    try:
        await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    finally:
        if own:
            await shared.aclose()
    return sorted(rows, key=lambda r: r["index"])


def plan_rounds(n: int, concurrency: int, rounds: int) -> list[int]:
    """Requests per round: `n` (at least 2 x concurrency) split into up to
    `rounds` rounds of at least `concurrency` each (so every round fills the
    concurrency)."""
    n = max(n, 2 * concurrency)
    per = max(concurrency, math.ceil(n / max(1, rounds)))
    sizes = [per] * (n // per)
    if n % per:
        sizes.append(n % per)
    return sizes


async def run_interleaved(target: Target, arms: Sequence[str], n: int, concurrency: int, *,
                          rounds: int = 3, max_tokens: int = 4, seed: int = 0,
                          base_url: str | None = None, connect_delay_s: float = 0.0
                          ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """All arms at one concurrency, in rounds whose arm order rotates, so a
    busy moment on a shared machine falls on every arm alike. Each shared
    client lives across its arm's rounds. Returns the rows and, for an app
    target, the distinct client connections it accepted per arm."""
    clients = {arm: make_client(arm, ssl_context=target.ssl_context,
                                connect_delay_s=connect_delay_s)
               for arm in arms if arm != "new"}
    rows: list[dict[str, Any]] = []
    seen: dict[str, set] = {arm: set() for arm in arms}
    done = dict.fromkeys(arms, 0)
    try:
        for r, size in enumerate(plan_rounds(n, concurrency, rounds)):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                if target.app is not None:
                    target.app.reset_stats()
                got = await run_arm(target, arm, size, concurrency, max_tokens=max_tokens,
                                    seed=seed, base_url=base_url, connect_delay_s=connect_delay_s,
                                    client=clients.get(arm), first_index=done[arm])
                done[arm] += size
                rows += [{**row, "arm": arm, "round": r} for row in got]
                if target.app is not None:
                    clients_seen = target.app.stats(clients=True)["connections"]["clients"]
                    seen[arm].update(c for cs in clients_seen.values() for c in cs)
    finally:
        for c in clients.values():
            await c.aclose()
    return rows, {arm: len(s) for arm, s in seen.items()}


def sweep(targets: Sequence[Target], arms: Sequence[str] = tuple(ARMS),
          concurrencies: Sequence[int] = (1, 8), *, requests_per_level: int = 12,
          rounds: int = 12, max_tokens: int = 4, results: Results | None = None,
          progress: bool = True, seed: int = 0) -> pd.DataFrame:
    """Every target at every concurrency (see `sweep_plan`)."""
    return sweep_plan([(t, concurrencies) for t in targets], arms,
                      requests_per_level=requests_per_level, rounds=rounds,
                      max_tokens=max_tokens, results=results, progress=progress, seed=seed)


def sweep_plan(schedule: Sequence[tuple[Target, Sequence[int]]],
               arms: Sequence[str] = tuple(ARMS), *, requests_per_level: int = 12,
               rounds: int = 12, max_tokens: int = 4, results: Results | None = None,
               progress: bool = True, seed: int = 0) -> pd.DataFrame:
    """Each (target, its concurrencies), the arms interleaved at each level
    (`run_interleaved`; up to `rounds` turns each, so at concurrency 1 the arms
    alternate request by request); at least 2 x concurrency requests per arm. Counts
    connections client-side (trace) and, for the app, server-side (/stats)."""
    from tqdm.auto import tqdm
    arms = list(arms)
    frames = []
    levels = [(t, c) for t, concs in schedule for c in concs]
    for target, conc in tqdm(levels, desc="levels", disable=not progress, leave=False):
        t0 = time.perf_counter()
        rows, server = run_sync(run_interleaved(target, arms, requests_per_level, conc,
                                                rounds=rounds, max_tokens=max_tokens, seed=seed))
        frame = pd.DataFrame(rows).assign(target=target.name, concurrency=conc,
                                          duration_s=time.perf_counter() - t0)
        frame["server_connections"] = frame.arm.map(server) if target.app is not None \
            else math.nan
        frames.append(frame)
        if results is not None:
            for arm, g in frame.groupby("arm", sort=False):
                results.data.setdefault("connection_arms", {})[
                    f"{target.name}|{arm}|c{conc}"] = arm_summary(g)
            results.save()
    return pd.concat(frames, ignore_index=True)


def arm_summary(frame: pd.DataFrame) -> dict[str, Any]:
    """One arm's numbers: TTFT percentiles, set-up cost, connections counted."""
    ok = frame[frame.ok]
    out = {"requests": len(frame), "failed": int((~frame.ok).sum()),
           "connections_client": int(frame.new_connection.sum()),
           "connections_server": frame.server_connections.iloc[0]
           if "server_connections" in frame else None,
           "http_versions": sorted(set(frame.http_version.dropna()))}
    for name, stats in (("ttft_ms", percentile_stats(ok.ttft_ms, scale=1.0)),
                        ("setup_ms", percentile_stats(ok.setup_ms, scale=1.0))):
        out.update({f"{name}_{k}": v for k, v in stats.items() if k in ("median", "p90", "p99")})
    new = ok[ok.new_connection]
    out["tcp_ms_per_new_connection"] = float(new.tcp_ms.median()) if len(new) else None
    out["tls_ms_per_new_connection"] = float(new.tls_ms.median()) if len(new) else None
    return out


def summary_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per target, arm and concurrency: TTFT p50/p90/p99, mean set-up per request,
    connections opened (client trace and server count) and the HTTP version."""
    rows = []
    for (target, arm, conc), g in frame.groupby(["target", "arm", "concurrency"], sort=False):
        s = arm_summary(g)
        rows.append({"target": target, "arm": arm, "concurrency": conc, "requests": s["requests"],
                     "TTFT p50 (ms)": s["ttft_ms_median"], "TTFT p90 (ms)": s["ttft_ms_p90"],
                     "TTFT p99 (ms)": s["ttft_ms_p99"],
                     "set-up per request, mean (ms)": g[g.ok].setup_ms.mean(),
                     "TCP per new conn (ms)": s["tcp_ms_per_new_connection"],
                     "TLS per new conn (ms)": s["tls_ms_per_new_connection"],
                     "connections (client trace)": s["connections_client"],
                     "connections (server count)": s["connections_server"],
                     "HTTP": "/".join(v.replace("HTTP/", "") for v in s["http_versions"]),
                     "failed": s["failed"]})
    return pd.DataFrame(rows).set_index(["target", "arm", "concurrency"])


# --------------------------------------------------------------------------
# What each server speaks
# --------------------------------------------------------------------------

def http_versions(targets: Sequence[Target]) -> pd.DataFrame:
    """What a client with `http2=True` gets from each target, and what a client
    that insists on HTTP/2 without TLS (prior knowledge, h2c) gets."""
    import httpx

    async def probe(target: Target, http1: bool) -> dict[str, Any]:
        verify: Any = target.ssl_context or _plain_context()
        async with httpx.AsyncClient(http2=True, http1=http1, verify=verify, timeout=10) as c:
            try:
                r = await c.get(target.base_url + ("/health" if target.app else "/v1/models"))
                return {"status": r.status_code, "http_version": r.http_version}
            except Exception as exc:
                return {"status": None, "http_version": f"{type(exc).__name__}"}

    rows = []
    for target in targets:
        for http1, ask in ((True, "http2=True (ALPN offers h2, http/1.1)"),
                           (False, "HTTP/2 only (http1=False)")):
            if http1 is False and target.base_url.startswith("https"):
                continue  # over TLS the first probe already shows what ALPN picked
            rows.append({"target": target.name, "client asks for": ask,
                         **run_sync(probe(target, http1))})
    return pd.DataFrame(rows).set_index(["target", "client asks for"])


def client_build_cost(n: int = 20, cafile: str | None = None) -> pd.DataFrame:
    """What building an `httpx.AsyncClient` costs (the `new` arm builds one per
    request): with its default verification (loads the CA bundle) and with a
    prepared SSL context."""
    import httpx
    shared = ssl.create_default_context(cafile=cafile) if cafile else ssl.create_default_context()
    rows = []
    for how, kw in (("default (loads certifi's CA bundle)", {}),
                    ("verify=<prepared SSLContext>", {"verify": shared})):
        for _ in range(n):
            t0 = time.perf_counter()
            client = httpx.AsyncClient(**kw)
            rows.append({"client": how, "build_ms": (time.perf_counter() - t0) * 1e3})
            run_sync(client.aclose())
    return (pd.DataFrame(rows).groupby("client", sort=False).build_ms
            .describe(percentiles=[0.5, 0.9, 0.99])[["count", "50%", "90%", "99%"]])


# --------------------------------------------------------------------------
# A remote server, emulated
# --------------------------------------------------------------------------

def remote_sweep(target: Target, rtts_ms: Sequence[float], arms: Sequence[str] = tuple(ARMS),
                 *, n: int = 8, concurrency: int = 1, max_tokens: int = 4,
                 results: Results | None = None, progress: bool = True) -> pd.DataFrame:
    """The arms again through a `DelayProxy` of each round-trip time (plus the
    TCP handshake's RTT in `SlowConnect`). `rtt_ms` 0 is the plain loopback."""
    from tqdm.auto import tqdm
    host, port = target.base_url.split("://")[1].split(":")
    scheme = target.base_url.split("://")[0]
    frames = []
    for rtt in tqdm(list(rtts_ms), desc="RTT", disable=not progress, leave=False):
        async def go(rtt=rtt):
            async with DelayProxy(host, int(port), rtt / 2e3) as proxy:
                rows, _ = await run_interleaved(target, list(arms), n, concurrency, rounds=n,
                                                max_tokens=max_tokens,
                                                base_url=f"{scheme}://{host}:{proxy.port}",
                                                connect_delay_s=rtt / 1e3)
                return rows

        rows = run_sync(go())
        frame = pd.DataFrame(rows).assign(target=target.name, rtt_ms=rtt, concurrency=concurrency)
        frame["connections"] = frame.arm.map(frame.groupby("arm").new_connection.sum())
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True)
    if results is not None:
        results.data["remote_emulation"] = remote_table(frame).reset_index().to_dict("records")
        results.save()
    return frame


def remote_table(frame: pd.DataFrame) -> pd.DataFrame:
    """TTFT p50/p90 and set-up per request by emulated RTT and arm."""
    ok = frame[frame.ok]
    g = ok.groupby(["rtt_ms", "arm"], sort=False)
    table = pd.DataFrame({"TTFT p50 (ms)": g.ttft_ms.median(),
                          "TTFT p90 (ms)": g.ttft_ms.quantile(0.9),
                          "set-up per request, mean (ms)": g.setup_ms.mean(),
                          "connections (client trace)": g.connections.first(),
                          "requests": g.size()})
    return table


def savings(frame: pd.DataFrame, by: Sequence[str], baseline: str = "new",
            treated: Sequence[str] = ("pooled", "http2")) -> pd.DataFrame:
    """Median TTFT saved by each reused-connection arm against `baseline`."""
    med = frame[frame.ok].groupby([*by, "arm"]).ttft_ms.median().unstack("arm")
    out = pd.DataFrame(index=med.index)
    for arm in treated:
        if arm in med and baseline in med:
            out[f"{arm}: saved (ms)"] = med[baseline] - med[arm]
            out[f"{arm}: change (%)"] = (med[arm] - med[baseline]) / med[baseline] * 100
    return out


def long_generation_share(short: pd.DataFrame, long_frame: pd.DataFrame) -> pd.DataFrame:
    """How much of a request's whole time (E2E) the set-up is, for short and
    long answers: reuse saves a fixed cost, so long generations hide it."""
    rows = []
    for name, frame in (("short answers", short), ("long answers", long_frame)):
        ok = frame[frame.ok]
        for arm, g in ok.groupby("arm", sort=False):
            rows.append({"answers": name, "arm": arm, "E2E p50 (ms)": g.e2e_ms.median(),
                         "set-up per request (ms)": g.setup_ms.mean(),
                         "set-up share of E2E (%)": g.setup_ms.mean() / g.e2e_ms.median() * 100})
    return pd.DataFrame(rows).set_index(["answers", "arm"])


# --------------------------------------------------------------------------
# Explore
# --------------------------------------------------------------------------

def explore(ctx, app: AppServer, concurrency: int, rtt_ms: float, n: int = 8) -> pd.DataFrame:
    """Explore: the three arms against the TLS app at one concurrency and RTT."""
    ctx.arm("baseline")  # the app's upstream (reused, or restarted with the same flags)
    target = app_target(app)
    if rtt_ms > 0:
        frame = remote_sweep(target, [rtt_ms], n=max(n, 2 * concurrency),
                             concurrency=concurrency)
        return remote_table(frame).round(1)
    frame = sweep([target], concurrencies=[concurrency], requests_per_level=n)
    return summary_table(frame).round(1)


def tls_app(ctx, engine) -> AppServer:
    """The app in front of `engine` over HTTPS with a certificate made now:
    Hypercorn (HTTP/2 and HTTP/1.1 by ALPN) when installed, else uvicorn
    (HTTP/1.1 only; the http2 arm then falls back to HTTP/1.1, and a note
    says so)."""
    from ..app import hypercorn_available, start_app
    server = "hypercorn" if hypercorn_available() else "uvicorn"
    if server == "uvicorn":
        msg = ("hypercorn is not installed: the app is served by uvicorn (HTTP/1.1 only), so "
               "the http2 arm negotiates HTTP/1.1; pip install hypercorn==0.18.0 for HTTP/2")
        print(msg)
        ctx.results.note(msg)
    return start_app(ctx, engine, server=server, tls=True)


def long_generations(target: Target, arms: Sequence[str] = ("new", "pooled"), *, n: int = 3,
                     max_tokens: int = 64) -> pd.DataFrame:
    """A few long answers per arm, one at a time, arms interleaved."""
    rows, _ = run_sync(run_interleaved(target, list(arms), n, 1, rounds=n, max_tokens=max_tokens,
                                       seed=7))
    return pd.DataFrame(rows).assign(target=target.name, concurrency=1)


CLAIM = "connection reuse: one global httpx.AsyncClient(http2=True, 100/20 limits, 30 s)"


def findings(frame: pd.DataFrame, remote: pd.DataFrame, targets: Sequence[Target],
             top: int) -> list[dict[str, Any]]:
    """`Results.add_finding` arguments: median TTFT, new connection per request
    -> reused, on loopback to vLLM (c=1, `targets[0]`), over HTTPS to the app
    (`targets[1]`) at concurrency `top` (pooled and HTTP/2), and over the
    longest emulated RTT (`remote`); with the counted connections and set-up."""
    table = summary_table(frame)
    med = frame[frame.ok].groupby(["target", "concurrency", "arm"]).ttft_ms.median()

    def counted(target: str, conc: int) -> str:
        t = table.loc[target]
        return (", ".join(f"{arm} {t.loc[(arm, conc), 'connections (client trace)']:.0f}"
                          for arm in ARMS)
                + f" connections for {t.loc[('new', conc), 'requests']} requests")

    v, a = targets[0].name, targets[1].name
    tcp = table.loc[(v, "new", 1), "TCP per new conn (ms)"]
    tls = table.loc[(a, "new", top), "TLS per new conn (ms)"]
    out = [{"technique": "connection reuse: loopback HTTP (vLLM)",
            "metric": "TTFT median (ms), c=1, new -> pooled",
            "baseline": med[(v, 1, "new")], "treated": med[(v, 1, "pooled")],
            "mechanism": counted(v, 1) + f"; TCP connect {tcp:.2f} ms each"}]
    out += [{"technique": f"connection reuse: HTTPS app, c={top}",
             "metric": f"TTFT median (ms), new -> {arm}",
             "baseline": med[(a, top, "new")], "treated": med[(a, top, arm)],
             "mechanism": counted(a, top) + f"; TLS handshake {tls:.1f} ms each"}
            for arm in ("pooled", "http2")]
    rt = max(remote.rtt_ms)
    at = remote[remote.ok & (remote.rtt_ms == rt)]
    rmed = at.groupby("arm").ttft_ms.median()
    out.append({"technique": f"connection reuse: emulated RTT {rt:g} ms (HTTPS)",
                "metric": "TTFT median (ms), new -> pooled",
                "baseline": rmed["new"], "treated": rmed["pooled"],
                "mechanism": "a new connection pays the TCP and TLS round trips: set-up "
                             f"{at[at.arm == 'new'].setup_ms.median():.0f} ms per request; "
                             f"the pool opened {int(at[at.arm == 'pooled'].new_connection.sum())}"
                             " connection(s) in all"})
    return [{**f, "article_claim": CLAIM} for f in out]


__all__ = [
    "ARMS",
    "ARTICLE_LIMITS",
    "CLAIM",
    "Target",
    "app_target",
    "arm_summary",
    "client_build_cost",
    "engine_target",
    "explore",
    "findings",
    "http_versions",
    "long_generation_share",
    "long_generations",
    "make_client",
    "plan",
    "plan_rounds",
    "plot_remote",
    "plot_ttft",
    "remote_sweep",
    "remote_table",
    "savings",
    "summary_table",
    "sweep",
    "sweep_plan",
    "tls_app",
]
