"""Where the lab keeps things: the repository, the cache outside git, results."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATASETS_DIR = REPO_ROOT / "datasets"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
RUNS_DIR = REPO_ROOT / "runs"


def cache_dir() -> Path:
    """Model and derived-artifact cache (`LAB_CACHE_DIR`, default ~/.cache/vllm-latency-lab)."""
    env = os.environ.get("LAB_CACHE_DIR")
    base = Path(env) if env else Path.home() / ".cache" / "vllm-latency-lab"
    return base.expanduser()


def notebooks(only: list[str] | None = None, folder: Path = NOTEBOOKS_DIR) -> list[Path]:
    """The numbered notebooks in `folder`, those whose names start with one of
    `only` if given (SystemExit naming the pattern when none matches)."""
    found = sorted(Path(folder).glob("[0-9]*.ipynb"))
    if only:
        found = [p for p in found if any(p.stem.startswith(o) for o in only)]
    if not found:
        raise SystemExit(f"no notebook in {folder} matches {only or '[0-9]*.ipynb'}")
    return found
