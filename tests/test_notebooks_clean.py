"""Committed notebooks are clean and follow the skeleton (no engine needed).

nbval executes them separately (`make test` passes `--nbval-lax notebooks/`)."""
from __future__ import annotations

import ast
import json

import pytest

from lab_utils.notebook import parameter_defaults
from lab_utils.paths import NOTEBOOKS_DIR

NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9]*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_skeleton(path):
    nb = json.loads(path.read_text())
    cells = nb["cells"]
    assert cells[0]["cell_type"] == "markdown" and "".join(cells[0]["source"]).startswith("# ")
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    source = "".join(tagged[0]["source"])
    for line in source.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line, f"parameter line without a comment: {line!r}"
    defaults = parameter_defaults(path)
    for required in ("profile", "base_url", "results_dir"):
        assert required in defaults, f"parameters cell lacks {required!r}"
    import papermill
    inferred = papermill.inspect_notebook(str(path))
    unparsed = set(defaults) - set(inferred)
    assert not unparsed, f"papermill --help-notebook cannot parse {sorted(unparsed)}: " \
                         "avoid '=' in those lines' comments"
    setup_calls = [c for c in cells if f'lab.setup("{path.stem}", globals()' in "".join(c["source"])]
    assert setup_calls, f"{path.name} must call lab.setup({path.stem!r}, globals(), plan=...)"
    assert "Explore" in "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for c in cells:
        if c["cell_type"] == "code":
            ast.parse("".join(c["source"]))  # every code cell is valid Python
