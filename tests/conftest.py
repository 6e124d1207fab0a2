"""Session-wide check: after the tests and notebooks ran, no vLLM engine or app
process started by the lab may outlive the process that started it."""
from __future__ import annotations

import time

import pytest
from fake_openai import FakeOpenAI

from lab_utils.profiles import load_profile
from lab_utils.server import orphan_servers


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


@pytest.fixture
def cpu():
    """The cpu profile (the embedded default)."""
    return load_profile("cpu")


@pytest.fixture
def gpu():
    return load_profile("gpu")


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
