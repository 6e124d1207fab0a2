"""Files that two processes update at once (`make test` runs two pytest
processes, tests/streams.py): the lock excludes, the atomic write never trips
over the other writer's temporary file, a read-modify-write under the lock
loses no key."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from lab_utils.paths import REPO_ROOT, locked, write_atomic

_CHILD = """
import json, sys, time
from pathlib import Path
from lab_utils.paths import locked, write_atomic
path, mode, arg = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "hold":
    with locked(path):
        print("locked", flush=True)
        time.sleep(float(arg))
elif mode == "write":
    for i in range(300):
        write_atomic(path, json.dumps({"writer": arg, "i": i}))
elif mode == "add":
    for i in range(40):
        with locked(path):
            d = json.loads(path.read_text()) if path.exists() else {}
            d[f"{arg}-{i}"] = i
            write_atomic(path, json.dumps(d))
"""


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, *map(str, args)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _succeed(children: list[subprocess.Popen]) -> None:
    for c in children:
        _, err = c.communicate(timeout=60)
        assert c.returncode == 0, err


def test_the_lock_waits_for_another_process(tmp_path):
    path = tmp_path / "cache.json"
    holder = _child(path, "hold", 1.5)
    assert holder.stdout.readline().strip() == "locked"
    t0 = time.monotonic()
    with locked(path):
        waited = time.monotonic() - t0
    holder.wait(10)
    assert waited > 1.0, f"the lock was granted after {waited:.2f} s while another process held it"


def test_without_waiting_the_lock_says_another_process_holds_it(tmp_path):
    path = tmp_path / "cache.json.float32"
    holder = _child(path, "hold", 1.5)
    assert holder.stdout.readline().strip() == "locked"
    t0 = time.monotonic()
    with locked(path, wait=False) as held:
        assert held is False and time.monotonic() - t0 < 0.5
    holder.wait(10)
    with locked(path, wait=False) as held:  # free again
        assert held is True
        with locked(path, wait=False) as again:  # a second open of the lock file is excluded
            assert again is False


def test_two_processes_writing_one_file_never_fail_or_leave_temporaries(tmp_path):
    path = tmp_path / "probe.json"
    _succeed([_child(path, "write", w) for w in ("a", "b")])
    assert json.loads(path.read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]


def test_read_modify_write_under_the_lock_loses_no_key(tmp_path):
    path = tmp_path / "capacity.json"
    _succeed([_child(path, "add", w) for w in ("a", "b")])
    assert len(json.loads(path.read_text())) == 80


def test_write_atomic_replaces_the_whole_file(tmp_path: Path):
    path = tmp_path / "x" / "results.json"
    write_atomic(path, "a much longer first version")
    write_atomic(path, "short")
    assert path.read_text() == "short"
