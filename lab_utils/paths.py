"""Where the lab keeps things: the repository, the cache outside git, results."""
from __future__ import annotations

import contextlib
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


# --------------------------------------------------------------------------
# Files that several processes write: `make test` runs two pytest processes at
# once (tests/streams.py), and either may probe, measure or build first.
# --------------------------------------------------------------------------

@contextlib.contextmanager
def locked(path: Path, wait: bool = True):
    """Hold an exclusive lock beside `path` (`<path>.lock`, flock) while the
    block runs: a read-modify-write of a file other processes also update.
    Yields True; with `wait=False` it yields False at once, holding nothing,
    when another process (or another open of the lock file) holds it."""
    import fcntl
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file of this process, renamed
    over it: readers see the old file or the new one, never half of one, and
    two writers never move each other's temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def publish_dir(tmp: Path, target: Path, ready) -> Path:
    """Move a folder built in `tmp` to `target`, replacing what is there (a
    stale or half-built folder, or the one a rebuild replaces); if another
    process publishes between the two steps, keep its folder when
    `ready(target)` and drop ours. A build writes into `partial_dir(target)`
    and ends with this."""
    import shutil
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
        if not ready(target):
            raise
    return target


def partial_dir(target: Path) -> Path:
    """A fresh folder beside `target` that only this process builds into."""
    import shutil
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp
