"""Reading vLLM's server logs: what a start says about the weights and
kernels, and the root cause of a failure.

A lab server's log file may hold several starts, each opened by a `$ vllm
serve ...` line that `lab_utils.server.VLLMServer` writes; the parsers read
the latest one. ANSI colour codes are stripped first.
"""
from __future__ import annotations

import re
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
