"""Notebook text per device: cells quoting CPU reference runs carry the tag
`reference-cpu`, and a run off the CPU executes the notebook without them
(`lab_utils.device_text`, `runall.notebook_input`)."""
from __future__ import annotations

import json
import re

import nbformat
import pytest

from lab_utils import runall
from lab_utils.device_text import for_device, left_out_text, reference_devices, setup_line
from lab_utils.notebook import interactive
from lab_utils.paths import NOTEBOOKS_DIR, notebooks
from lab_utils.plan import estimate_note
from lab_utils.profiles import load_profile

TAG = "reference-cpu"
#: Words that mark a paragraph quoting reference runs: the italic "earlier
#: runs of it on the project's 2-core test machine" paragraph and the ways the
#: notebooks cite their own past runs.
MARKERS = re.compile(r"earlier runs|\bour runs\b|\bin our\b|our quietest|test machine|"
                     r"reference runs?\b|\bquiet run\b|recorded with the defaults|\bwe started\b",
                     re.IGNORECASE)
#: Numbers from CPU reference runs, picked by hand from the notebooks' text.
CPU_NUMBERS = {
    "02_prefix_caching": ["80–90%"],
    "03_prompt_length_and_warmup": ["639 → 211 ms"],
    "04_speculative_decoding": ["82 of 88", "8–16% of greedy tokens"],
    "05_quantization": ["≈1.2×", "INT8\nactivations alone +3.3%"],
    "06_fp8_kv_cache": ["1,408 → 5,760", "Explicitly set (2.0/22.46) GiB"],
    "09_priority_scheduling": ["0.31 s and 92% of users"],
    "11_model_tiering": ["78.6 → 38.7 ms", "20 correct with 30 layers"],
    "13_replica_routing": ["691 and 731 ms"],
}
#: The closing cells that read the run against the article (each quotes reference runs).
CLOSING = {"01": "## Measured against the article", "02": "## Measured against the article's claim",
           "03": "## How this compares with the article", "13": "## Reading it"}
PATHS = notebooks(None)


def read(path):
    return nbformat.read(str(path), as_version=4)


def untagged_reference_cells(nb) -> list[int]:
    """Markdown cells whose text cites reference runs but lack the tag."""
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
            and MARKERS.search(c.source) and "cpu" not in reference_devices(c)]


def text(nb) -> str:
    return "\n".join(c.source for c in nb.cells)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_every_cell_citing_reference_runs_is_tagged(path):
    nb = read(path)
    assert untagged_reference_cells(nb) == [], (
        f"{path.name}: cells {untagged_reference_cells(nb)} cite reference runs: tag them "
        f"{TAG!r} or say it for the run's device")
    for c in nb.cells:
        if reference_devices(c):
            assert c.cell_type == "markdown", "only Markdown is left out, never code"


def test_the_closing_cells_are_tagged():
    tagged = {p.stem[:2]: [c.source.split("\n", 1)[0] for c in read(p).cells if TAG in
                           c.metadata.get("tags", [])] for p in PATHS}
    for nn in ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "13"]:
        assert tagged[nn], f"{nn} has no {TAG} cell"
        assert tagged[nn][-1].startswith(CLOSING.get(nn, "## Measured against the article")), nn
    assert tagged["00"] == [] and tagged["12"] == []


def test_the_tag_check_catches_an_untagged_cell():
    nb = read(NOTEBOOKS_DIR / "02_prefix_caching.ipynb")
    [i] = [i for i, c in enumerate(nb.cells) if TAG in c.metadata.get("tags", [])]
    nb.cells[i].metadata["tags"].remove(TAG)
    assert untagged_reference_cells(nb) == [i]


def test_reference_devices_reads_the_tags():
    cell = nbformat.v4.new_markdown_cell("x", metadata={"tags": ["reference-cpu", "parameters",
                                                                 "reference-a100"]})
    assert reference_devices(cell) == {"cpu", "a100"}
    assert reference_devices(nbformat.v4.new_code_cell("1")) == set()


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_a_cuda_run_has_no_cpu_reference_cell(path):
    nb = read(path)
    got = for_device(nb, "cuda")
    assert len(got.cells) == len(nb.cells)
    assert not any(reference_devices(c) for c in got.cells)
    last = max((i for i, c in enumerate(nb.cells) if reference_devices(c)), default=None)
    for i, (before, after) in enumerate(zip(nb.cells, got.cells)):
        if reference_devices(before):  # a short note in its place, same id
            assert after.cell_type == "markdown" and after.id == before.id
            assert after.source == left_out_text("cpu", "cuda", last=i == last)
            assert "reference runs on cpu" in after.source and "on cuda" in after.source
            assert ("This run's own numbers are the findings above" in after.source) == (
                i == last), "only the last note follows the findings"
        else:
            assert after == before
    for number in CPU_NUMBERS.get(path.stem, []):
        assert number in text(nb), f"{number!r} is no longer in {path.name}: pick another"
        assert number not in text(got), f"{number!r} left in the cuda run of {path.name}"
    assert MARKERS.search(text(got)) is None or "reference runs on cpu" in text(got)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_a_cpu_run_is_the_notebook_as_committed(path):
    nb = read(path)
    assert for_device(nb, "cpu") == nb
    assert runall.notebook_input(path, load_profile("cpu")) == str(path)


def test_a_remote_note_says_the_servers_device_is_unknown():
    got = for_device(read(NOTEBOOKS_DIR / "06_fp8_kv_cache.ipynb"), "remote")
    notes = [c.source for c in got.cells if "left-out-reference" in c.metadata.get("tags", [])]
    assert len(notes) == 2  # the split-off note on the CPU build's source and the closing cell
    assert all("remote server (its device is not known to the lab)" in n for n in notes)


def test_the_note_goes_on_the_last_left_out_cell():
    nb = read(NOTEBOOKS_DIR / "05_quantization.ipynb")
    got = for_device(nb, "cuda", note="ESTIMATES")
    notes = [c for c in got.cells if "left-out-reference" in c.metadata.get("tags", [])]
    assert [n.source.endswith("\n\nESTIMATES") for n in notes] == [False, True]


def test_estimates_for_a_named_gpu(monkeypatch):
    """02 on an H100 at the gpu profile's 8,192-token prefix: a prefill of
    8,192 + 64 tokens is 2 x 7.6156e9 parameters (15,231,233,024 bf16 bytes,
    the checkpoint's index) x 8,256 / 989.5e12 FLOP/s (datasheet) = 127.08 ms;
    the 64 uncached tokens 0.99 ms."""
    path = NOTEBOOKS_DIR / "02_prefix_caching.ipynb"
    monkeypatch.setenv("LAB_GPU", "h100-80gb")
    note = estimate_note(path, load_profile("gpu"))
    assert note.startswith("The first-principles estimate for h100-80gb")
    assert "estimates, not measurements" in note
    assert "127.08 ms -> 0.99 ms" in note and "(-99%)" in note
    assert estimate_note(NOTEBOOKS_DIR / "00_baseline.ipynb", load_profile("gpu")) == ""


def test_without_a_named_gpu_the_note_names_the_command(monkeypatch):
    monkeypatch.delenv("LAB_GPU", raising=False)
    path = NOTEBOOKS_DIR / "04_speculative_decoding.ipynb"
    for profile in (load_profile("gpu"), load_profile("remote", base_url="http://x:8000")):
        note = estimate_note(path, profile)
        assert "`python -m lab_utils.plan --profile gpu --gpu h100-80gb --only 04`" in note
        assert "not measurements" in note


def test_runall_runs_the_filtered_notebook_off_the_cpu(monkeypatch):
    monkeypatch.setenv("LAB_GPU", "h100-80gb")
    path = NOTEBOOKS_DIR / "06_fp8_kv_cache.ipynb"
    got = runall.notebook_input(path, load_profile("gpu"), {"profile": "gpu"})
    assert isinstance(got, nbformat.NotebookNode)
    assert not any(reference_devices(c) for c in got.cells)
    assert "1,408 → 5,760" not in text(got)
    [closing] = [c for c in got.cells if "h100-80gb" in c.source]
    assert closing.source.startswith(left_out_text("cpu", "cuda", last=True))
    assert "the KV budget holds" in closing.source  # the plan's pressure-run estimate


def test_run_all_hands_papermill_the_notebook_for_the_device(tmp_path, monkeypatch):
    import papermill
    seen = {}
    monkeypatch.setattr(papermill, "execute_notebook",
                        lambda src, dst, **kw: seen.setdefault(dst.rsplit("/", 1)[-1], src))
    monkeypatch.setattr(runall, "_wait_for_no_orphans", lambda *a, **k: [])
    assert runall.run_all("gpu", only=["02"], runs_dir=tmp_path) == 0
    src = seen["02_prefix_caching.ipynb"]
    assert isinstance(src, nbformat.NotebookNode) and "80–90%" not in text(src)
    seen.clear()
    assert runall.run_all("cpu", only=["02"], runs_dir=tmp_path) == 0
    assert seen["02_prefix_caching.ipynb"] == str(NOTEBOOKS_DIR / "02_prefix_caching.ipynb")


def test_the_executed_notebook_names_its_source_not_a_copy(tmp_path):
    """papermill stores a NotebookNode input whole under metadata.papermill.input_path."""
    import papermill
    path = NOTEBOOKS_DIR / "02_prefix_caching.ipynb"
    out = tmp_path / "02.ipynb"
    papermill.execute_notebook(runall.notebook_input(path, load_profile("gpu")), str(out),
                               parameters={"profile": "gpu"}, prepare_only=True,
                               kernel_name="python3", progress_bar=False)
    assert isinstance(json.loads(out.read_text())["metadata"]["papermill"]["input_path"], dict)
    runall._name_input(out, path)
    done = nbformat.read(str(out), as_version=4)
    assert done.metadata.papermill.input_path == str(path)
    assert not any(TAG in c.metadata.get("tags", []) for c in done.cells)
    assert "80–90%" not in text(done)


def test_setup_says_it_off_the_cpu_in_an_interactive_session():
    assert setup_line("cpu") is None
    assert "reference-cpu" in setup_line("cuda") and "not this cuda device" in setup_line("cuda")
    assert "not this remote server" in setup_line("remote")
    assert interactive({"In": ["", "import lab_utils as lab"]})
    assert not interactive({"In": ["", "# Parameters\nprofile = \"gpu\"\n"]})
    assert not interactive({})


def test_setup_prints_the_line_only_by_hand_off_the_cpu(tmp_path, capsys):
    import lab_utils as lab
    by_hand = ["", "import lab_utils as lab"]
    papermill = ["", "# Parameters\nprofile = \"gpu\"\n"]
    for history, profile, shown in [(by_hand, "gpu", True), (papermill, "gpu", False),
                                    (by_hand, "cpu", False)]:
        lab.setup("07_streaming", {"In": history, "profile": profile,
                                   "results_dir": str(tmp_path)})
        out = capsys.readouterr().out
        assert ("cells tagged reference-cpu describe the CPU reference machine" in out) == shown
