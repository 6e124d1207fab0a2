"""The smoke parameter sets: one per notebook, each a valid override of it,
applied by `lab.setup` under LAB_SMOKE=1 and by `runall --smoke`."""
from __future__ import annotations

import pytest

from lab_utils import smoke
from lab_utils.notebook import check_parameters, parameter_defaults, setup
from lab_utils.paths import NOTEBOOKS_DIR
from lab_utils.profiles import ConfigError

NOTEBOOKS = sorted(p.stem for p in NOTEBOOKS_DIR.glob("[0-9]*.ipynb"))


def test_every_notebook_has_a_smoke_set_and_nothing_else_does():
    table = smoke.all_smoke_parameters()
    assert sorted(table) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_smoke_keys_are_parameters_of_their_notebook(name):
    defaults = parameter_defaults(f"{name}.ipynb")
    values = smoke.smoke_parameters(name)
    unknown = set(values) - set(defaults)
    assert not unknown, f"{name}: smoke keys {sorted(unknown)} are not parameters of the notebook"
    check_parameters(defaults, values)  # each keeps its default's type
    assert values, f"{name}: an empty smoke set runs the full defaults"
    assert not {"profile", "base_url", "results_dir"} & set(values), \
        "where a smoke run goes is for the caller to say"


def test_unknown_notebook_names_the_fix(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('["00_baseline"]\nrepeats = 2\n')
    with pytest.raises(ConfigError, match=r'no \["99_x"\] table'):
        smoke.smoke_parameters("99_x", path)


def test_setup_applies_the_smoke_set_only_when_asked(tmp_path, monkeypatch, capsys):
    defaults = parameter_defaults("00_baseline.ipynb")
    ns = {**defaults, "results_dir": str(tmp_path / "explicit")}
    monkeypatch.delenv(smoke.ENV_FLAG, raising=False)
    ctx = setup("00_baseline", ns)
    assert ctx.params["repeats"] == defaults["repeats"] and "smoke" not in ctx.results.data
    monkeypatch.setenv(smoke.ENV_FLAG, "1")
    monkeypatch.setenv(smoke.ENV_RESULTS, str(tmp_path / "smoke"))
    ctx = setup("00_baseline", ns)
    want = smoke.smoke_parameters("00_baseline")
    assert ns["repeats"] == ctx.params["repeats"] == want["repeats"]   # the notebook's globals too
    assert ctx.results.data["smoke"] is True
    assert ctx.results.dir == tmp_path / "explicit", "an explicit results_dir is kept"
    assert "smoke run" in capsys.readouterr().out
    ns2 = dict(defaults)                        # the default results_dir goes to the smoke folder
    ctx = setup("00_baseline", ns2)
    assert ctx.results.dir == tmp_path / "smoke"


def test_a_bad_parameter_is_reported_before_the_smoke_set_hides_it(tmp_path, monkeypatch):
    monkeypatch.setenv(smoke.ENV_FLAG, "1")
    ns = {**parameter_defaults("00_baseline.ipynb"), "repeats": "four",
          "results_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match="repeats='four'"):
        setup("00_baseline", ns)
