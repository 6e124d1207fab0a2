"""Start, share and stop real vLLM OpenAI-compatible servers.

`VLLMServer` is one server subprocess: its exact command line, its log file, a
health wait with a timeout, and a clean stop of its whole process group (also
on Ctrl-C, on kernel exit, and when the server dies while starting).
`EnginePool` hands out engines by flags, so identical flags within a notebook
reuse one running server, and `RemoteEngine` stands for a server the lab did
not start.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arms import engine_key
from .counters import cache_config
# ServerError lives in .errors so that counters and http raise it without
# importing this module; `from lab_utils.server import ServerError` still works.
from .engine_lease import ServerView
from .errors import ServerError
from .host import free_memory_fraction, group_processes
from .http import http_get
from .paths import REPO_ROOT
from .profiles import ConfigError, Profile, engine_argv, flag_items

_RUNNING: set[VLLMServer] = set()


class ArmUnavailable(RuntimeError):
    """A remote target has no server for the flags an arm needs."""


#: Set in every server's environment (inherited by its engine-core children) to
#: the pid of the process that started it, so leftovers can be found exactly.
OWNER_ENV = "LAB_UTILS_SERVER_OWNER"


def lab_server_processes(owner: int | None = None) -> list[tuple[int, str]]:
    """(pid, command) of live processes started by lab_utils (optionally by `owner`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        for item in environ:
            if item.startswith(OWNER_ENV.encode() + b"="):
                if owner is None or item.split(b"=", 1)[1] == str(owner).encode():
                    found.append((int(entry.name), cmd.strip()))
                break
    return found


def orphan_servers() -> list[tuple[int, str]]:
    """lab_utils server processes whose starting process is gone (leaks)."""
    out = []
    for pid, cmd in lab_server_processes():
        try:
            owner = next(item.split(b"=", 1)[1] for item in
                         Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                         if item.startswith(OWNER_ENV.encode() + b"="))
        except (OSError, StopIteration):
            continue
        if not Path(f"/proc/{int(owner)}").exists():
            out.append((pid, cmd))
    return out


#: The lowest port `free_port` picks (below the kernel's ephemeral range).
PICK_LOW = 20000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (`ip_local_port_range`): where bind()
    to port 0 and an outgoing connection's source port come from."""
    try:
        low, high = map(int, _EPHEMERAL.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server that binds it seconds later (vLLM, after
    its imports). Picked at random below the ephemeral range, each pick
    checked by a bind, so that no outgoing connection takes it as its source
    port meanwhile (make test's other stream did); a port the kernel gives
    bind(0) when that range leaves under 1,000 ports below it."""
    low, _ = ephemeral_ports()
    if low - PICK_LOW >= 1000:
        pick = random.SystemRandom()
        for _ in range(64):
            port = pick.randrange(PICK_LOW, low)
            if not port_in_use(port, host):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: Ports an engine start tries, each picked free, before it gives up.
PORT_ATTEMPTS = 3
#: LAB_START_AHEAD=0: never start a notebook's next engine beside the one asked
#: for; =1: also on one CPU (`EnginePool.starts_side_by_side`).
START_AHEAD_ENV = "LAB_START_AHEAD"
#: No engine starts ahead while less than this share of the machine's memory is
#: available (one idle engine of the cpu profile holds ~3.2 GiB: cpu.toml).
AHEAD_MIN_FREE = 0.4


class PortInUse(ConfigError):
    """The server's port was taken before it started, or before it bound it."""


#: How a server's log says its port was taken: Python's OSError (vLLM binds its
#: socket in `create_server_socket` after its imports), Rust's (vllm-router).
PORT_TAKEN = re.compile(r"\[Errno 98\]|[Aa]ddress already in use|os error 98")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Runs in the child before exec: new process group, and SIGTERM when the
    process that started it dies (so even a killed kernel leaves no server)."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VLLMServer(ServerView):
    """One `vllm serve` subprocess on 127.0.0.1, used as a context manager."""

    def __init__(self, argv: list[str], *, port: int, log_path: Path,
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 240,
                 served_model_name: str = "", host: str = "127.0.0.1"):
        self.argv = list(argv)
        self.port = port
        self.host = host
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.served_model_name = served_model_name
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        #: time.time() at the launch: starts that overlapped count once in a
        #: run's budget (`report.engine_budget`)
        self.started_at: float | None = None
        self._t0 = 0.0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> VLLMServer:
        """Start the server and wait until it is healthy (`launch`, then
        `wait_ready`)."""
        if self.alive:
            return self
        self.launch()
        return self.wait_ready()

    def launch(self) -> VLLMServer:
        """Start the process without waiting for it (PortInUse when the port is
        taken). Several servers launched before any is waited for start side by
        side (`EnginePool.get(ahead=...)`). The thread that launches it must
        outlive it: PR_SET_PDEATHSIG stops the server when that thread ends."""
        if self.alive:
            return self
        if port_in_use(self.port, self.host):
            raise PortInUse(f"port {self.port} on {self.host} is already in use: stop what "
                              "holds it or let the lab pick a free port (port=None)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        path = self.env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))  # e.g. LAB_CPU_ISA's shim
        env = {**os.environ, **self.env, OWNER_ENV: str(os.getpid()),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), path]))}
        log = open(self.log_path, "ab")
        log.write(f"$ {self.command}\n".encode())
        log.flush()
        self._t0 = time.perf_counter()
        self.started_at = time.time()
        self.startup_s = None
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     preexec_fn=die_with_parent)
        log.close()
        _RUNNING.add(self)
        return self

    def wait_ready(self) -> VLLMServer:
        """Wait until a launched server is healthy; `startup_s` is the time
        from its launch. A server that dies or stays unhealthy is stopped and
        raises ServerError (with its log's last lines), as does Ctrl-C."""
        if self.proc is None:
            raise ServerError(f"{self.what} was not launched: {self.command}")
        if self.startup_s is not None:
            return self
        try:
            self._wait_healthy()
        except BaseException:  # KeyboardInterrupt included: never leave it running
            self.stop()
            raise
        self.startup_s = time.perf_counter() - self._t0
        return self

    #: How the server is named in errors, and how often its health is polled.
    what, poll_s = "vLLM", 0.5

    def _healthy(self) -> bool:
        status, _ = http_get(self.base_url + "/health", timeout=2)
        return status == 200

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                exited = (f"{self.what} exited with code {self.proc.returncode} while "
                          f"starting.\ncommand: {self.command}\nlog: {self.log_path}\n"
                          f"--- last lines ---\n{self.log_tail()}")
                if self._lost_its_port():
                    raise PortInUse(f"port {self.port} was taken after the launch: {exited}")
                raise ServerError(exited)
            with contextlib.suppress(OSError, ValueError):  # URLError is an OSError
                if self._healthy():
                    return
            time.sleep(self.poll_s)
        raise ServerError(f"{self.what} was not healthy after {self.startup_timeout_s:.0f} s.\n"
                          f"command: {self.command}\nlog: {self.log_path}\n"
                          f"--- last lines ---\n{self.log_tail()}")

    def _lost_its_port(self) -> bool:
        """Whether the latest start's log ends in a failed bind of its port
        (`PORT_TAKEN`): another process took the port between the launch's
        check and the server's own bind, seconds of imports later."""
        from .vllm_logs import latest_start
        try:
            text = latest_start(self.log_path.read_text(errors="replace"))
        except OSError:
            return False
        return bool(PORT_TAKEN.search("\n".join(text.splitlines()[-40:])))

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `timeout_s`."""
        proc, self.proc = self.proc, None
        _RUNNING.discard(self)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # The engine core (and multiprocessing's resource tracker) are children
        # in the same group: make sure they are gone too before returning.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive else "stopped"
        return f"<VLLMServer {state} {self.base_url}: {self.command}>"


def stop_all() -> None:
    """Stop every server this process started (atexit and SIGTERM run it)."""
    for server in list(_RUNNING):
        server.stop(timeout_s=10)


atexit.register(stop_all)


def _install_sigterm_handler() -> None:
    # A kernel shut down by SIGTERM would skip atexit; turn it into SystemExit.
    with contextlib.suppress(ValueError):  # not in the main thread
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


# --------------------------------------------------------------------------
# Engines: what notebooks use
# --------------------------------------------------------------------------

@dataclass
class Engine:
    """A server the experiments talk to: a local VLLMServer or a remote URL."""
    profile: Profile
    flags: dict[str, Any]
    base_url: str
    model: str                       # the name requests must use
    model_path: str = ""             # local model folder or hub id ("" when remote)
    server: VLLMServer | None = None
    api_key: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    role: str | None = None          # another model of the profile (e.g. "awq")
    arm: str | None = None           # the notebook plan's arm it serves (lab_utils.arms)
    #: A remote arm's setting emulated per request (lab_utils.remote), and
    #: what a reader must know of how the remote server serves this arm.
    emulation: Any = None
    remote_notes: list[str] = field(default_factory=list)
    #: The engine (its label, or its arm's name) this one started side by side
    #: with (`EnginePool.get(ahead=...)`), None when it started alone.
    started_beside: str | None = None

    @property
    def command(self) -> str:
        if self.server is not None:
            return self.server.command
        how = f"; {self.emulation.name} per request" if self.emulation else ""
        return f"(remote server at {self.base_url}{how})"

    def request_fields(self) -> dict[str, Any]:
        """Fields every request to this engine carries (a new set per request):
        the remote emulation's, e.g. a unique `cache_salt`; {} otherwise."""
        return self.emulation.request_fields() if self.emulation else {}

    @property
    def label(self) -> str:
        return flags_label({**self.flags, **({"model_role": self.role} if self.role else {})})

    def describe(self) -> dict[str, Any]:
        """The engine for the results file; `binding` is the thread binding vLLM
        applied, read from a local server's log (None when remote); `shared`
        when the run's broker lent it (`lab_utils.engine_share`)."""
        from .engine_lease import DEV_MODE
        from .machine import parse_engine_binding
        binding = None
        if self.server is not None:
            binding = {}
            with contextlib.suppress(OSError):
                binding = parse_engine_binding(self.server.log_path.read_text(errors="replace"))
        return {"label": self.label, "flags": self.flags, "command": self.command,
                "base_url": self.base_url, "model": self.model,
                "startup_s": self.server.startup_s if self.server else None,
                "started_at": getattr(self.server, "started_at", None) if self.server else None,
                **({"started_beside": self.started_beside} if self.started_beside else {}),
                "log": str(self.server.log_path) if self.server else None,
                "binding": binding,
                **({"shared": {"reused_from": self.server.reused_from,
                               "env_added": dict(DEV_MODE)}}
                   if getattr(self.server, "broker_url", None) else {}),
                **({"emulated": self.emulation.what} if self.emulation else {}),
                **({"remote_notes": self.remote_notes} if self.remote_notes else {}),
                **self.info}


def flags_label(flags: Mapping[str, Any]) -> str:
    """Canonical text for a flag set: 'baseline' or 'k=v,k2=v2' (sorted)."""
    return engine_key(flags=flags)


def _server_model_name(base_url: str, api_key: str | None) -> str:
    status, body = http_get(base_url + "/v1/models", api_key=api_key, timeout=10)
    if status != 200:
        raise ServerError(f"{base_url}/v1/models answered HTTP {status}: {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


def start_on_a_free_port(server_on: Callable[[int], VLLMServer], port: int,
                         start: Callable[[VLLMServer], Any] | None = None) -> VLLMServer:
    """Start `server_on(port)`; when that port was taken since it was picked
    (PortInUse: at the launch, or before the server bound it), another free
    one, `PORT_ATTEMPTS` tries in all. A port is
    picked before the flags are checked (the first check reads vLLM's options
    in a subprocess, seconds) and a run's broker may stop idle engines before
    it starts one: another process may take the port meanwhile (make test's
    other stream once did, as the source port of a connection). `start` runs
    the start (default: `server.start()`; the broker's runs on its one thread)."""
    for attempt in range(PORT_ATTEMPTS):
        server = server_on(port)
        try:
            server.start() if start is None else start(server)
            return server
        except PortInUse:
            if attempt == PORT_ATTEMPTS - 1:
                raise
            port = free_port()
    raise AssertionError("unreachable")


@dataclass
class _Pending:
    """A start under way (`EnginePool._begin`): `finish()` waits for the
    server and gives its Engine; `abandon()` stops it whenever it is up."""
    finish: Callable[[], Engine]
    abandon: Callable[[], None]


class EnginePool:
    """Hands out engines by flags; identical flags reuse one running server.

    At most `keep` local servers run at once (2 cores cannot host more without
    distorting the measurements): asking for new flags stops the oldest.
    """

    def __init__(self, profile: Profile, log_dir: str | Path = "logs", keep: int = 1):
        self.profile = profile
        self.log_dir = Path(log_dir)
        self.keep = max(1, int(keep))
        #: In a run with a broker (`lab_utils.engine_share`), local engines come
        #: from it, shared with the run's other notebooks; False: this pool
        #: starts its own (a new process that has served nothing).
        self.shared = True
        self._engines: dict[str, Engine] = {}
        #: engines started ahead of their turn, not asked for yet
        self._ahead: set[str] = set()
        #: every engine key this pool started: none starts ahead after that
        self._begun: set[str] = set()
        self._starts = 0
        self._server_info = None
        _install_sigterm_handler()

    def server_info(self):
        """What the remote target is (`lab_utils.remote.read_server`), read once."""
        if self._server_info is None:
            from .remote import read_server
            self._server_info = read_server(self.profile.base_url, self.profile.api_key)
        return self._server_info

    def get(self, role: str | None = None, *, env: Mapping[str, str] | None = None,
            knobs: Any = None, ahead: Sequence[tuple] | None = None,
            **flags: Any) -> Engine:
        """The engine for these technique flags (started if needed).

        `role` picks another model of the profile (e.g. 'small', 'awq');
        `env` adds environment variables for this engine only (e.g.
        VLLM_CPU_OMP_THREADS_BIND), on top of the profile's [env]. On a remote
        target, `knobs` (a set of flag names, or the notebook's Plan) are the
        flags the notebook compares: an arm setting one the server does not
        tell is unavailable (`lab_utils.remote.place`); None: every flag given.

        `ahead` lists (role, flags, env) of the engines the notebook asks for
        next, in order: where this one must start and `starts_side_by_side()`,
        the first of them that has not started yet starts beside it and waits
        until asked for (`_start_together`)."""
        env = {str(k): str(v) for k, v in (env or {}).items()}
        label = {**flags, **({"model_role": role} if role else {}),
                 **{f"env:{k}": v for k, v in env.items()}}
        key = engine_key(role, flags, env)
        engine = self._engines.get(key)
        if engine is not None and (engine.server is None or engine.server.alive):
            if key in self._ahead:  # its turn: now it counts against `keep`
                self._ahead.discard(key)
                self._make_room(self.keep - 1, keep_key=key)
            return engine
        self._ahead.discard(key)
        if self.profile.is_remote:
            engine = self._remote(key, label, role, env, flags, knobs)
        else:
            nxt = self._ahead_of(key, ahead)
            self._begun.add(key)
            engine = (self._start_together(key, role, flags, env, nxt) if nxt else
                      self._start(key, role, flags, env))
            engine.role = role
        self._engines[key] = engine
        return engine

    def _ahead_of(self, key: str, ahead: Sequence[tuple] | None) -> list[tuple]:
        """(key, role, flags, env) of each of `ahead` ((role, flags, env) of the
        engines the notebook asks for next, in order) that may start now beside
        `key`: side by side allowed here, nothing already waiting ahead, at
        least AHEAD_MIN_FREE of the memory available, and that engine never
        started before in this pool (asked for again, it starts in its turn)."""
        if not ahead or self._ahead or not self.starts_side_by_side():
            return []
        if free_memory_fraction() < AHEAD_MIN_FREE:  # an idle engine holds its memory
            return []
        out = []
        for role, flags, env in ahead:
            env = {str(k): str(v) for k, v in (env or {}).items()}
            a_key = engine_key(role, flags, env)
            if (a_key == key or a_key in self._engines or a_key in self._begun
                    or a_key in [o[0] for o in out]):
                continue
            out.append((a_key, role, dict(flags), env))
        return out

    def _remote(self, key: str, label: dict[str, Any], role: str | None,
                env: Mapping[str, str], flags: Mapping[str, Any], knobs: Any = None) -> Engine:
        """A remote arm: on the server mapped to it in LAB_REMOTE_ARMS, else on
        the target itself where it runs as the server is or emulated per
        request (`lab_utils.remote.place`), else ArmUnavailable naming why."""
        from .arms import Arm
        from .remote import Placement, mapped_arms, place
        p = self.profile
        arms = mapped_arms()
        if label and key in arms:
            url = arms[key]
            model = p.served_model_name or _server_model_name(url, p.api_key)
            return Engine(p, dict(label), url, model, api_key=p.api_key,
                          remote_notes=[f"mapped in LAB_REMOTE_ARMS to {url}"],
                          info={"cache_config": cache_config(url, p.api_key)})
        if role is not None:  # another model: never the target's own, whatever it is
            rest = {k: v for k, v in label.items() if k != "model_role"}
            with_flags = f" with {flags_to_cli(p, rest)}" if rest else ""
            raise ArmUnavailable(
                f"it serves another model (role {role!r}) than the remote server's. Start a "
                f"vLLM server of that model{with_flags} and map it: {remote_arms_hint(key)}")
        info = self.server_info()
        if knobs is None:
            knobs = set(flags) | {f"env:{k}" for k in env}
        placed = place(Arm("remote", flags=dict(flags), role=role, env=dict(env)), knobs, info)
        if not isinstance(placed, Placement):
            raise ArmUnavailable(
                f"{placed}. Start a server with {flags_to_cli(p, label)} and map it: "
                f"{remote_arms_hint(key)}")
        model = p.served_model_name or info.model
        return Engine(p, dict(label), placed.base_url, model, api_key=p.api_key,
                      emulation=placed.emulation, remote_notes=placed.notes,
                      info={"cache_config": info.cache})

    def _start(self, key: str, role: str | None, flags: dict[str, Any],
               env: Mapping[str, str] | None = None) -> Engine:
        self._make_room(self.keep - 1)
        return self._begin(role, flags, env).finish()

    def _make_room(self, others: int, keep_key: str = "") -> None:
        """Stop the oldest running engines until at most `others` run besides
        `keep_key`; an engine started ahead and not yet asked for is not
        counted and keeps running."""
        running = [k for k, e in self._engines.items() if e.server and e.server.alive
                   and k != keep_key and k not in self._ahead]
        while len(running) > max(0, others):
            self._engines.pop(running.pop(0)).server.stop()

    def _begin(self, role: str | None, flags: dict[str, Any],
               env: Mapping[str, str] | None = None, threads=None) -> _Pending:
        """Start an engine's server without waiting for it (`_Pending.finish`
        waits and gives its Engine). A local server is launched here, on this
        thread (`VLLMServer.launch`); the run's broker starts one in its own
        process, through `threads` (an executor) when given, else when
        `finish` is called."""
        p = self.profile
        model_path = p.model_for(role)
        from . import engine_lease

        def command(port: int) -> tuple[list[str], Path]:
            argv = engine_argv(p, flags, port=port, model=model_path)
            digest = hashlib.sha1(" ".join(argv[4:]).encode()).hexdigest()[:8]
            self._starts += 1  # a fresh start with the same flags gets its own log
            return argv, self.log_dir / f"vllm-{self._starts:02d}-{digest}.log"

        def engine(server) -> Engine:
            return Engine(p, dict(flags), server.base_url, p.served_model_name or model_path,
                          model_path=model_path, server=server, role=role,
                          info={"cache_config": cache_config(server.base_url)})

        if self.shared and engine_lease.broker_url():
            # the broker starts (or lends) it; a start there moves off a taken port
            argv, log_path = command(free_port())

            def acquire():
                return engine_lease.acquire(argv, p.server_env(env, flags), log_path,
                                            notebook=self.log_dir.name,
                                            startup_timeout_s=p.startup_timeout_s,
                                            served_model_name=p.served_model_name)
            if threads is None:
                return _Pending(lambda: engine(acquire()), lambda: None)
            future = threads.submit(acquire)

            def give_back(f) -> None:  # the broker's lease, once it comes
                if not f.cancelled() and f.exception() is None:
                    f.result().stop()
            return _Pending(lambda: engine(future.result()),
                            lambda: future.add_done_callback(give_back))

        def server_on(port: int) -> VLLMServer:
            argv, log_path = command(port)
            return VLLMServer(argv, port=port, log_path=log_path, env=p.server_env(env, flags),
                              startup_timeout_s=p.startup_timeout_s,
                              served_model_name=p.served_model_name)
        launched = [start_on_a_free_port(server_on, free_port(), start=lambda s: s.launch())]

        def ready() -> VLLMServer:
            try:
                return launched[0].wait_ready()
            except PortInUse:  # taken after the launch, before vLLM bound it: again elsewhere
                launched[0] = start_on_a_free_port(server_on, free_port())
                return launched[0]
        return _Pending(lambda: engine(ready()), lambda: launched[0].stop())

    def starts_side_by_side(self) -> bool:
        """Whether this pool may start an engine ahead of its turn, beside the
        one asked for (`get(ahead=...)`): local engines of a `cpu` profile on 2
        or more CPUs, where a start keeps about one core busy (the imports of
        vLLM's processes, one after another) and an idle engine costs little.
        Never on a GPU, where each engine takes most of its memory. The
        environment decides first: LAB_START_AHEAD=0 never, =1 on any
        number of CPUs."""
        if self.profile.is_remote or self.profile.device != "cpu":
            return False
        forced = os.environ.get(START_AHEAD_ENV, "")
        return forced == "1" or (forced != "0" and len(os.sched_getaffinity(0)) >= 2)

    def _start_together(self, key: str, role: str | None, flags: dict[str, Any],
                        env: Mapping[str, str] | None, ahead: list[tuple]) -> Engine:
        """The engine asked for, started side by side with the first of
        `ahead` ((key, role, flags, env) of those the notebook asks for next),
        and with the second too when the run's broker lent the one asked for
        (no start of its own: two starts at a time still). Each started ahead
        then waits, idle and not counted against `keep`, until asked for. A
        start ahead that fails is dropped: asked for later, that engine starts
        again alone and fails there, as it would have."""
        from concurrent.futures import ThreadPoolExecutor
        self._make_room(self.keep - 1)
        threads = ThreadPoolExecutor(2, thread_name_prefix="lab-engine-start")
        began: list[tuple[str, _Pending]] = []
        done: list[tuple[str, Engine]] = []

        def begin(spec: tuple) -> None:
            a_key, a_role, a_flags, a_env = spec
            self._begun.add(a_key)
            with contextlib.suppress(Exception):  # e.g. its model cannot be built
                began.append((a_key, self._begin(a_role, a_flags, a_env, threads)))

        def collect() -> None:
            while began:
                a_key, pending = began.pop(0)
                try:
                    done.append((a_key, pending.finish()))
                except Exception:
                    pass  # it starts again, alone, when asked for
                except BaseException:  # Ctrl-C: nothing left starting
                    for _, rest in began:
                        rest.abandon()
                    began.clear()
                    raise

        try:
            first = self._begin(role, flags, env, threads)
            begin(ahead[0])
            try:
                engine = first.finish()
            except Exception:
                with contextlib.suppress(Exception, KeyboardInterrupt):
                    collect()  # they may still serve: kept for their turn
                raise
            except BaseException:
                first.abandon()
                for _, pending in began:
                    pending.abandon()
                raise
            if engine.server is not None and engine.server.startup_s is None and ahead[1:]:
                begin(ahead[1])  # lent at once: another start beside the first one ahead
            try:
                collect()
            except BaseException:
                engine.server.stop()
                raise
        finally:
            threads.shutdown(wait=False)
            for a_key, other in done:
                self._engines[a_key] = other
                self._ahead.add(a_key)
        started = ([(key, engine)] if engine.server is None or engine.server.startup_s is not None
                   else []) + done   # a lent engine started nothing
        for k, e in started:
            e.started_beside = next((o for o, _ in started if o != k), None)
        return engine

    def close(self) -> None:
        for engine in self._engines.values():
            if engine.server:
                engine.server.stop()
        self._engines.clear()
        self._ahead.clear()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remote_arms_hint(key: str) -> str:
    """The shell assignment that maps the arm `key` to a server of its own."""
    import shlex
    return "LAB_REMOTE_ARMS=" + shlex.quote(json.dumps({key: "http://HOST:PORT"}))


def flags_to_cli(profile: Profile, flags: Mapping[str, Any]) -> str:
    import shlex

    from .profiles import flags_to_args
    env = {k[4:]: v for k, v in flags.items() if k.startswith("env:")}
    cli = shlex.join(flags_to_args(flag_items(
        profile, {k: v for k, v in flags.items() if not k.startswith("env:")})))
    return " ".join([*(f"{k}={shlex.quote(str(v))}" for k, v in env.items()), cli])
