"""Session-wide check: after the tests and notebooks ran, no vLLM engine or app
process started by the lab may outlive the process that started it.

A session started with SIGINT ignored (a background job of a shell without job
control, e.g. `nohup make test &` inside a script) gets Python's Ctrl-C handler
back: the tests that interrupt a start, a run or a router send SIGINT and
expect what a terminal's Ctrl-C does, and every process they start inherits
SIGINT's default instead of "ignored"."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI
from fake_vllm import FakeVLLM

from lab_utils.profiles import load_profile
from lab_utils.server import orphan_servers

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def server():
    """A fake OpenAI-compatible streaming server (tests/fake_openai.py) per module."""
    s = FakeOpenAI().start()
    yield s
    s.stop()


@pytest.fixture
def fake(server):
    server.reset()
    return server


@pytest.fixture(scope="module")
def vllm_like():
    """A stand-in for a vLLM server started with default flags
    (tests/fake_vllm.py), per module: the `remote` profile's target."""
    s = FakeVLLM().start()
    yield s
    s.stop()


@pytest.fixture
def remote(vllm_like, monkeypatch):
    """The remote profile pointed at `vllm_like`, with no LAB_REMOTE_ARMS."""
    monkeypatch.delenv("LAB_REMOTE_ARMS", raising=False)
    return load_profile("remote", base_url=vllm_like.base_url)


@pytest.fixture
def cpu():
    """The cpu profile (the embedded default)."""
    return load_profile("cpu")


@pytest.fixture
def gpu():
    return load_profile("gpu")


@pytest.fixture
def nothing_built(monkeypatch):
    """Building the embedded model or a layer cut of it fails the test (a plan
    must name its models without building them)."""
    from lab_utils import derived_models, model

    def refuse(*a, **k):
        raise AssertionError("the plan built a model")
    monkeypatch.setattr(derived_models, "truncated_model", refuse)
    monkeypatch.setattr(model, "ensure_embedded_model", refuse)


def pytest_collection_modifyitems(session, config, items):
    """Tests marked `findings` read what the notebooks recorded: run them after
    every notebook (nbval items), whatever order the paths were given in."""
    items.sort(key=lambda item: item.get_closest_marker("findings") is not None)
    config._lab_notebooks_collected = sorted(
        {Path(str(item.fspath)).stem for item in items if str(item.fspath).endswith(".ipynb")})


@pytest.fixture(scope="session")
def smoke_results(request):
    """The folder the notebooks of this session wrote their results to
    (LAB_SMOKE_RESULTS, set by `make test`), and the notebooks that ran."""
    ran = getattr(request.config, "_lab_notebooks_collected", [])
    if not ran:  # or check a finished smoke run: LAB_FINDINGS_RESULTS=runs/latest/results
        folder = os.environ.get("LAB_FINDINGS_RESULTS", "")
        if not folder:
            pytest.skip("the notebooks did not run in this session: `make test` runs them "
                        "first (or set LAB_FINDINGS_RESULTS to a `runall --smoke` results folder)")
        return Path(folder), sorted(p.stem for p in Path(folder).glob("[0-9]*.json"))
    folder = os.environ.get("LAB_SMOKE_RESULTS", "")
    assert folder, "LAB_SMOKE_RESULTS is not set: run the notebooks through `make test`"
    return Path(folder), ran


def pytest_sessionfinish(session, exitstatus):
    deadline = time.monotonic() + 30  # kernels' servers stop on their parent's death
    while (leaks := orphan_servers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if leaks:
        import os
        import signal
        print("\nERROR: lab server processes left running: "
              + "; ".join(f"{pid} {cmd[:100]}" for pid, cmd in leaks))
        for pid, _ in leaks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        session.exitstatus = 1
