"""Failing fast and failing clean, end to end (marked `engine`: they start
kernels, papermill and, for the interrupt test, a real engine)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lab_utils.paths import NOTEBOOKS_DIR, REPO_ROOT

pytestmark = pytest.mark.engine


def test_malformed_papermill_parameter_fails_fast_naming_the_fix(tmp_path):
    import papermill as pm
    t0 = time.perf_counter()
    with pytest.raises(pm.PapermillExecutionError) as info:
        pm.execute_notebook(str(NOTEBOOKS_DIR / "00_baseline.ipynb"), str(tmp_path / "out.ipynb"),
                            parameters={"repeats": "four", "results_dir": str(tmp_path)},
                            kernel_name="python3", cwd=str(NOTEBOOKS_DIR), progress_bar=False)
    assert "repeats='four'" in str(info.value) and "-p repeats 4" in str(info.value)
    assert time.perf_counter() - t0 < 60, "must fail in the setup cell, before any engine starts"


def test_unknown_profile_fails_fast(tmp_path):
    import papermill as pm
    with pytest.raises(pm.PapermillExecutionError, match="unknown profile 'gpuu'"):
        pm.execute_notebook(str(NOTEBOOKS_DIR / "00_baseline.ipynb"), str(tmp_path / "out.ipynb"),
                            parameters={"profile": "gpuu", "results_dir": str(tmp_path)},
                            kernel_name="python3", cwd=str(NOTEBOOKS_DIR), progress_bar=False)


def test_interrupted_run_keeps_its_results_and_the_next_run_starts_clean(tmp_path):
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "lab_utils.runall", "--only", "00", "--runs-dir", str(runs)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    # Wait until the notebook's engine is up and measuring, then Ctrl-C the whole job.
    deadline = time.monotonic() + 300
    results = None
    while time.monotonic() < deadline:
        found = [p for p in runs.glob("2*/results/00_baseline/*.jsonl")]
        if found and found[0].stat().st_size > 0:
            results = found[0]
            break
        time.sleep(1)
    assert results is not None, "the run never started measuring"
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    run_dir = results.parents[2].resolve()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["notebooks"][0]["status"] == "interrupted"
    assert results.read_text().strip(), "records measured before the interrupt are kept"
    assert (run_dir / "notebooks" / "00_baseline.ipynb").exists()
    assert (run_dir / "index.md").read_text().count("interrupted") >= 1
    from lab_utils.server import orphan_servers
    deadline = time.monotonic() + 30
    while orphan_servers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert orphan_servers() == [], "the interrupted notebook's engine outlived its kernel"
    # The next run starts cleanly in a fresh folder, and `latest` moves to it.
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook
    nb_dir = tmp_path / "nbs"
    nb_dir.mkdir()
    nb = new_notebook(cells=[new_code_cell('profile = "cpu"  # x', metadata={"tags": ["parameters"]}),
                             new_code_cell("print(profile)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, nb_dir / "00_tiny.ipynb")
    nxt = subprocess.run([sys.executable, "-m", "lab_utils.runall", "--runs-dir", str(runs),
                          "--notebooks-dir", str(nb_dir)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert nxt.returncode == 0, nxt.stdout + nxt.stderr
    latest = (runs / "latest").resolve()
    assert latest != run_dir.resolve()
    assert json.loads((latest / "status.json").read_text())["notebooks"][0]["status"] == "ok"
