"""Reading vLLM's server logs: what a start says about the weights and
kernels, its milestones and what it logged once serving, the KV capacity
line, and the root cause of a failure.

A lab server's log file may hold several starts, each opened by a `$ vllm
serve ...` line that `lab_utils.server.VLLMServer` writes; the parsers read
the latest one. ANSI colour codes are stripped first.
"""
from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Sequence
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def latest_start(text: str) -> str:
    """The part of a lab server log written by its latest start (a restart
    appends to the same file after its own `$ command` line), without colours."""
    text = strip_ansi(text)
    starts = [m.start() for m in re.finditer(r"^\$ ", text, flags=re.MULTILINE)]
    return text[starts[-1]:] if starts else text


_LOG_PATTERNS = {
    "checkpoint_gib": re.compile(r"Checkpoint size: ([\d.]+) GiB"),
    "model_loading_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "loading_weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "kv_cache_tokens": re.compile(r"KV cache size: ([\d,]+) tokens"),
    "quantization": re.compile(r"\bquantization=([\w-]+)"),
    "dtype": re.compile(r"\bdtype=torch\.(\w+)"),
}
_KERNEL = re.compile(r"(?:Selected|Using) (\w+Kernel)\b(?: for (\S+))?")


def parse_server_log(text: str) -> dict[str, Any]:
    """What vLLM's log of the latest start says about the weights: checkpoint
    size, "Model loading took X GiB" (GPU runners only), load time, KV cache
    tokens, the quantization method and dtype, and the linear kernels chosen."""
    text = latest_start(text)
    out: dict[str, Any] = {}
    for key, pattern in _LOG_PATTERNS.items():
        m = pattern.search(text)
        if m:
            v = m.group(1).replace(",", "")
            out[key] = v if key in ("quantization", "dtype") else float(v)
    kernels = []
    for m in _KERNEL.finditer(text):
        k = m.group(1) + (f" ({m.group(2)})" if m.group(2) else "")
        if k not in kernels:
            kernels.append(k)
    out["kernels"] = kernels
    if "kv_cache_tokens" in out:
        out["kv_cache_tokens"] = int(out["kv_cache_tokens"])
    return out


_ROOT = re.compile(r"(?:^|\] )(\w+(?:Error|Exception)): (.+)$")


def root_cause(log_text: str) -> str:
    """The first exception message in a server log (a traceback's last line,
    or an ERROR record) that is not vLLM's generic "Engine core initialization
    failed" wrapper; warnings that merely mention an error are skipped."""
    for line in strip_ansi(log_text).splitlines():
        if "WARNING" in line:
            continue
        m = _ROOT.search(line)
        if m and "initialization failed" not in m.group(2) and "root cause" not in m.group(2):
            return f"{m.group(1)}: {m.group(2).strip()}"[:300]
    return ""


_KV_LOG = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")
_CONC_LOG = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def parse_kv_log(text: str) -> dict[str, Any]:
    """The last KV-capacity line of a vLLM server log ("CPU KV cache size: 23,296
    tokens, Maximum concurrency for 4,096 tokens per request: 5.69x"; the GPU
    build says "GPU KV cache size")."""
    out: dict[str, Any] = {}
    sizes = _KV_LOG.findall(text or "")
    if sizes:
        out["log_device"], out["log_kv_tokens"] = sizes[-1][0], int(sizes[-1][1].replace(",", ""))
    conc = _CONC_LOG.findall(text or "")
    if conc:
        out["log_concurrency_at_tokens"] = int(conc[-1][0].replace(",", ""))
        out["log_max_concurrency"] = float(conc[-1][1])
    return out


_STAMP = re.compile(r"\b(\d\d-\d\d \d\d:\d\d:\d\d)\b")

#: (event, pattern, group holding the duration vLLM reports itself, if any)
STARTUP_EVENTS = (
    ("API server process logging", r"non-default args", None),
    ("engine core process up", r"Initializing a V1 LLM engine", None),
    ("model load started", r"Starting to load model", None),
    ("weights loaded", r"Loading weights took ([\d.]+) seconds", 1),
    ("KV cache allocated", r"KV cache size: ([\d,]+) tokens", None),
    ("engine ready (profile, KV cache, warm-up)",
     r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", 1),
    ("chat template inspected", r"Detected the chat template content format", None),
    ("HTTP server listening", r"Starting vLLM server on", None),
)


def startup_events(log_text: str, launched_at: _dt.datetime | None = None):
    """What vLLM logs while it starts, one row per milestone (a DataFrame): the
    log time, seconds since launch (or since the first time-stamped line) and
    the duration vLLM reports itself. Log stamps have one-second resolution."""
    import pandas as pd
    text = latest_start(log_text)
    first = None
    rows = []
    for line in text.splitlines():
        m = _STAMP.search(line)
        if not m:
            continue
        first = first or m.group(1)
        for event, pattern, group in STARTUP_EVENTS:
            hit = re.search(pattern, line)
            if hit and not any(r["event"] == event for r in rows):
                reported = float(hit.group(group)) if group else math.nan
                rows.append({"event": event, "log_time": m.group(1), "reported_s": reported})
    frame = pd.DataFrame(rows, columns=["event", "log_time", "reported_s"])
    if frame.empty:
        return frame.assign(since_launch_s=pd.Series(dtype=float))
    year = (launched_at or _dt.datetime.now()).year
    times = pd.to_datetime(f"{year}-" + frame.log_time, format="%Y-%m-%d %H:%M:%S")
    origin = pd.Timestamp(launched_at.replace(microsecond=0)) if launched_at else \
        pd.to_datetime(f"{year}-{first}", format="%Y-%m-%d %H:%M:%S")
    frame.insert(2, "since_launch_s", (times - origin).dt.total_seconds())
    return frame


#: `startup_events` milestones -> the phase of a start that ends there (the
#: first phase starts at launch).
STARTUP_PHASES = (("API server process logging", "API server imports"),
                  ("engine core process up", "engine core process start"),
                  ("model load started", "worker process start"),
                  ("weights loaded", "weights"),
                  ("engine ready (profile, KV cache, warm-up)", "KV cache and init"),
                  ("HTTP server listening", "API server ready"))


def startup_phases(log_text: str, launched_at=None) -> dict[str, float]:
    """Seconds of each phase of the latest start in `log_text`, from launch
    (`launched_at`; else from vLLM's first stamped line): the gap between one
    milestone and the one before it (vLLM stamps lines to the second, so +-1 s),
    or where vLLM reports a duration itself (weights, init engine), that one.
    A phase whose milestone is not in the log is left out."""
    ev = startup_events(log_text, launched_at)
    at = dict(zip(ev.event, ev.since_launch_s))
    reported = dict(zip(ev.event, ev.reported_s))
    out, last = {}, 0.0
    for event, name in STARTUP_PHASES:
        if event not in at:
            continue
        r = reported.get(event)
        out[name] = float(at[event] - last) if r is None or math.isnan(r) else float(r)
        last = float(at[event])
    return out


def log_after_startup(log_text: str,
                      skip: Sequence[str] = ("GET /metrics", "GET /health")) -> list[str]:
    """The lines the latest start logged once it served (minus scrapes/polls):
    what vLLM says about the first requests."""
    lines = latest_start(log_text).splitlines()
    cut = next((i for i, line in enumerate(lines) if "Application startup complete" in line), None)
    after = lines[cut + 1:] if cut is not None else []
    return [line for line in after if not any(s in line for s in skip)]
