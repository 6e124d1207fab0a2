"""Smoke parameters: each notebook's smallest parameter set that still runs
every section and shows its mechanism, kept in one place
(`notebooks/smoke_parameters.toml`).

They are applied two ways:
- `python -m lab_utils.runall --smoke` passes them to papermill (explicit
  `-p` values still win);
- with `LAB_SMOKE=1` in the environment (as `make test` runs nbval),
  `lab.setup` replaces the notebook's parameters with them after checking
  the ones it was given, and with `LAB_SMOKE_RESULTS=DIR` a notebook left at
  its default `results_dir` writes there, where the findings tests read.
"""
from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .paths import NOTEBOOKS_DIR
from .profiles import ConfigError

SMOKE_FILE = NOTEBOOKS_DIR / "smoke_parameters.toml"
ENV_FLAG = "LAB_SMOKE"
ENV_RESULTS = "LAB_SMOKE_RESULTS"


def all_smoke_parameters(path: Path = SMOKE_FILE) -> dict[str, dict[str, Any]]:
    """{notebook name: {parameter: value}} from the smoke file."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"no smoke parameter file at {path}") from None


def smoke_parameters(notebook: str, path: Path = SMOKE_FILE) -> dict[str, Any]:
    """The smoke set of `notebook` (e.g. "02_prefix_caching")."""
    table = all_smoke_parameters(path)
    if notebook not in table:
        raise ConfigError(f"{path} has no [\"{notebook}\"] table: add the notebook's smoke "
                          "parameters there")
    return dict(table[notebook])


def smoke_requested() -> bool:
    return os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true", "yes")


def apply(notebook: str, defaults: Mapping[str, Any], params: dict[str, Any],
          namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    """Under LAB_SMOKE=1, replace `params` (and the notebook's globals
    `namespace`) with the notebook's smoke set; returns what changed."""
    if not smoke_requested():
        return {}
    changed = smoke_parameters(notebook)
    results = os.environ.get(ENV_RESULTS, "")
    if results and params.get("results_dir") == defaults.get("results_dir"):
        changed["results_dir"] = results
    params.update(changed)
    if namespace is not None:
        namespace.update(changed)
    return changed
