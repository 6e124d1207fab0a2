"""vLLM's own request router (`vllm-router`, a Rust binary from the PyPI wheel
pinned in requirements.txt) in front of several replicas, started and stopped
like the lab's engines.

`RouterServer` is `VLLMServer`'s process handling (its own process group,
SIGTERM when the starter dies, a log file, a clean stop of the group, stopped
at exit) with the router's command line and health check. The router serves
the OpenAI API on its port and its own Prometheus metrics on a second port
(`--prometheus-port`, 29000 unless told: the lab always picks a free one, so
two routers never collide); :func:`router_counts` reads where its policy sent
the requests.

What the policies of vllm-router 0.1.17 do (its source, `src/policies/`, and
the unit tests in tests/test_router.py against fake replicas):

- ``round_robin``: replica 0, 1, ..., N-1, 0, ... whatever the request.
- ``cache_aware``: keeps an approximate prefix tree per replica of the text
  it sent there (token ids from the replica's `/v1/chat/completions/render`
  when vLLM offers it); a request whose best prefix match exceeds
  ``--cache-threshold`` (0.3) goes to that replica; a miss goes to the least
  loaded replica (requests in flight), so a strictly sequential client, for
  which every replica is idle, puts every new prefix on the same replica.
  When the busiest replica has more than ``--balance-abs-threshold`` (64)
  requests in flight over the idlest and 1.5x as many, it balances by load
  instead.
- ``consistent_hash``: a hash ring keyed by the first of the headers
  ``x-session-id``, ``x-user-id``, ``x-tenant-id``... or the body's ``user``
  field (OpenAI's end-user id), else the whole request text: one key, one
  replica, whatever the load.
- ``power_of_two``: the less loaded of two random replicas; ``random``.
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .http import http_get
from .profiles import ConfigError
from .server import VLLMServer, free_port

#: The policies `vllm-router --help` offers for a plain (not prefill/decode) router.
POLICIES = ("round_robin", "random", "cache_aware", "power_of_two", "consistent_hash",
            "kv_aware", "sticky_least_loaded")
#: The version requirements.txt pins (its CLI and policies are described above).
PINNED = "vllm-router==0.1.17"
BINARY = "vllm-router"


def router_binary() -> str:
    """Path of the `vllm-router` executable: the one in this Python's
    environment first (the venv's bin/), else the PATH's."""
    here = Path(sys.executable).parent / BINARY
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(BINARY)
    if found:
        return found
    raise ConfigError(f"the `{BINARY}` binary is not installed in this environment: "
                      f"`{sys.executable} -m pip install {PINNED}` (requirements.txt pins it; "
                      "`make setup` installs it)")


def router_argv(worker_urls: Sequence[str], policy: str, *, port: int, prometheus_port: int,
                host: str = "127.0.0.1", binary: str | None = None,
                options: Mapping[str, Any] | None = None) -> list[str]:
    """The router's command line. `options` are more of its flags by their
    long names without dashes (e.g. ``{"cache_threshold": 0.5}``); True adds a
    bare flag."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown router policy {policy!r}; vllm-router offers {POLICIES}")
    if not worker_urls:
        raise ConfigError("a router needs at least one replica URL")
    argv = [binary or router_binary(), "--host", host, "--port", str(port),
            "--worker-urls", *[u.rstrip("/") for u in worker_urls], "--policy", policy,
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    for key, value in (options or {}).items():
        if value is False or value is None:
            continue
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


class RouterServer(VLLMServer):
    """`vllm-router` on 127.0.0.1 in front of `worker_urls`, used as a context
    manager. It answers /health once it has seen every replica healthy."""

    what = "vllm-router"
    poll_s = 0.2

    def __init__(self, worker_urls: Sequence[str], policy: str, *, log_path: str | Path,
                 port: int | None = None, prometheus_port: int | None = None,
                 startup_timeout_s: float = 60.0, host: str = "127.0.0.1",
                 options: Mapping[str, Any] | None = None, served_model_name: str = ""):
        port = port or free_port(host)
        prometheus_port = prometheus_port or free_port(host)
        if prometheus_port == port:
            raise ConfigError("the router's API and metrics ports must differ")
        self.policy, self.worker_urls = policy, [u.rstrip("/") for u in worker_urls]
        self.prometheus_port = prometheus_port
        argv = router_argv(self.worker_urls, policy, port=port, prometheus_port=prometheus_port,
                           host=host, options=options)
        # SPT_NOENV: the launcher's setproctitle would overwrite /proc/PID/environ,
        # where the lab finds its servers (and their orphans) by LAB_UTILS_SERVER_OWNER.
        super().__init__(argv, port=port, log_path=Path(log_path),
                         env={"NO_COLOR": "1", "SPT_NOENV": "1"},
                         startup_timeout_s=startup_timeout_s,
                         served_model_name=served_model_name, host=host)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.prometheus_port}/metrics"

    def metrics_text(self) -> str:
        status, body = http_get(self.metrics_url, timeout=5)
        if status != 200:
            raise ConfigError(f"the router's metrics at {self.metrics_url} answered HTTP {status}")
        return body.decode()

    def counts(self) -> dict[str, float]:
        """Requests the router's policy sent to each replica so far (by URL)."""
        return router_counts(self.metrics_text(), self.worker_urls)

    def describe(self) -> dict[str, Any]:
        return {"policy": self.policy, "command": self.command, "base_url": self.base_url,
                "metrics": self.metrics_url, "replicas": self.worker_urls,
                "log": str(self.log_path), "startup_s": self.startup_s}

    def __repr__(self) -> str:
        state = "running" if self.alive else "stopped"
        return f"<RouterServer {self.policy} {state} {self.base_url} -> {self.worker_urls}>"


#: The router's counter of its policy's choices, labelled by policy and worker.
DECISIONS = "vllm_router_policy_decisions"


def router_counts(metrics_text: str, worker_urls: Sequence[str] = ()) -> dict[str, float]:
    """Requests per replica from the router's Prometheus text
    (`vllm_router_policy_decisions_total{policy, worker}`, summed over
    policies); every URL of `worker_urls` is present, 0 if it got none."""
    out = {u.rstrip("/"): 0.0 for u in worker_urls}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != DECISIONS:
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                url = s.labels.get("worker", "").rstrip("/")
                out[url] = out.get(url, 0.0) + s.value
    return out


__all__ = ["BINARY", "DECISIONS", "PINNED", "POLICIES", "RouterServer", "router_argv",
           "router_binary", "router_counts"]
