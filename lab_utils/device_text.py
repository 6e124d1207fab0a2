"""Notebook text that holds for the device a run is on.

A notebook's closing cells (and a few in between) quote numbers from
reference runs on the project's 2-core CPU test machine. Each such cell
carries the tag `reference-<device>` (`reference-cpu`). On another device
those numbers would read as if they described the run, so `for_device`
gives a copy of the notebook in which each cell tagged for another device
is one short Markdown note instead: what was left out, why, and that the
run's own numbers are its findings. `runall` executes that copy on every
device but "cpu"; `lab.setup` says the same in one line in an interactive
session.

    nb = nbformat.read("notebooks/02_prefix_caching.ipynb", as_version=4)
    for_device(nb, "cuda", note=plan.estimate_note(path, load_profile("gpu")))

`lab_utils.plan.estimate_note` is the note runall passes: what the plan
checker predicts for the notebook's arms on the GPU named by `LAB_GPU`
(e.g. h100-80gb), labelled as first-principles estimates, not measurements;
without a named GPU, the command that prints them.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import nbformat

TAG_PREFIX = "reference-"
#: What each reference device was, for the note.
REFERENCE_MACHINES = {"cpu": "the project's 2-core CPU test machine"}


def reference_devices(cell: Mapping[str, Any]) -> set[str]:
    """The devices whose reference runs a cell quotes (tags `reference-<device>`)."""
    tags = (cell.get("metadata") or {}).get("tags") or []
    return {t[len(TAG_PREFIX):] for t in tags if t.startswith(TAG_PREFIX)}


def left_out_text(reference: set[str] | str, device: str, last: bool = True) -> str:
    """The note that stands in for a cell of reference runs on `reference`
    (`last`: the notebook's last such cell, which follows its findings)."""
    ref = ", ".join(sorted(reference)) if not isinstance(reference, str) else reference
    machine = REFERENCE_MACHINES.get(ref, f"a {ref} machine")
    where = ("on a remote server (its device is not known to the lab)" if device == "remote"
             else f"on {device}")
    own = ("the findings above" if last else
           "what its cells print and its findings")
    return (f"*Left out of this run:* the notebook's source has notes of reference runs on "
            f"{ref} ({machine}) here, left out of this run {where} because their numbers "
            f"describe that machine. This run's own numbers are {own}.")


def for_device(nb: nbformat.NotebookNode, device: str, note: str = "") -> nbformat.NotebookNode:
    """A copy of `nb` for a run on `device`: each cell tagged for another
    device is replaced by one Markdown cell saying what was left out
    (`left_out_text`; same cell id, tag `left-out-reference`); `note` (e.g.
    `lab_utils.plan.estimate_note`) is appended to the last of them. A notebook with no
    such cell comes back equal to `nb`."""
    import nbformat  # here: its schema validator takes ~2 s to import, and every
    # kernel imports this module (lab.setup) while only runs off the CPU need it
    out = copy.deepcopy(nb)
    left_out = [i for i, c in enumerate(out.cells)
                if reference_devices(c) and device not in reference_devices(c)]
    for i in left_out:
        cell = out.cells[i]
        text = left_out_text(reference_devices(cell), device, last=i == left_out[-1])
        if i == left_out[-1] and note:
            text += "\n\n" + note
        new = nbformat.v4.new_markdown_cell(text, metadata={"tags": ["left-out-reference"]})
        if "id" in cell:
            new["id"] = cell["id"]
        out.cells[i] = new
    return out


def setup_line(device: str) -> str | None:
    """The line `lab.setup` prints in an interactive session off the CPU."""
    if device == "cpu":
        return None
    this = "this remote server" if device == "remote" else f"this {device} device"
    return (f"note: cells tagged {TAG_PREFIX}cpu describe the CPU reference machine "
            f"(the project's 2-core test machine), not {this}")


__all__ = ["TAG_PREFIX", "for_device", "left_out_text", "reference_devices", "setup_line"]
