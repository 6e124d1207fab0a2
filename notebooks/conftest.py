"""The notebooks under nbval (`make test`) share engines through one broker
(`lab_utils.engine_share`), as in `runall`: it starts before the first notebook
runs, with the demand the collected notebooks' smoke plans declare, and its
engines stop when the session ends. Tests outside this folder are never lent
one (this file's hooks run for the notebooks only)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

_SHARE: dict = {"stack": None}


@pytest.hookimpl(tryfirst=True)  # before nbval's collector starts the kernel
def pytest_runtest_setup(item):
    if _SHARE["stack"] is not None or not os.environ.get("LAB_SMOKE"):
        return
    from lab_utils.paths import NOTEBOOKS_DIR
    from lab_utils.profiles import load_profile
    from lab_utils.runall import run_params, shared_engines
    target = load_profile("cpu")
    todo = sorted({NOTEBOOKS_DIR / Path(str(i.fspath)).name for i in item.session.items
                   if str(i.fspath).endswith(".ipynb")})
    results = os.environ.get("LAB_SMOKE_RESULTS", "")
    stack = contextlib.ExitStack()
    stack.enter_context(shared_engines(
        target, todo, lambda p: run_params(target, p, smoke=True, results_dir=results)))
    _SHARE["stack"] = stack


def pytest_sessionfinish(session, exitstatus):
    if _SHARE["stack"] is not None:
        _SHARE["stack"].close()
        _SHARE["stack"] = None
