"""vLLM's log of every engine step, read back: with
`--enable-logging-iteration-details` the server logs one line per step
(`vllm/v1/metrics/loggers.py`, `LoggingStatLogger._log_iteration_details`):
its prefill ("context") requests and tokens, decode ("generation") requests
and tokens, and the step's time. `StepLog` reads what a local server logged
during a run; `step_stats` says what those steps did (largest prefill chunk,
longest step, throughput while busy).

`vllm:iteration_tokens_total` is no substitute: vLLM adds a prompt's tokens to
it in the step that emits the first token, so a chunked prefill still shows
up there as one big "step".
"""
from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pandas as pd

#: The line vLLM logs per engine step with --enable-logging-iteration-details
#: (vllm/v1/metrics/loggers.py, LoggingStatLogger._log_iteration_details).
_ITERATION_LINE = re.compile(
    r"Iteration\((?P<step>\d+)\): (?P<ctx_requests>\d+) context requests, "
    r"(?P<ctx_tokens>\d+) context tokens, (?P<gen_requests>\d+) generation requests, "
    r"(?P<gen_tokens>\d+) generation tokens, iteration elapsed time: (?P<elapsed_ms>[\d.]+) ms")


def parse_iteration_log(text: str) -> pd.DataFrame:
    """One row per engine step: prefill ("context") requests and tokens,
    decode ("generation") requests and tokens, and the step's time in ms."""
    rows = [{k: float(v) if k == "elapsed_ms" else int(v) for k, v in m.groupdict().items()}
            for m in _ITERATION_LINE.finditer(text)]
    cols = ["step", "ctx_requests", "ctx_tokens", "gen_requests", "gen_tokens", "elapsed_ms"]
    return pd.DataFrame(rows, columns=cols)


def step_stats(steps: pd.DataFrame) -> dict[str, float]:
    """What the steps of one run say about chunking: the largest prefill chunk,
    the longest step, the longest step that also advanced running decodes, and
    the engine's throughput while busy (prompt + output tokens per second of
    step time, which the arrival schedule does not dilute)."""
    if steps.empty:
        return {"engine_steps": 0, "max_prefill_tokens_per_step": math.nan,
                "max_step_ms": math.nan, "max_mixed_step_ms": math.nan, "prefill_steps": 0,
                "busy_s": math.nan, "tokens_per_busy_s": math.nan}
    mixed = steps[(steps.ctx_tokens > 0) & (steps.gen_requests > 0)]
    busy_s = float(steps.elapsed_ms.sum()) / 1e3
    tokens = float(steps.ctx_tokens.sum() + steps.gen_tokens.sum())
    return {"engine_steps": int(len(steps)),
            "busy_s": busy_s, "tokens_per_busy_s": tokens / busy_s if busy_s else math.nan,
            "prefill_steps": int((steps.ctx_tokens > 0).sum()),
            "max_prefill_tokens_per_step": int(steps.ctx_tokens.max()),
            "max_step_ms": float(steps.elapsed_ms.max()),
            "max_mixed_step_ms": float(mixed.elapsed_ms.max()) if len(mixed) else math.nan}


class StepLog:
    """Reads what a local server logged between `start()` and `read()`."""

    def __init__(self, engine):
        server = getattr(engine, "server", None)
        self.path = Path(server.log_path) if server is not None else None
        self.offset = 0

    def start(self) -> "StepLog":
        if self.path is not None and self.path.exists():
            self.offset = self.path.stat().st_size
        return self

    def read(self, settle_s: float = 0.5) -> pd.DataFrame:
        if self.path is None or not self.path.exists():
            return parse_iteration_log("")
        time.sleep(settle_s)  # the API server logs the last steps just after the last token
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return parse_iteration_log(f.read().decode("utf-8", errors="replace"))


__all__ = ["StepLog", "parse_iteration_log", "step_stats"]
