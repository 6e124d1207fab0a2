"""Per-profile parameter defaults: a profile's `[parameters."<notebook>"]`
table replaces that notebook's defaults, in what `runall` gives papermill and
in what `lab.setup` applies; explicit values always win. Checked against the
independent facts: the profile's TOML as tomllib reads it and each notebook's
parameters cell as the notebook file holds it."""
from __future__ import annotations

import ast
import json
import tomllib

import pytest

from lab_utils import runall, smoke
from lab_utils.notebook import (
    PAPERMILL_COMMENT,
    apply_profile_parameters,
    check_profile_parameters,
    injected_names,
    parameter_defaults,
    setup,
)
from lab_utils.paths import NOTEBOOKS_DIR
from lab_utils.profiles import PROFILES_DIR, ConfigError, load_profile

GPU_TABLES = tomllib.loads((PROFILES_DIR / "gpu.toml").read_text())["parameters"]
NOTEBOOKS = sorted(p.stem for p in NOTEBOOKS_DIR.glob("[0-9]*.ipynb"))


def parameters_cell(notebook: str) -> dict:
    """The notebook's cell tagged `parameters`, read from the file itself."""
    nb = json.loads((NOTEBOOKS_DIR / f"{notebook}.ipynb").read_text())
    [cell] = [c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", [])]
    tree = ast.parse("".join(cell["source"]))
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
            if isinstance(n, ast.Assign)}


def papermill_cell(**values) -> str:
    """The source of the cell papermill injects (papermill's PythonTranslator)."""
    from papermill.translators import PythonTranslator
    return PythonTranslator.codify(values)


# --------------------------------------------------------------------------
# The gpu profile's tables
# --------------------------------------------------------------------------

def test_the_gpu_tables_set_real_parameters_of_real_notebooks_with_their_types():
    assert GPU_TABLES, "the gpu profile sizes its workloads"
    for notebook, table in GPU_TABLES.items():
        assert notebook in NOTEBOOKS, notebook
        cell = parameters_cell(notebook)
        for name, value in table.items():
            assert name in cell, f"{notebook}: {name}"
            assert name not in ("profile", "base_url", "results_dir")
            default = cell[name]
            assert type(value) is type(default), f"{notebook}.{name}: {value!r} vs {default!r}"
            if isinstance(default, list) and default:
                assert {type(v) for v in value} == {type(default[0])}, f"{notebook}.{name}"
            assert value != default, f"{notebook}.{name} repeats the notebook's default"
    check_profile_parameters(load_profile("gpu"))


def test_the_gpu_workloads_fit_the_profiles_engines():
    """01's long prompts >= 8,192 tokens split by every budget and within
    max_model_len; 02's block prefixes straddle multiples of vLLM's CUDA block
    size (16, CacheConfig.DEFAULT_BLOCK_SIZE); 09's batch job is larger than
    its slots, so it queues."""
    max_len = tomllib.loads((PROFILES_DIR / "gpu.toml").read_text())["engine"]["max_model_len"]
    t01 = GPU_TABLES["01_chunked_prefill"]
    assert 8192 <= t01["long_prompt_tokens"] < max_len
    assert all(b < t01["long_prompt_tokens"] for b in t01["budgets"])
    prefixes = GPU_TABLES["02_prefix_caching"]["block_prefixes"]
    assert {15, 16, 17} <= set(prefixes) and max(GPU_TABLES["02_prefix_caching"][
        "prefix_lengths"]) + parameters_cell("02_prefix_caching")["suffix_tokens"] < max_len
    slots = parameters_cell("09_priority_scheduling")["max_num_seqs"]
    assert parameters_cell("09_priority_scheduling")["batch_requests"] > slots


def test_other_profiles_have_no_tables():
    for name in ("cpu", "remote"):
        assert "parameters" not in tomllib.loads((PROFILES_DIR / f"{name}.toml").read_text())
        assert load_profile(name, base_url="http://127.0.0.1:9").parameters == {}


# --------------------------------------------------------------------------
# Broken tables name their fix
# --------------------------------------------------------------------------

def profile_file(tmp_path, tables: str):
    path = tmp_path / "mine.toml"
    path.write_text((PROFILES_DIR / "gpu.toml").read_text().split("[parameters.")[0] + tables)
    return path


@pytest.mark.parametrize("tables, message", [
    ('[parameters."01_chunkd_prefill"]\nlong_prompt_tokens = 8192\n',
     'names no notebook: did you mean "01_chunked_prefill"?'),
    ('[parameters."01_chunked_prefill"]\nlong_prompt = 8192\n',
     "is not a parameter of 01_chunked_prefill: did you mean long_prompt_tokens?"),
    ('[parameters."01_chunked_prefill"]\nlong_prompt_tokens = "8192"\n',
     "long_prompt_tokens = '8192' (str) must be a int like the notebook's default 1536"),
    ('[parameters."01_chunked_prefill"]\nbudgets = [512, 2048.5]\n',
     "must be a list like the notebook's default [256, 1024]"),
    ('[parameters."00_baseline"]\nprofile = "cpu"\n',
     "profile is the run's to set"),
])
def test_a_bad_table_is_an_error_naming_the_fix(tmp_path, tables, message):
    path = profile_file(tmp_path, tables)
    profile = load_profile(str(path))
    with pytest.raises(ConfigError) as err:
        check_profile_parameters(profile)
    assert message in str(err.value) and "bad [parameters] tables" in str(err.value)
    # every way in refuses it before anything runs
    ns = {**parameter_defaults("00_baseline.ipynb"), "profile": str(path),
          "results_dir": str(tmp_path / "r")}
    with pytest.raises(ConfigError, match="bad .parameters. tables"):
        setup("00_baseline", ns)
    with pytest.raises(ConfigError, match="bad .parameters. tables"):
        runall.run_all(str(path), runs_dir=tmp_path / "runs", only=["00"])
    assert not (tmp_path / "runs").exists(), "no run folder for a refused profile"
    from lab_utils import plan
    assert plan.main(["--profile", str(path), "--only", "00"]) == 1


def test_parameters_must_be_tables(tmp_path):
    path = profile_file(tmp_path, "[parameters]\nlong_prompt_tokens = 8192\n")
    with pytest.raises(ConfigError, match="one table per notebook"):
        load_profile(str(path))


# --------------------------------------------------------------------------
# runall: papermill parameters = profile table, smoke set, explicit -p
# --------------------------------------------------------------------------

@pytest.fixture
def passed(monkeypatch):
    """What runall hands papermill, per notebook (nothing executes)."""
    import papermill
    calls = {}
    monkeypatch.setattr(papermill, "execute_notebook",
                        lambda src, dst, parameters, **kw: calls.setdefault(
                            dst.rsplit("/", 1)[-1][:-6], parameters))
    monkeypatch.setattr(runall, "_wait_for_no_orphans", lambda *a, **k: [])
    return calls


def test_runall_passes_the_profiles_table_and_explicit_values_win(tmp_path, passed):
    table = GPU_TABLES["01_chunked_prefill"]
    assert runall.run_all("gpu", only=["00", "01", "07"], runs_dir=tmp_path,
                          parameters={"long_prompt_tokens": 1536, "repeats": 2}) == 0
    p01 = passed["01_chunked_prefill"]
    assert p01["long_prompt_tokens"] == 1536 == parameters_cell("01_chunked_prefill")[
        "long_prompt_tokens"], "an explicit value equal to the notebook's default still wins"
    assert {k: p01[k] for k in table if k != "long_prompt_tokens"} == {
        k: v for k, v in table.items() if k != "long_prompt_tokens"}
    assert p01["profile"] == "gpu" and p01["repeats"] == 2
    assert {k: passed["00_baseline"][k] for k in GPU_TABLES["00_baseline"]} == \
        GPU_TABLES["00_baseline"]
    assert set(passed["07_streaming"]) == {"profile", "base_url", "results_dir",
                                           "long_prompt_tokens", "repeats"}
    passed.clear()
    assert runall.run_all("cpu", only=["01"], runs_dir=tmp_path) == 0
    assert set(passed["01_chunked_prefill"]) == {"profile", "base_url", "results_dir"}


def test_runall_smoke_sets_replace_the_profiles_values(tmp_path, passed):
    want = smoke.smoke_parameters("01_chunked_prefill")
    assert runall.run_all("gpu", only=["01"], runs_dir=tmp_path, smoke=True) == 0
    got = passed["01_chunked_prefill"]
    assert {k: got[k] for k in want} == want
    rest = {k: v for k, v in GPU_TABLES["01_chunked_prefill"].items() if k not in want}
    assert {k: got[k] for k in rest} == rest


# --------------------------------------------------------------------------
# setup: a value still at the notebook's default takes the profile's
# --------------------------------------------------------------------------

def test_setup_applies_the_table_and_keeps_what_was_chosen(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(smoke.ENV_FLAG, raising=False)
    defaults = parameter_defaults("01_chunked_prefill.ipynb")
    table = GPU_TABLES["01_chunked_prefill"]
    ns = {**defaults, "profile": "gpu", "results_dir": str(tmp_path), "budgets": [128]}
    ctx = setup("01_chunked_prefill", ns)
    assert ns["long_prompt_tokens"] == ctx.params["long_prompt_tokens"] == \
        table["long_prompt_tokens"], "the notebook's globals take the profile's value"
    assert ns["budgets"] == [128], "a value changed in the notebook is kept"
    assert ns["short_output_tokens"] == table["short_output_tokens"]
    out = capsys.readouterr().out
    assert "profile 'gpu' parameters ([parameters.\"01_chunked_prefill\"]): " \
           f"long_prompt_tokens={table['long_prompt_tokens']}" in out
    assert "kept over the profile's: budgets=[128] (set here)" in out
    recorded = json.loads((tmp_path / "01_chunked_prefill.json").read_text())
    assert recorded["parameters"]["long_prompt_tokens"] == table["long_prompt_tokens"]
    assert recorded["profile_parameters"]["kept"] == {"budgets": [128]}
    assert sorted(recorded["profile_parameters"]["taken"]) == sorted(
        set(table) - {"budgets"})


def test_setup_keeps_what_papermill_injected_even_at_the_default(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(smoke.ENV_FLAG, raising=False)
    defaults = parameter_defaults("01_chunked_prefill.ipynb")
    injected = papermill_cell(profile="gpu", long_prompt_tokens=defaults["long_prompt_tokens"],
                              results_dir=str(tmp_path))
    assert injected.startswith(PAPERMILL_COMMENT + "\n")
    ns = {**defaults, "profile": "gpu", "results_dir": str(tmp_path),
          "In": ["", "import lab_utils as lab", "profile = 'cpu'\nlong_prompt_tokens = 1536\n",
                 injected]}
    assert injected_names(ns) == {"profile", "long_prompt_tokens", "results_dir"}
    ctx = setup("01_chunked_prefill", ns)
    assert ctx.params["long_prompt_tokens"] == defaults["long_prompt_tokens"] == 1536
    assert ctx.params["budgets"] == GPU_TABLES["01_chunked_prefill"]["budgets"]
    assert "long_prompt_tokens=1536 (passed)" in capsys.readouterr().out


def test_setup_under_smoke_replaces_the_profiles_values(tmp_path, monkeypatch):
    monkeypatch.setenv(smoke.ENV_FLAG, "1")
    ns = {**parameter_defaults("01_chunked_prefill.ipynb"), "profile": "gpu",
          "results_dir": str(tmp_path)}
    ctx = setup("01_chunked_prefill", ns)
    want = smoke.smoke_parameters("01_chunked_prefill")
    assert {k: ctx.params[k] for k in want} == want


def test_apply_without_a_table_changes_nothing():
    defaults = parameter_defaults("07_streaming.ipynb")
    params = dict(defaults)
    got = apply_profile_parameters("07_streaming", load_profile("gpu"), defaults, params)
    assert (got.table, got.taken, got.describe(), params) == ({}, {}, "", defaults)


def test_no_notebooks_own_parameters_cell_looks_like_papermills():
    """setup tells papermill's cell from the notebook's by its first line."""
    for notebook in NOTEBOOKS:
        nb = json.loads((NOTEBOOKS_DIR / f"{notebook}.ipynb").read_text())
        for cell in nb["cells"]:
            assert not "".join(cell["source"]).lstrip().startswith(PAPERMILL_COMMENT + "\n"), \
                notebook


# --------------------------------------------------------------------------
# In a real kernel, through papermill (starts kernels, no engine)
# --------------------------------------------------------------------------

@pytest.mark.engine
def test_in_a_kernel_runall_and_papermill_values_win(tmp_path, monkeypatch):
    """A notebook with 01's parameters cell and its setup (no plan, so no
    engine): through runall with an explicit value equal to the notebook's
    default, and through papermill alone. Outside a smoke run: `make test`
    sets LAB_SMOKE, under which setup takes the smoke set instead."""
    monkeypatch.delenv("LAB_SMOKE", raising=False)
    monkeypatch.delenv("LAB_SMOKE_RESULTS", raising=False)
    import nbformat
    import papermill as pm
    from nbformat.v4 import new_code_cell, new_notebook
    source = json.loads((NOTEBOOKS_DIR / "01_chunked_prefill.ipynb").read_text())
    [cell] = [c for c in source["cells"] if "parameters" in c["metadata"].get("tags", [])]
    nb = new_notebook(cells=[new_code_cell("import lab_utils as lab"),
                             new_code_cell("".join(cell["source"]),
                                           metadata={"tags": ["parameters"]}),
                             new_code_cell('ctx = lab.setup("01_chunked_prefill", globals())')])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    folder = tmp_path / "nbs"
    folder.mkdir()
    nbformat.write(nb, folder / "01_chunked_prefill.ipynb")
    table = GPU_TABLES["01_chunked_prefill"]

    assert runall.run_all("gpu", runs_dir=tmp_path / "runs", notebooks_dir=folder,
                          parameters={"long_prompt_tokens": 1536}) == 0
    data = json.loads(next((tmp_path / "runs").glob("*/results/01_chunked_prefill.json"))
                      .read_text())
    assert data["parameters"]["long_prompt_tokens"] == 1536
    assert data["parameters"]["budgets"] == table["budgets"]

    out = tmp_path / "direct"
    pm.execute_notebook(str(folder / "01_chunked_prefill.ipynb"), str(tmp_path / "o.ipynb"),
                        parameters={"profile": "gpu", "long_prompt_tokens": 1536,
                                    "results_dir": str(out)},
                        kernel_name="python3", cwd=str(folder), progress_bar=False)
    data = json.loads((out / "01_chunked_prefill.json").read_text())
    assert data["parameters"]["long_prompt_tokens"] == 1536
    assert data["parameters"]["budgets"] == table["budgets"], "taken by setup in the kernel"
    assert data["profile_parameters"]["kept"] == {"long_prompt_tokens": 1536}
    text = json.dumps(nbformat.read(tmp_path / "o.ipynb", as_version=4).cells[-1]["outputs"])
    assert "long_prompt_tokens=1536 (passed)" in text
