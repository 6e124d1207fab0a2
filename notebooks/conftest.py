"""The notebooks under nbval (`make test`) share engines through one broker
(`lab_utils.engine_share`), as in `runall`: it starts before the first notebook
runs, with the demand the collected notebooks' smoke plans declare, and it
stops, with its engines and its URL in LAB_ENGINE_SHARE, after the last
notebook, leaving what it did in shared_engines/<first notebook>.json beside
LAB_SMOKE_RESULTS (runs/smoke/). Tests that run after the notebooks in the
same session (the second stream of tests/streams.py) are never lent an
engine, nor are the JupyterLab or papermill kernels they start."""
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
                   if _is_notebook(i)})
    results = os.environ.get("LAB_SMOKE_RESULTS", "")
    stack = contextlib.ExitStack()
    broker = stack.enter_context(shared_engines(
        target, todo, lambda p: run_params(target, p, smoke=True, results_dir=results)))
    if broker is not None and results:
        stack.callback(_record, broker, Path(results))  # runs before the broker closes
    _SHARE["stack"] = stack


def _record(broker, results: Path) -> None:
    """What this stream's broker started, lent and stopped early, and why
    (`Broker.describe`), beside the notebooks' results folder (not in it: the
    report reads every JSON there); `make run` keeps the same in status.json."""
    import json
    first = broker.demand[0][0] if broker.demand else "none"
    folder = results.parent / "shared_engines"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{first}.json").write_text(json.dumps(broker.describe(), indent=2))


def _is_notebook(item) -> bool:
    return item is not None and str(item.fspath).endswith(".ipynb")


@pytest.hookimpl(trylast=True)  # after nbval has shut the notebook's kernel down
def pytest_runtest_teardown(item, nextitem):
    if not _is_notebook(nextitem):
        _close()


def pytest_sessionfinish(session, exitstatus):
    _close()


def _close() -> None:
    if _SHARE["stack"] is not None:
        _SHARE["stack"].close()
        _SHARE["stack"] = None
