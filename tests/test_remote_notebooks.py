"""Every notebook, with its smoke parameters, on the `remote` profile against a
stand-in for a vLLM server started with default flags (tests/fake_vllm.py):
none may end in a traceback; a notebook either measures or reports
"skipped"; no finding lacks a value; the API key is written nowhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fake_vllm import FakeVLLM

from lab_utils.paths import REPO_ROOT, notebooks

pytestmark = pytest.mark.engine  # every notebook's kernel: minutes, like the engine tests

SECRET = "sk-lab-test-not-a-real-key-7f3a"


@pytest.fixture(scope="module")
def remote_run(tmp_path_factory):
    fake = FakeVLLM().start()
    runs = tmp_path_factory.mktemp("remote-runs")
    env = {**os.environ, "LAB_REMOTE_API_KEY": SECRET, "LAB_CACHE_DIR": str(runs / "cache")}
    env.pop("LAB_REMOTE_ARMS", None)
    env.pop("LAB_SMOKE", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "lab_utils.runall", "--profile", "remote", "--base-url",
             fake.base_url, "--smoke", "--runs-dir", str(runs)],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        fake.stop()
    run_dir = (runs / "latest").resolve()
    return proc, run_dir, json.loads((run_dir / "status.json").read_text()), fake


def test_no_notebook_fails_on_a_remote_server(remote_run):
    proc, run_dir, status, _ = remote_run
    failed = {nb["name"]: nb.get("error", "")[-2500:] for nb in status["notebooks"]
              if nb["status"] not in ("ok", "skipped")}
    assert not failed, "\n\n".join(f"== {k}\n{v}" for k, v in failed.items()) + proc.stdout[-2000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [nb["name"] for nb in status["notebooks"]] == [p.stem for p in notebooks()]


def test_skipped_means_nothing_measured_and_ok_means_something(remote_run):
    _, run_dir, status, _ = remote_run
    for nb in status["notebooks"]:
        data = json.loads((run_dir / "results" / f"{nb['name']}.json").read_text())
        measured = bool(data.get("arms") or data.get("findings"))
        assert (nb["status"] == "ok") == measured, (nb["name"], nb["status"], data.get("notes"))
        if nb["status"] == "skipped":
            assert nb["skipped"], nb  # says why
        for f in data.get("findings", []):
            assert isinstance(f["baseline"], (int, float)) and isinstance(f["treated"], (int, float)), f


def test_the_server_is_described_and_emulated_arms_are_labelled(remote_run):
    _, run_dir, _, fake = remote_run
    data = json.loads((run_dir / "results" / "02_prefix_caching.json").read_text())
    assert data["server"]["model"] == "fake-model"
    assert data["server"]["cache"]["enable_prefix_caching"] == "True"
    assert "emulated" in data["remote_arms"]["off"]["runs"]
    index = (run_dir / "index.md").read_text()
    assert "## Remote server" in index and "emulated" in index
    # the off arm's requests each carried a salt of their own
    salts = [r["body"].get("cache_salt") for r in fake.requests if r["body"].get("cache_salt")]
    assert salts and len(set(salts)) == len(salts)


def test_the_api_key_is_sent_but_written_nowhere(remote_run):
    _, run_dir, _, fake = remote_run
    assert any(r["authorization"] == f"Bearer {SECRET}" for r in fake.requests)
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path
