"""How long a run will take, from the earlier runs of the same notebooks on this machine.

Machines differ 2-4x in engine speed (an AVX2-only CPU against an AVX-512 one),
so no fixed figure tells a user how long `make run` takes on theirs. Every run
folder's `status.json` records what it ran on (`key`: the profile, the machine
fingerprint of `lab_utils.machine`, smoke or full parameters, any explicit
parameters) and each notebook's seconds. A new run with the same key reads them
back: each notebook's time in the newest earlier run where it finished ok is its
estimate, printed before it starts ("~110 s last time"), and the sum of the
remaining ones says how much of the run is left. A notebook never run that way
on this machine has none, and the run's total then says how many it covers.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def key(profile: str, base_url: str, smoke: bool, parameters: Mapping[str, Any] | None,
        machine: str | None) -> dict[str, Any]:
    """What makes two runs' notebook times comparable: the same target (profile
    and, on `remote`, the server), the same machine (`machine.fingerprint()`,
    None on a remote target: the server's speed is not this machine's), the same
    parameter set."""
    return json.loads(json.dumps(  # as status.json gives it back (tuples as lists)
        {"profile": profile, "base_url": base_url, "smoke": bool(smoke),
         "parameters": dict(parameters or {}), "machine": machine}, default=str))


def previous_seconds(runs_dir: Path, want: Mapping[str, Any], exclude: Path | None = None
                     ) -> dict[str, tuple[float, str]]:
    """Each notebook's seconds in the newest run under `runs_dir` (other than
    `exclude`, the run in progress) whose status matches `want` (`key`) and
    where that notebook finished "ok", with that run's folder name."""
    found: dict[str, tuple[float, str]] = {}
    folders = sorted((p for p in Path(runs_dir).glob("*/status.json")
                      if not p.parent.is_symlink()), reverse=True)  # stamps: newest first
    for path in folders:
        if exclude is not None and path.parent.resolve() == Path(exclude).resolve():
            continue
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a run folder being written, or not the lab's
        if any(status.get(k) != v for k, v in want.items()):
            continue
        for entry in status.get("notebooks", []):
            if entry.get("status") == "ok" and entry.get("seconds") is not None:
                found.setdefault(entry["name"], (float(entry["seconds"]), path.parent.name))
    return found


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def expected_line(names: Sequence[str], seconds: Mapping[str, tuple[float, str]]) -> str | None:
    """One line before a run: its expected duration from `previous_seconds`, or
    how much of it the earlier runs cover; None when none does."""
    known = [n for n in names if n in seconds]
    if not known:
        return None
    total = _duration(sum(seconds[n][0] for n in known))
    runs = sorted({seconds[n][1] for n in known})
    source = f"earlier runs on this machine with these settings ({', '.join(runs[-3:])})"
    if len(known) == len(names):
        return f"expected: ~{total}, from {source}"
    return (f"expected: ~{total} for the {len(known)} of {len(names)} notebooks run before, "
            f"from {source}; the others add to it")


def before(name: str, seconds: Mapping[str, tuple[float, str]]) -> str:
    """What to print after a notebook's name as it starts: its time last time."""
    return f" (~{seconds[name][0]:.0f} s last time)" if name in seconds else ""


def left(rest: Sequence[str], seconds: Mapping[str, tuple[float, str]]) -> str:
    """What to print after a notebook finished: the remaining notebooks' time,
    where every one of them has an estimate; "" otherwise or at the end."""
    if not rest or any(n not in seconds for n in rest):
        return ""
    return f"; ~{_duration(sum(seconds[n][0] for n in rest))} left"
