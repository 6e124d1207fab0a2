"""The kernel's side of engines shared across a run's notebooks
(`lab_utils.engine_share`): the broker's URL in `LAB_ENGINE_SHARE`, `acquire`
an engine of an exact command line from it, and `SharedServer`, which a
notebook uses like the `VLLMServer` it would have started and whose `stop()`
gives the engine back."""
from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.request import Request, urlopen

from .errors import ServerError
from .http import http_get
from .profiles import display_command

SHARE_ENV = "LAB_ENGINE_SHARE"
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


def config_key(command: str) -> str:
    """An engine's configuration: its command line without the port (a new
    one every start)."""
    return re.sub(r"--port \d+ ?", "", command).strip()


def key_of(argv: Sequence[str], env: Mapping[str, str] | None) -> str:
    return config_key(display_command(list(argv), dict(env or {})))


class _Leader:
    """The shared server's process-group leader, seen from a kernel that did
    not start it (`pid`, `poll()` like a Popen)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        import psutil
        return None if psutil.pid_exists(self.pid) else 0


class ServerView:
    """What the lab reads of a server it talks to, started here or lent: its
    URL (`host`, `port`), its command line (`argv`, `env`), its log's tail."""
    host: str
    port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> str:
        """Copy-pasteable `vllm serve ...` equivalent of the exact argv."""
        return display_command(self.argv, self.env)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class SharedServer(ServerView):
    """A server the run's broker lent this kernel: what a `VLLMServer` offers the
    lab (base_url, command, log, startup_s, proc.pid, alive, stop), where
    `stop()` gives it back. `startup_s` is None when the server was already
    running (no start in this notebook); `reused_from` names the notebook that
    started it."""

    what = "vLLM"

    def __init__(self, broker_url: str, argv: list[str], env: Mapping[str, str], lease: dict,
                 served_model_name: str = ""):
        self.broker_url = broker_url
        self.key = lease["key"]
        self.port, self.host = int(lease["port"]), lease["host"]
        self.argv, self.env = list(argv), dict(env)
        if "--port" in self.argv:  # a lent server listens where it was started
            self.argv[self.argv.index("--port") + 1] = str(self.port)
        self.log_path = Path(lease["log_path"])
        self.reused = bool(lease["reused"])
        self.startup_s = None if self.reused else lease["startup_s"]
        self.started_at = None if self.reused else lease.get("started_at")
        self.reused_from = lease["first_notebook"] if self.reused else None
        self.proc: _Leader | None = _Leader(int(lease["pid"]))
        self.served_model_name = served_model_name

    @property
    def alive(self) -> bool:
        if self.proc is None:
            return False
        with contextlib.suppress(OSError, ValueError):
            return http_get(self.base_url + "/health", timeout=2)[0] == 200
        return False

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc is None:
            return
        self.proc = None
        with contextlib.suppress(OSError):
            _call(self.broker_url, "/release", {"key": self.key, "port": self.port})

    def __repr__(self) -> str:
        how = f"lent, started by {self.reused_from}" if self.reused else "lent"
        return f"<SharedServer {how} {self.base_url}: {self.command}>"


def _call(broker_url: str, path: str, body: dict, timeout: float = 600) -> dict:
    req = Request(broker_url + path, data=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except OSError as exc:
        body_text = getattr(exc, "read", lambda: b"")()
        with contextlib.suppress(ValueError):
            detail = json.loads(body_text or b"{}").get("error")
            if detail:
                raise ServerError(detail) from None
        raise


def broker_url() -> str:
    return os.environ.get(SHARE_ENV, "")


def acquire(argv: list[str], env: Mapping[str, str], log_path: Path, *, notebook: str,
            startup_timeout_s: float, served_model_name: str = "") -> SharedServer:
    """The engine of this exact command line from the run's broker (started or
    lent); a start that fails raises the broker's ServerError (the log tail)."""
    url = broker_url()
    lease = _call(url, "/acquire", {"argv": list(argv), "env": dict(env),
                                    "log_path": str(log_path), "notebook": notebook,
                                    "startup_timeout_s": startup_timeout_s,
                                    "served_model_name": served_model_name},
                  timeout=startup_timeout_s + 120)
    return SharedServer(url, argv, env, lease, served_model_name)
