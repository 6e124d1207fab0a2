#!/usr/bin/env python3
"""`make test` as two pytest processes side by side.

An engine start on the `cpu` profile is three processes importing vLLM and
torch one after another: about 35 s of one busy core while the other idles
(a smoke run of 04_speculative_decoding, three engine starts, kept a 2-core
machine 66% busy over its 152 s; mostly 50% during starts, 100% while
measuring). `make test` starts ~30 engines, so it runs two streams at once:

- **notebooks**: every notebook except `SECOND`'s, then the findings tests
  (tests/test_notebook_findings.py) for them, then the test files of `FIRST`
  (after the last notebook: this stream's broker has stopped);
- **tests**: `SECOND`'s notebooks, then `tests/` (the findings tests for those
  notebooks last, as tests/conftest.py orders them) except `FIRST`'s and
  `ALONE`, the browser test, which starts on the CPUs of the first stream to
  end while the other goes on (unpinned: after both streams, by itself).

Each stream is one pytest session with its own engine broker
(notebooks/conftest.py), so an engine is lent only within a stream: `SECOND`
holds notebooks that plan no engine another notebook plans
(tests/test_streams.py checks it against `runall.planned_keys`). They run
before `tests/` so that 12_checklist, late in the other stream, finds their
results. The two streams measure at the same time on one machine; the tests assert
mechanisms, never latencies (`make run` runs one notebook at a time).

Each stream runs on its own share of the CPUs (`cpu_shares`: one core each on
2 cores), its engines, kernels and clients included (children inherit the
affinity; an engine's `VLLM_CPU_OMP_THREADS_BIND` is the cores its process may
use, `cpu_tuning.all_cores`). Unpinned, an engine measuring in one stream
spins its OpenMP threads on both cores, and the other stream's engine start or
requests get a fraction of one: on a 2-core Zen 4 guest (2026-12-03) the smoke
run of 05_quantization took 198 s beside 02_prefix_caching's, 106 s pinned to
one core while the other core ran 02 (102.7 s, against 98.6 s alone with both
cores). `LAB_TEST_PIN=0` leaves both streams on every core.

Each line a stream prints is shown prefixed with its name as soon as it is
complete (a pytest line per file: per notebook, one line when it ends). The
exit status is the first failing stream's (a stream that collected nothing,
e.g. under `-k`, does not fail the run). Ctrl-C stops both cleanly; if this
process is killed, the streams get SIGTERM.

    python tests/streams.py [pytest args]      # make test passes nbval's and PYTEST_ARGS
    LAB_TEST_STREAMS=1 make test               # one pytest process, everything in order
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lab_utils.cpu_tuning import core_shares, parse_cpu_list  # noqa: E402
from lab_utils.paths import NOTEBOOKS_DIR, notebooks  # noqa: E402
from lab_utils.server import die_with_parent  # noqa: E402
from lab_utils.vllm_logs import root_cause, strip_ansi  # noqa: E402

#: Notebooks run in the `tests` stream, and test files run in the `notebooks`
#: stream after its notebooks, so that both streams end near the same time. With
#: each stream on its own core nothing evens them out: in a fresh-clone `make test`
#: at 8385346 (2-core Zen 4 guest, cache filled) the notebooks stream took 1,378 s
#: and the tests stream 1,129 s, with 01_chunked_prefill (197 s, two engines no
#: other notebook plans) in the first. At dafac9f (same guest, cache empty) the
#: notebooks stream took 1,833 s, the tests stream 1,683 s: the capability probe
#: (5 engines, ~46 s each) held both, one candidate at a time; each candidate now
#: has its own lock (`capabilities.probe`), so the tests stream probes 06's while
#: the notebooks stream probes 05's, and test_isa_emulation (90 s) moved to the
#: tests stream. test_capabilities starts its own engines (probes are never lent one).
SECOND = ("01_chunked_prefill", "06_fp8_kv_cache", "09_priority_scheduling",
          "13_replica_routing")
FINDINGS = "tests/test_notebook_findings.py"
FIRST = ("tests/test_capabilities.py",)
#: Run on CPUs of its own: JupyterLab's front end on a machine that two unpinned
#: streams kept busy twice failed to run the notebook (Run All ran no cell;
#: an Explore widget stayed "Loading widget..."), 2026-12-02, Zen 4 guest. It
#: starts on the CPUs of the first stream to end; unpinned, after both.
ALONE = "tests/test_browser.py"
NO_TESTS = 5  # pytest's exit status when nothing was collected


def streams(folder: Path = NOTEBOOKS_DIR) -> dict[str, list[str]]:
    """Each stream's pytest paths, relative to the repository."""
    found = notebooks(folder=folder)
    rel = [str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p) for p in found]
    second = [r for r, p in zip(rel, found) if p.stem in SECOND]
    first = [r for r, p in zip(rel, found) if p.stem not in SECOND]
    return {"notebooks": first + [FINDINGS, *FIRST],
            "tests": second + ["tests", *(f"--ignore={t}" for t in (*FIRST, ALONE))]}


def cpu_shares(n: int, cpus: list[int] | None = None) -> list[list[int]] | None:
    """The CPUs of each of `n` side-by-side streams (`cpu_tuning.core_shares` of
    this process's), or None (no pinning) for one stream, fewer CPUs than
    streams, or LAB_TEST_PIN=0."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if n < 2 or len(cpus) < n or os.environ.get("LAB_TEST_PIN") == "0":
        return None
    return [parse_cpu_list(share) for share in core_shares(n, cpus)]


def _start_in(cpus: list[int] | None):
    """preexec_fn of a stream: die with this process, run on `cpus`."""
    def start() -> None:  # pragma: no cover - runs in the child
        die_with_parent()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return start


def exit_status(codes: list[int]) -> int:
    """The run's status: the first failing stream's; a stream that collected
    nothing does not fail the run unless no stream collected anything."""
    failing = [c for c in codes if c not in (0, NO_TESTS)]
    if failing:
        return failing[0]
    return NO_TESTS if codes and all(c == NO_TESTS for c in codes) else 0


def _pump(name: str, proc: subprocess.Popen, lock: threading.Lock,
          kept: list[str] | None = None) -> None:
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
        if kept is not None:
            kept.append(line)


_TITLE = re.compile(r"^_{3,} (.+?) _{3,}$")
_RAISED = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Skipped|Interrupt|Timeout)\w*)"
                     r"(?::\s*(.*))?$")
#: Lines of a stream's first failure printed at the very end (`first_failure`).
DIGEST_LINES, DIGEST_WIDTH = 6, 300


def first_failure(lines: list[str]) -> list[str]:
    """The first failure in a pytest session's output, in a few lines: its
    title (a test, or a notebook's cell under nbval), the exception it ended
    in (pytest's `E` lines, or the traceback's last exception line and the
    lines of its message), and the root cause in the server log tail a
    ServerError carries. The run's summary ends with it, so that the end of
    CI's output names what broke first, not the cells that failed after it
    (an nbval cell using a name the failed one never defined)."""
    text = [strip_ansi(line).rstrip("\n") for line in lines]
    start = next((i for i, line in enumerate(text) if re.match(r"^=+ FAILURES =+$", line)), None)
    if start is None:
        return []
    titles = [i for i in range(start + 1, len(text)) if _TITLE.match(text[i])]
    if not titles:
        return []
    first = titles[0]
    end = next((i for i in titles[1:]), None) or next(
        (i for i in range(first + 1, len(text)) if re.match(r"^=+ .* =+$", text[i])), len(text))
    block = text[first + 1:end]
    out = [_TITLE.match(text[first]).group(1)]
    said = [line for line in block if line.startswith("E ") and line[1:].strip()]
    if not said:  # a notebook cell's traceback: its last exception line and what follows it
        at = max((i for i, line in enumerate(block) if _RAISED.match(line)), default=None)
        if at is not None:
            said = [line for line in block[at:] if line.strip()]
    out += [f"  {line.strip()}" for line in said[:DIGEST_LINES - 2]]
    cause = root_cause("\n".join(block[block.index(said[0]) + 1:] if said else block))
    if cause and not any(cause in line for line in out):
        out.append(f"  root cause in its log: {cause}")
    return [line[:DIGEST_WIDTH] for line in out]


def main(args: list[str], plan: dict[str, list[str]] | None = None,
         then: dict[str, list[str]] | None = None) -> int:
    """Run the streams (`plan`: name -> pytest paths; default `streams()`) and
    `then` (default: the browser test alone), whatever the streams' outcome:
    with the streams pinned, each of `then` starts on the CPUs of the first
    stream to end while the others go on; unpinned, after every stream."""
    if os.environ.get("LAB_TEST_STREAMS") == "1":
        return subprocess.call([sys.executable, "-m", "pytest", "tests", "notebooks", *args],
                               cwd=REPO)
    t0 = time.monotonic()
    plan = plan or streams()
    then = then if then is not None else {"browser": [ALONE]}
    shares = cpu_shares(len(plan))
    if shares is None:  # nothing keeps a stream off the other's CPUs: one phase after the other
        codes: list[int] = []
        for phase in (plan, then):
            status = _run(phase, [None] * len(phase), {}, args, t0) if phase else []
            if status is None:
                return 130
            codes += status
        return exit_status(codes)
    status = _run(plan, shares, then, args, t0)
    return 130 if status is None else exit_status(status)


def _run(plan: dict[str, list[str]], shares: list[list[int] | None],
         then: dict[str, list[str]], args: list[str], t0: float) -> list[int] | None:
    """Run `plan`'s pytest processes side by side, each on its share of the
    CPUs, and `then`'s one at a time on the share of the first process to end;
    their exit statuses, or None if interrupted (each got one SIGINT and was
    waited for)."""
    lock = threading.Lock()
    procs: dict[str, subprocess.Popen] = {}
    outputs: dict[str, list[str]] = {}
    on_cpus: dict[str, list[int] | None] = {}
    pumps = []
    ended: dict[str, float] = {}
    queue = list(then.items())

    def launch(name: str, paths: list[str], cpus: list[int] | None) -> None:
        on = f" (on CPU{'s' if len(cpus) > 1 else ''} {','.join(map(str, cpus))})" if cpus else ""
        print(f"[{name}] pytest {' '.join(paths)}{on}", flush=True)
        procs[name] = subprocess.Popen(
            [sys.executable, "-u", "-m", "pytest", *paths, *args], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_start_in(cpus))
        on_cpus[name] = cpus
        outputs[name] = []
        pumps.append(threading.Thread(target=_pump, args=(name, procs[name], lock, outputs[name]),
                                      daemon=True))
        pumps[-1].start()

    try:
        for (name, paths), cpus in zip(plan.items(), shares):
            launch(name, paths, cpus)
        while len(ended) < len(procs) or queue:
            for name, proc in list(procs.items()):
                if name not in ended and proc.poll() is not None:
                    ended[name] = time.monotonic() - t0
                    if queue:  # the next of `then` on the CPUs this one leaves
                        launch(*queue.pop(0), on_cpus[name])
            time.sleep(0.5)
    except KeyboardInterrupt:
        # the streams run in sessions of their own: the terminal's Ctrl-C reached
        # only this process. One SIGINT each lets pytest stop its kernels and engines.
        print("\ninterrupted: stopping the streams", flush=True)
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        return None
    finally:
        for proc in procs.values():  # SIGTERM, or this process failed: no stream outlives it
            if proc.poll() is None:
                proc.terminate()
        for t in pumps:
            t.join(timeout=5)
    for name, proc in procs.items():
        print(f"stream {name}: exit status {proc.returncode}, ended {ended[name]:.0f} s "
              "after the start", flush=True)
    for name, proc in procs.items():  # last, where the end of CI's output shows it
        digest = first_failure(outputs[name]) if proc.returncode not in (0, NO_TESTS) else []
        if digest:
            print(f"first failure in stream {name}: " + "\n".join(digest), flush=True)
    return [proc.returncode for proc in procs.values()]


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main(sys.argv[1:]))
