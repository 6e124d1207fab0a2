"""A remote target: what the server is, read from its own endpoints, and
which of a notebook's arms it can serve, as it is or emulated per request.

The remote profile launches nothing, so an arm's engine flags cannot be set;
but several of them can be read off the server, and one can be emulated on it:

    info = read_server("http://host:8000")      # /v1/models, /version, /metrics
    print(info.describe())
    placed = place(arm, plan, info)             # Placement, or a str: why not

- **What the server is**: the served model and its `max_model_len`
  (`/v1/models`), the vLLM version (`/version`), the KV cache's block size,
  dtype, size and whether prefix caching is on (`vllm:cache_config_info`),
  whether it drafts speculatively (the `vllm:spec_decode_*` families); and,
  from a server started with `VLLM_SERVER_DEV_MODE=1`, its whole engine
  config (`/server_info`): the scheduler's chunked-prefill setting and
  budget, `max_num_seqs`, its scheduling policy, the speculative config.
  Without that, those are not readable from outside (vLLM 0.32 accepts a
  request's `priority` on an FCFS server and ignores it, so not even the
  policy can be probed by a request).
- **An arm runs on the server** when every flag the server tells matches; a
  flag the server does not tell (the chunked-prefill budget, `max_num_seqs`)
  is taken as the server has it, with a note, unless it is a knob the
  notebook compares (then the arm is skipped: its value is unknown).
- **Emulated per request**: prefix caching off on a server that has it on
  (a unique `cache_salt` per request, which vLLM mixes into the block
  hashes, so no request can hit another's blocks: its hit counter must stay
  0, which the notebooks read); first-come-first-served on a priority server
  (every request at the same priority 0); `max_num_seqs` and the scheduling
  policy, where the server does not tell them, by the client's own queue (at
  most that many requests in flight, the rest waiting in arrival or priority
  order: `admission.ClientQueue`). An emulated arm is labelled so.
- Anything else is skipped with the reason, or runs on another server mapped
  with `LAB_REMOTE_ARMS` (`lab_utils.server.EnginePool`).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .arms import ROLE, Arm, Plan
from .http import http_get

def mapped_arms() -> dict[str, str]:
    """LAB_REMOTE_ARMS: {arm key: base URL of the server started for that arm}."""
    return {k: v.rstrip("/") for k, v in
            json.loads(os.environ.get("LAB_REMOTE_ARMS", "{}") or "{}").items()}


#: Engine flags read from /server_info's scheduler_config (dev-mode servers).
SCHEDULER_FLAGS = {"enable_chunked_prefill": "enable_chunked_prefill",
                   "max_num_batched_tokens": "max_num_batched_tokens",
                   "max_num_seqs": "max_num_seqs", "scheduling_policy": "policy",
                   "long_prefill_token_threshold": "long_prefill_token_threshold"}

#: vLLM's own value of a knob an arm leaves out (the arm relies on it).
VLLM_DEFAULTS = {"scheduling_policy": "fcfs", "enable_prefix_caching": True,
                 "speculative_config": None, "kv_cache_dtype": "auto",
                 "long_prefill_token_threshold": 0, "enable_chunked_prefill": True}

#: Flags that only make a local server log more: a remote arm runs without
#: them, and what reads that log says so.
OBSERVABILITY = {
    "enable_logging_iteration_details": "the engine-step log is read from local servers only",
    "enable_prompt_tokens_details": "cached-token counts come only if the server sends them",
}


@dataclass
class ServerInfo:
    """What a running OpenAI-compatible vLLM server says it is."""
    base_url: str
    model: str = ""
    max_model_len: int | None = None
    vllm_version: str | None = None
    cache: dict[str, str] = field(default_factory=dict)   # vllm:cache_config_info labels
    spec_decode: bool | None = None      # None: the server exports no vLLM metrics
    config: dict[str, Any] = field(default_factory=dict)  # /server_info's vllm_config (dev mode)
    families: int = 0                    # metric families in /metrics

    @property
    def prefix_caching(self) -> bool | None:
        value = self.cache.get("enable_prefix_caching")
        return None if value is None else value.lower() == "true"

    @property
    def block_size(self) -> int | None:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return int(self.cache["block_size"])
        return None

    @property
    def kv_cache_dtype(self) -> str | None:
        return self.cache.get("cache_dtype")

    def known(self) -> dict[str, Any]:
        """Engine flags (vLLM's names) whose value the server told."""
        out: dict[str, Any] = {}
        sched = self.config.get("scheduler_config") or {}
        for flag, key in SCHEDULER_FLAGS.items():
            if sched.get(key) is not None:
                out[flag] = sched[key]
        if "speculative_config" in self.config:
            spec = self.config["speculative_config"]
            out["speculative_config"] = spec or None
        if self.prefix_caching is not None:
            out["enable_prefix_caching"] = self.prefix_caching
        if self.block_size is not None:
            out["block_size"] = self.block_size
        if self.kv_cache_dtype is not None:
            out["kv_cache_dtype"] = self.kv_cache_dtype
        if self.max_model_len is not None:
            out["max_model_len"] = self.max_model_len
        if self.spec_decode is False:
            out.setdefault("speculative_config", None)
        return out

    def describe(self) -> str:
        def say(value: Any, unknown: str = "not told") -> str:
            return unknown if value is None else str(value)
        spec = {None: "not told", True: "on", False: "off"}[self.spec_decode]
        caching = {None: "not told", True: "on", False: "off"}[self.prefix_caching]
        blocks = self.cache.get("num_gpu_blocks")
        known = self.known()
        text = (f"server {self.base_url}: model {self.model or '?'} (vLLM "
                f"{say(self.vllm_version)}), max_model_len {say(self.max_model_len)}, "
                f"prefix caching {caching}, block size {say(self.block_size)}, KV dtype "
                f"{say(self.kv_cache_dtype)}, KV blocks {say(blocks)}, speculative decoding "
                f"{spec}")
        told = [f"{f} {known[f]}" for f in SCHEDULER_FLAGS if f in known]
        if told:
            return text + "; from /server_info: " + ", ".join(told)
        return (text + "; not readable from outside (start the server with "
                "VLLM_SERVER_DEV_MODE=1 for its /server_info): " + ", ".join(SCHEDULER_FLAGS))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_server(base_url: str, api_key: str | None = None) -> ServerInfo:
    """Read what the server at `base_url` is (see the module's docstring).
    Only /v1/models must answer; the rest is left unknown where it fails."""
    from .counters import cache_config_labels, scrape_families
    from .errors import ServerError
    base_url = base_url.rstrip("/")
    info = ServerInfo(base_url)
    try:
        status, body = http_get(base_url + "/v1/models", timeout=10, api_key=api_key)
    except OSError as exc:
        raise ServerError(f"cannot reach the remote server at {base_url}: {exc}. Is it "
                          "running? (give its URL as base_url or LAB_REMOTE_URL)") from exc
    if status != 200:
        hint = " (set LAB_REMOTE_API_KEY)" if status in (401, 403) else ""
        raise ServerError(f"{base_url}/v1/models answered HTTP {status}{hint}: {body[:200]!r}")
    first = json.loads(body)["data"][0]
    info.model = first.get("id", "")
    info.max_model_len = first.get("max_model_len")
    with contextlib.suppress(OSError, ValueError, KeyError):
        status, body = http_get(base_url + "/version", timeout=5, api_key=api_key)
        if status == 200:
            info.vllm_version = json.loads(body).get("version")
    with contextlib.suppress(Exception):
        families = scrape_families(base_url, api_key=api_key)
        info.families = len(families)
        names = {f.name for f in families}
        if any(n.startswith("vllm:") for n in names):
            info.spec_decode = any(n.startswith("vllm:spec_decode") for n in names)
        info.cache = cache_config_labels(families)
    # a busy engine may answer slowly: under two test streams on 2 cores this read came back empty twice
    with contextlib.suppress(OSError, ValueError, AttributeError):
        status, body = http_get(base_url + "/server_info?config_format=json", timeout=30,
                                api_key=api_key)
        if status == 200:
            config = json.loads(body).get("vllm_config")
            if isinstance(config, dict):
                info.config = config
    return info


# --------------------------------------------------------------------------
# Which arms a server can serve
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Emulation:
    """A setting emulated on a server that runs another: per request (fields
    added to each request body) or by the client's own queue (`slots` in
    flight, in arrival or priority order: `admission.ClientQueue`)."""
    name: str
    what: str                      # the sentence a reader sees
    slots: int = 0                 # > 0: the client queues past this many in flight
    by_priority: bool = False
    parts: tuple = ()              # several emulations at once (`combined`)
    sets: Mapping[str, Any] = field(default_factory=dict)  # the flag values it stands in for

    def request_fields(self) -> dict[str, Any]:
        """Fields to add to one request body (called once per request)."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.request_fields())
        if self.name == "cache_salt":
            out["cache_salt"] = f"lab-{os.getpid()}-{next(_SALTS)}"
        elif self.name == "same_priority":
            out["priority"] = 0
        return out

    def client_queue(self):
        """A fresh client-side queue for one run (None without slots)."""
        from .admission import ClientQueue
        return ClientQueue(self.slots, self.by_priority) if self.slots else None


def combined(emulations: list[Emulation]) -> Emulation | None:
    if len(emulations) <= 1:
        return emulations[0] if emulations else None
    queue = next((e for e in emulations if e.slots), None)
    return Emulation("+".join(e.name for e in emulations), "; ".join(e.what for e in emulations),
                     slots=queue.slots if queue else 0,
                     by_priority=queue.by_priority if queue else False,
                     parts=tuple(e for e in emulations if not e.slots),
                     sets={k: v for e in emulations for k, v in e.sets.items()})


def client_queue_emulation(slots: int, policy: str) -> Emulation:
    order = ("lowest priority value first" if policy == "priority" else "in arrival order")
    return Emulation(
        "client_queue", f"max_num_seqs={slots} and scheduling_policy={policy}, emulated by the "
        f"client: at most {slots} requests in flight, the rest wait in the client's queue, "
        f"{order} (the server's own slots and policy are not readable; no preemption)",
        slots=int(slots), by_priority=policy == "priority",
        sets={"max_num_seqs": int(slots), "scheduling_policy": policy})


_SALTS = itertools.count()

#: (flag, the arm's value, the server's value) -> the emulation.
EMULATIONS = {
    ("enable_prefix_caching", False, True): Emulation(
        "cache_salt", "prefix caching off, emulated: a unique cache_salt per request (vLLM "
        "salts the block hashes with it), so no request hits another's cached blocks",
        sets={"enable_prefix_caching": False}),
    ("scheduling_policy", "fcfs", "priority"): Emulation(
        "same_priority", "first-come-first-served, emulated on a priority server: every "
        "request at priority 0, so arrival order decides", sets={"scheduling_policy": "fcfs"}),
}


@dataclass
class Placement:
    """Where a remote arm runs: the server's URL, an emulation or none, and notes."""
    base_url: str
    emulation: Emulation | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "emulated" if self.emulation else "as the server runs"


def plan_knobs(plan: Plan | None) -> set[str]:
    """Every flag some arm of `plan` is compared in."""
    from .arms import _knob_set
    out: set[str] = set()
    for a in (plan.arms if plan is not None else ()):
        out |= _knob_set(a.knob)
    return out


def place(arm: Arm, knobs: set[str] | Plan | None, info: ServerInfo) -> Placement | str:
    """Where `arm` runs on the server `info` describes, or why it cannot.
    `knobs` are the flags the notebook compares (a plan: `plan_knobs`); an
    arm that sets one the server does not tell is skipped."""
    knobs = plan_knobs(knobs) if isinstance(knobs, Plan) or knobs is None else set(knobs)
    if arm.role is not None:
        return (f"it serves another model (role {arm.role!r}); the remote server serves "
                f"{info.model!r}")
    notes: list[str] = []
    emulations: list[Emulation] = []
    for name, value in arm.env.items():
        key = f"env:{name}"
        if key in knobs:
            return f"it sets {name}={value} in the server's environment"
        notes.append(f"{name}={value} (server environment) is the server's own")
    known = info.known()
    # A compared knob the arm leaves out is vLLM's default, which it relies on.
    implicit = {k: VLLM_DEFAULTS[k] for k in knobs if k in VLLM_DEFAULTS and k not in arm.flags}
    wanted = {**implicit, **arm.flags}
    # The engine's admission (how many run at once, in which order) that the
    # server does not tell, or runs otherwise: the client's own queue does it.
    slots = arm.flags.get("max_num_seqs")
    if slots and known.get("max_num_seqs") != slots:
        policy = str(wanted.get("scheduling_policy", "fcfs")).lower()
        emulations.append(client_queue_emulation(int(slots), policy))
        wanted.pop("max_num_seqs")
        wanted.pop("scheduling_policy", None)
    for flag, value in sorted(wanted.items()):
        if flag == ROLE:
            continue
        asked = (f"it relies on vLLM's default {flag}={_plain(value)!r}" if flag in implicit
                 else f"it needs {flag}={_plain(value)!r}")
        if flag in OBSERVABILITY:
            notes.append(f"without {flag}: {OBSERVABILITY[flag]}")
            continue
        if flag in known:
            have = known[flag]
            if _same(flag, value, have):
                continue
            emul = EMULATIONS.get((flag, _plain(value), _plain(have)))
            if emul is not None:
                emulations.append(emul)
                continue
            if flag == "max_model_len" and isinstance(have, int) and have >= int(value):
                notes.append(f"max_model_len {have} (the server's; {value} asked)")
                continue
            if flag not in knobs and flag not in implicit and flag != "max_model_len":
                # a setting the arms compared share: theirs is the server's
                notes.append(f"{flag} is the server's {_plain(have)!r} ({_plain(value)!r} asked)")
                continue
            return f"{asked}; the server runs {flag}={_plain(have)!r}"
        if flag in implicit:
            notes.append(f"the server's {flag} is not readable: taken to be vLLM's default "
                         f"{_plain(value)!r}")
        elif flag in knobs:
            return (f"it sets {flag}={_plain(value)!r}, a knob this notebook compares, and the "
                    f"server does not tell its own {flag}")
        else:
            notes.append(f"{flag} is the server's own ({_plain(value)!r} asked; not readable)")
    emulation = combined(emulations)
    if emulation is not None:
        notes.insert(0, emulation.what)
    return Placement(info.base_url, emulation, notes)


def _plain(value: Any) -> Any:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return value.lower() if isinstance(value, str) else value


def _same(flag: str, value: Any, have: Any) -> bool:
    if flag == "speculative_config":
        return not value and have is None
    return _plain(value) == _plain(have)


def describe_placements(placed: Mapping[str, Placement | str]) -> str:
    lines = []
    for name, p in placed.items():
        if isinstance(p, str):
            lines.append(f"  {name}: skipped: {p}")
        else:
            extra = f" ({'; '.join(p.notes)})" if p.notes else ""
            lines.append(f"  {name}: {p.label}{extra}")
    return "\n".join(lines)


__all__ = ["EMULATIONS", "mapped_arms", "client_queue_emulation", "combined", "OBSERVABILITY", "Emulation", "Placement", "ServerInfo",
           "describe_placements", "place", "plan_knobs", "read_server"]
