"""`lab_utils.router`: vllm-router's life cycle against fake replicas
(tests/fake_openai.py), and where its policies really send requests, counted
by the fake replicas themselves (not by the router's own metrics, which a
separate test checks against those counts)."""
from __future__ import annotations

import os
import random
import time

import psutil
import pytest
from fake_openai import FakeOpenAI

from lab_utils.client import Client, Load, RequestSpec
from lab_utils.host import group_processes
from lab_utils.profiles import ConfigError
from lab_utils.router import RouterServer, router_argv, router_binary, router_counts
from lab_utils.server import ServerError, free_port, lab_server_processes

try:
    router_binary()
    HAVE_ROUTER = True
except ConfigError:
    HAVE_ROUTER = False
needs_router = pytest.mark.skipif(not HAVE_ROUTER, reason="vllm-router is not installed "
                                  "(pip install vllm-router==0.1.17)")


@pytest.fixture(scope="module")
def replicas():
    fakes = [FakeOpenAI().start() for _ in range(3)]
    yield fakes
    for f in fakes:
        f.stop()


@pytest.fixture
def fresh(replicas):
    for f in replicas:
        f.reset()
    return replicas


def tenant_of(request: dict) -> int:
    return int(request["body"]["messages"][0]["content"].split()[1].rstrip(":"))


def tenant_specs(order, *, keyed: bool = False) -> list[RequestSpec]:
    """One chat request per entry of `order`: tenant t's long system prompt
    (its own text from the first word on), then a question of its own; with
    `keyed`, the tenant's id in the `x-tenant-id` header (a session key)."""
    return [RequestSpec(messages=[{"role": "system", "content": f"tenant {t}: " + f"rule {t}. " * 150},
                                  {"role": "user", "content": f"question {i}"}],
                        max_tokens=4, headers={"x-tenant-id": f"tenant-{t}"} if keyed else {})
            for i, t in enumerate(order)]


def tenants_per_replica(fakes) -> list[set[int]]:
    return [{tenant_of(r) for r in f.requests} for f in fakes]


def send(router: RouterServer, specs, load=Load.sequential(), model: str = "chat"):
    run = Client(router.base_url, model).run(specs, load, label="t", progress=False)
    assert all(r.ok for r in run.records), [r.error for r in run.records if not r.ok]
    return run


def route(fakes, policy: str, specs, tmp_path, load=Load.sequential(), model: str = "chat"):
    """Send `specs` through a `policy` router in front of `fakes`; the tenants
    each fake replica saw."""
    with RouterServer([f.base_url for f in fakes], policy, log_path=tmp_path / "r.log") as router:
        send(router, specs, load, model)
    return tenants_per_replica(fakes)


def test_argv_names_every_replica_and_a_metrics_port():
    argv = router_argv(["http://a:1/", "http://b:2"], "cache_aware", port=5, prometheus_port=6,
                       binary="vllm-router", options={"cache_threshold": 0.5, "disable_retries": True,
                                                      "log_dir": None})
    assert argv == ["vllm-router", "--host", "127.0.0.1", "--port", "5", "--worker-urls",
                    "http://a:1", "http://b:2", "--policy", "cache_aware", "--prometheus-host",
                    "127.0.0.1", "--prometheus-port", "6", "--cache-threshold", "0.5",
                    "--disable-retries"]
    with pytest.raises(ConfigError, match="unknown router policy"):
        router_argv(["http://a:1"], "least_busy", port=5, prometheus_port=6, binary="x")


def test_missing_binary_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"pip install vllm-router==0\.1\.17"):
        router_binary()


def test_router_counts_sums_decisions_per_worker():
    text = ('# TYPE vllm_router_policy_decisions_total counter\n'
            'vllm_router_policy_decisions_total{policy="round_robin",worker="http://a:1"} 3\n'
            'vllm_router_policy_decisions_total{policy="cache_aware",worker="http://a:1"} 2\n'
            'vllm_router_policy_decisions_total{policy="round_robin",worker="http://b:2"} 1\n'
            '# TYPE vllm_router_requests_total counter\n'
            'vllm_router_requests_total{route="/v1/chat/completions"} 6\n')
    assert router_counts(text, ["http://a:1", "http://b:2", "http://c:3/"]) == {
        "http://a:1": 5.0, "http://b:2": 1.0, "http://c:3": 0.0}


@needs_router
def test_life_cycle_health_log_and_no_orphans(fresh, tmp_path):
    router = RouterServer([f.base_url for f in fresh[:2]], "round_robin",
                          log_path=tmp_path / "router.log")
    with router:
        assert router.alive and router.startup_s is not None
        pgid = router.proc.pid
        assert group_processes(pgid)
        assert any(pid == pgid for pid, _ in lab_server_processes(os.getpid()))  # orphan-findable
        send(router, tenant_specs([0, 1]))
        assert router.counts() == {fresh[0].base_url: 1.0, fresh[1].base_url: 1.0}
    assert not router.alive and group_processes(pgid) == []
    assert "vllm-router" in (tmp_path / "router.log").read_text().splitlines()[0]


@needs_router
def test_a_failed_start_leaves_nothing_running(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = RouterServer([dead], "round_robin", log_path=tmp_path / "router.log",
                          startup_timeout_s=3,
                          options={"worker_startup_timeout_secs": 1,
                                   "worker_startup_check_interval": 1})
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="vllm-router"):
        router.start()
    assert time.monotonic() - t0 < 30
    assert router.proc is None
    assert not [p for p in psutil.process_iter(["cmdline"]) if dead in (p.info["cmdline"] or [])]


@needs_router
def test_round_robin_alternates_whatever_the_tenant(fresh, tmp_path):
    order = [0, 0, 0, 1, 1, 1]  # same tenant back to back: round-robin still alternates
    placed = route(fresh[:2], "round_robin", tenant_specs(order), tmp_path)
    seen = sorted((r["time"], i) for i, f in enumerate(fresh[:2]) for r in f.requests)
    replicas = [i for _, i in seen]
    assert replicas in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])
    # so every replica sees both tenants' prefixes
    assert placed == [{0, 1}, {0, 1}]


@needs_router
def test_consistent_hash_keeps_each_tenant_on_one_replica(fresh, tmp_path):
    rng = random.Random(1)
    order = [rng.randrange(8) for _ in range(40)]
    placed = route(fresh, "consistent_hash", tenant_specs(order, keyed=True), tmp_path)
    assert sum(len(p) for p in placed) == len(set(order))  # no tenant on two replicas
    assert sum(1 for p in placed if p) >= 2  # 8 keys on a 3-replica ring: not all on one


@needs_router
def test_cache_aware_keeps_a_prefix_on_one_replica_and_spreads_new_ones_by_load(fresh, tmp_path):
    rng = random.Random(0)
    order = [rng.randrange(6) for _ in range(30)]
    # "hold" answers after 0.3 s, so with 4 in flight the replicas' loads differ
    placed = route(fresh, "cache_aware", tenant_specs(order), tmp_path, Load.concurrent(4), "hold")
    assert sum(len(p) for p in placed) == len(set(order))
    assert sum(1 for p in placed if p) >= 2


@needs_router
def test_cache_aware_with_a_sequential_client_uses_one_replica(fresh, tmp_path):
    """A miss goes to the least loaded replica; one request at a time leaves
    every replica idle, so the tie puts every tenant on the same one."""
    route(fresh[:2], "cache_aware", tenant_specs([0, 1, 2, 3, 0, 1]), tmp_path)
    assert sorted(len(f.requests) for f in fresh[:2]) == [0, 6]


@needs_router
def test_consistent_hash_without_a_key_sends_every_chat_to_one_replica(fresh, tmp_path):
    """vllm-router 0.1.17 hashes no chat text: without a session header every
    chat request gets the same (empty) key."""
    route(fresh, "consistent_hash", tenant_specs(range(8)), tmp_path)
    assert sorted(len(f.requests) for f in fresh) == [0, 0, 8]


def _routers_marked(mark: str) -> list[int]:
    """Live router processes (vllm-router titles itself `vllm::router`) whose
    environment carries `LAB_TEST_MARK=mark`, i.e. started under this test's run."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if (p.info["status"] != psutil.STATUS_ZOMBIE
                    and "router" in " ".join(p.info["cmdline"] or [])
                    and p.environ().get("LAB_TEST_MARK") == mark):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@needs_router
def test_ctrl_c_on_a_run_leaves_no_router_running(fresh, tmp_path):
    """Ctrl-C on `runall` while a notebook sends requests through the router
    (as 13 does): the run stops with 130 and no router outlives it."""
    import json
    import signal
    import subprocess
    import sys

    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from lab_utils.paths import REPO_ROOT
    from lab_utils.server import orphan_servers

    urls = [f.base_url for f in fresh[:2]]
    nb_dir, runs, log = tmp_path / "nbs", tmp_path / "runs", tmp_path / "router.log"
    nb_dir.mkdir()
    nb = new_notebook(cells=[
        new_code_cell("profile = 'cpu'", metadata={"tags": ["parameters"]}),
        new_code_cell(
            "from lab_utils.client import Client, Load, RequestSpec\n"
            "from lab_utils.router import RouterServer\n"
            f"with RouterServer({urls!r}, 'round_robin', log_path={str(log)!r}) as router:\n"
            "    spec = [RequestSpec(messages=[{'role': 'user', 'content': 'hi'}], max_tokens=2)]\n"
            "    while True:  # until interrupted\n"
            "        Client(router.base_url, 'chat').run(spec, Load.sequential(), label='t',\n"
            "                                            progress=False)\n")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, nb_dir / "00_route.ipynb")
    mark = f"ctrl-c-{os.getpid()}-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "lab_utils.runall", "--runs-dir", str(runs),
                             "--notebooks-dir", str(nb_dir)], cwd=REPO_ROOT,
                            env={**os.environ, "LAB_TEST_MARK": mark},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (fresh[0].requests and fresh[1].requests) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        assert fresh[0].requests and fresh[1].requests, "the router never served both replicas"
        assert _routers_marked(mark), "the router is not running mid-run"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal signals the whole group
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    status = json.loads(next(runs.glob("2*/status.json")).read_text())
    assert status["notebooks"][0]["status"] == "interrupted"
    deadline = time.monotonic() + 30
    while _routers_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _routers_marked(mark) == [], "the router outlived the interrupted run"
    assert orphan_servers() == []
    served = len(fresh[0].requests) + len(fresh[1].requests)
    time.sleep(1.0)
    assert len(fresh[0].requests) + len(fresh[1].requests) == served, "requests still arrive"
