"""Experiments of 08_connection_reuse: the three client arms counted against
a fake upstream and the app, the rounds and the findings (no vLLM needed)."""
import pytest
from fake_openai import FakeOpenAI

from lab_utils.app import AppServer, hypercorn_available
from lab_utils.client import run_sync
from lab_utils.experiments import connection_reuse as cx


@pytest.mark.parametrize("n, c, rounds, sizes", [
    (12, 1, 3, [4, 4, 4]),
    (12, 8, 3, [8, 8]),          # at least 2 x c requests, rounds of at least c
    (64, 32, 3, [32, 32]),
    (10, 1, 3, [4, 4, 2]),
    (3, 1, 5, [1, 1, 1]),
])
def test_plan_rounds(n, c, rounds, sizes):
    assert cx.plan_rounds(n, c, rounds) == sizes


def test_make_client_rejects_unknown_arms():
    with pytest.raises(ValueError, match="arm must be one of"):
        cx.make_client("carrier-pigeon")


@pytest.fixture(scope="module")
def fake():
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def app(fake, tmp_path_factory):
    with AppServer(fake.base_url, "chat",
                   log_path=tmp_path_factory.mktemp("app") / "app.log") as server:
        yield server


def test_arms_open_the_connections_they_should(fake):
    target = cx.Target("fake", fake.base_url, "chat")
    new = run_sync(cx.run_arm(target, "new", 4, 1))
    pooled = run_sync(cx.run_arm(target, "pooled", 4, 1))
    h2 = run_sync(cx.run_arm(target, "http2", 4, 2))
    assert all(r["ok"] for r in new + pooled + h2)
    assert sum(r["new_connection"] for r in new) == 4
    assert sum(r["new_connection"] for r in pooled) == 1
    assert [r["new_connection"] for r in pooled] == [True, False, False, False]
    # No TLS, so no ALPN: http2=True still speaks HTTP/1.1 (two connections at c=2).
    assert {r["http_version"] for r in h2} == {"HTTP/1.1"}
    assert sum(r["new_connection"] for r in h2) == 2
    assert all(r["tls_ms"] == 0 for r in new)


def test_sweep_counts_connections_on_both_sides(app):
    frame = cx.sweep([cx.app_target(app)], ("new", "pooled"), (1, 3), requests_per_level=4,
                     progress=False)
    table = cx.summary_table(frame)
    for _, row in table.iterrows():
        assert row["connections (client trace)"] == row["connections (server count)"]
    assert table.loc[("app (HTTP, uvicorn)", "new", 3), "connections (client trace)"] == 6
    assert table.loc[("app (HTTP, uvicorn)", "pooled", 1), "connections (client trace)"] == 1
    assert table.loc[("app (HTTP, uvicorn)", "pooled", 3), "connections (client trace)"] == 3
    saved = cx.savings(frame, ["target", "concurrency"], treated=("pooled",))
    assert list(saved.columns) == ["pooled: saved (ms)", "pooled: change (%)"]


def test_http_versions_of_a_plain_server(fake):
    table = cx.http_versions([cx.Target("fake", fake.base_url, "chat")])
    versions = table["http_version"].tolist()
    assert versions[0] == "HTTP/1.1"            # http2=True, no TLS: HTTP/1.1
    assert versions[1] != "HTTP/2"              # h2c prior knowledge is refused


@pytest.mark.skipif(not hypercorn_available(), reason="HTTP/2 needs hypercorn (requirements.txt)")
def test_tls_arms_and_emulated_rtt(fake, tmp_path):
    with AppServer(fake.base_url, "chat", log_path=tmp_path / "app.log", server="hypercorn",
                   tls=True) as app:
        target = cx.app_target(app)
        frame = cx.sweep([target], concurrencies=(4,), requests_per_level=8, progress=False)
        table = cx.summary_table(frame)
        name = target.name
        assert table.loc[(name, "http2", 4), "HTTP"] == "2"
        assert table.loc[(name, "http2", 4), "connections (client trace)"] == 1
        assert table.loc[(name, "http2", 4), "connections (server count)"] == 1
        assert table.loc[(name, "new", 4), "connections (server count)"] == 8
        new = frame[(frame.arm == "new") & frame.ok]
        assert (new.tls_ms > 0).all() and set(new.tls_version) == {"TLSv1.3"}
        remote = cx.remote_sweep(target, [0, 60], ("new", "pooled"), n=3, progress=False)
        t = cx.remote_table(remote)
        assert t.loc[(60, "new"), "connections (client trace)"] == 3
        # A new TLS connection per request pays the TCP and the TLS round trip before
        # its request's own: set-up >= 2 RTT, TTFT >= 3 RTT. A reused one pays neither.
        # Lower bounds only: the emulated delays are floors, a busy machine only adds
        # (medians of 3 requests on a machine two test streams keep busy once came
        # out 247 ms "new" against 233 ms "pooled").
        at60 = remote[(remote.rtt_ms == 60) & remote.ok]
        new, pooled = at60[at60.arm == "new"], at60[at60.arm == "pooled"]
        assert (new.setup_ms >= 2 * 60 * 0.95).all() and (new.ttft_ms >= 3 * 60 * 0.95).all()
        reused = pooled[~pooled.new_connection]
        assert len(reused) >= 1 and (reused.setup_ms == 0).all()
        assert (reused.ttft_ms >= 60 * 0.95).all()


def test_plan_is_the_one_baseline_engine():
    from lab_utils.profiles import load_profile
    plan = cx.plan(load_profile("cpu"), {})
    assert plan.names == ["baseline"] and plan.problems() == []
    assert not plan.baseline.flags and plan.baseline.role is None


def _rows(target, conc, arm, ttfts, opened, **per_request):
    """One row per request of an arm; `opened` says which opened a connection."""
    return [{"target": target, "concurrency": conc, "arm": arm, "ok": True, "ttft_ms": t,
             "new_connection": o, "http_version": "HTTP/1.1",
             **{k: v[i] for k, v in per_request.items()},
             **{k: 0.0 for k in ("tcp_ms", "tls_ms", "setup_ms") if k not in per_request}}
            for i, (t, o) in enumerate(zip(ttfts, opened))]


def test_findings_compare_new_connections_with_reuse(tmp_path):
    import pandas as pd

    from lab_utils.results import Results
    vllm, app = cx.Target("vLLM", "http://v", "m"), cx.Target("app", "https://a", "m")
    frame = pd.DataFrame(
        _rows("vLLM", 1, "new", [100, 110], [True, True], tcp_ms=[0.5, 0.7])
        + _rows("vLLM", 1, "pooled", [90, 96], [True, False])
        + _rows("vLLM", 1, "http2", [91, 95], [True, False])
        + _rows("app", 4, "new", [200, 220, 240, 260], [True] * 4, tls_ms=[5, 6, 7, 8])
        + _rows("app", 4, "pooled", [150, 160, 170, 180], [True, True, False, False])
        + _rows("app", 4, "http2", [140, 150, 160, 170], [True, False, False, False]))
    remote = pd.DataFrame(
        _rows("app", 1, "new", [400, 420], [True, True], setup_ms=[205, 207], rtt_ms=[100, 100])
        + _rows("app", 1, "pooled", [200, 210], [True, False], rtt_ms=[100, 100])
        + _rows("app", 1, "new", [50, 60], [True, True], rtt_ms=[0, 0])
        + _rows("app", 1, "pooled", [40, 45], [True, False], rtt_ms=[0, 0]))
    failed = _rows("app", 1, "pooled", [1], [True], rtt_ms=[100])[0] | {"ok": False}
    remote = pd.concat([remote, pd.DataFrame([failed])], ignore_index=True)
    found = cx.findings(frame, remote, [vllm, app], top=4)
    loopback, pooled, http2, far = found
    assert (loopback["baseline"], loopback["treated"]) == (105, 93)
    assert loopback["mechanism"] == ("new 2, pooled 1, http2 1 connections for 2 requests; "
                                     "TCP connect 0.60 ms each")
    assert pooled["technique"] == "connection reuse: HTTPS app, c=4"
    assert (pooled["baseline"], pooled["treated"]) == (230, 165)
    assert (http2["baseline"], http2["treated"]) == (230, 155)
    assert http2["metric"] == "TTFT median (ms), new -> http2"
    assert http2["mechanism"] == ("new 4, pooled 2, http2 1 connections for 4 requests; "
                                  "TLS handshake 6.5 ms each")
    assert far["technique"] == "connection reuse: emulated RTT 100 ms (HTTPS)"
    assert (far["baseline"], far["treated"]) == (410, 205)
    assert "set-up 206 ms per request; the pool opened 1 connection(s) in all" in far["mechanism"]
    assert {f["article_claim"] for f in found} == {cx.CLAIM}
    assert len(Results("08_connection_reuse", tmp_path).add_findings(found)) == 4
