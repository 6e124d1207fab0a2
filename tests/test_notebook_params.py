"""Notebook parameters: the defaults cell and type checks on overrides."""
import json

import pytest

from lab_utils.notebook import check_parameters, parameter_defaults
from lab_utils.profiles import ConfigError

DEFAULTS = {"profile": "cpu", "base_url": "", "requests": 8, "rate": 2.0, "quick": False,
            "lengths": [128, 512], "ratios": [0.5, 1.0], "tags": []}


@pytest.mark.parametrize("values", [
    {},
    {"profile": "gpu", "base_url": "http://h:8000"},
    {"requests": 16},
    {"rate": 3},               # an int where a float is expected is fine
    {"rate": 0.5},
    {"quick": True},
    {"lengths": [64], "ratios": [1, 0.25]},
    {"lengths": (1, 2)},
    {"tags": ["a", 1]},        # an empty default list accepts any list
    {"unknown_extra": object()},   # names without a default are not checked here
])
def test_check_parameters_accepts(values):
    check_parameters(DEFAULTS, values)


@pytest.mark.parametrize("name, value", [
    ("requests", True),        # bool is not an int here
    ("requests", 2.5),
    ("requests", "8"),
    ("quick", 1),              # nor an int a bool
    ("rate", True),
    ("rate", "2"),
    ("profile", 3),
    ("lengths", [64, "128"]),
    ("lengths", 128),
])
def test_check_parameters_rejects(name, value):
    with pytest.raises(ConfigError) as err:
        check_parameters(DEFAULTS, {name: value})
    msg = str(err.value)
    assert msg.startswith("bad notebook parameters:")
    assert f"{name}={value!r} ({type(value).__name__}) must be a {type(DEFAULTS[name]).__name__}" \
        in msg
    assert f"`-p {name} {json.dumps(DEFAULTS[name])}`" in msg


def test_check_parameters_str_vs_int_message():
    with pytest.raises(ConfigError) as err:
        check_parameters({"requests": 8}, {"requests": "eight"})
    assert "requests='eight' (str) must be a int like its default 8: pass e.g. `-p requests 8`" \
        in str(err.value)


def test_check_parameters_lists_every_problem():
    with pytest.raises(ConfigError) as err:
        check_parameters(DEFAULTS, {"requests": True, "profile": 1, "rate": 1.0})
    msg = str(err.value)
    assert msg.count("\n- ") == 2 and "requests=True" in msg and "profile=1" in msg


def _notebook(tmp_path, cells):
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": cells}
    path = tmp_path / "demo.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_parameter_defaults(tmp_path):
    path = _notebook(tmp_path, [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Demo\n"]},
        {"cell_type": "code", "metadata": {"tags": ["setup"]}, "source": ["x = 1\n"],
         "outputs": [], "execution_count": None},
        {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "outputs": [],
         "execution_count": None,
         "source": ["# Parameters (papermill -p name value)\n",
                    "profile = \"cpu\"   # cpu | gpu | remote\n",
                    "base_url = \"\"\n",
                    "requests = 8\n",
                    "rate = 2.0\n",
                    "quick = False\n",
                    "lengths = [128, 512]\n",
                    "limits = {\"ttft_s\": 2.0}\n",
                    "seed = -1\n",
                    "nothing = None\n",
                    "import math\n",
                    "a.b = 3\n"]},
        {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "outputs": [],
         "execution_count": None, "source": "profile = 'second cell ignored'\n"},
    ])
    assert parameter_defaults(path) == {
        "profile": "cpu", "base_url": "", "requests": 8, "rate": 2.0, "quick": False,
        "lengths": [128, 512], "limits": {"ttft_s": 2.0}, "seed": -1, "nothing": None}


def test_parameter_defaults_source_as_one_string(tmp_path):
    path = _notebook(tmp_path, [{"cell_type": "code", "metadata": {"tags": ["parameters"]},
                                 "outputs": [], "execution_count": None,
                                 "source": "n = 3\nname = 'x'\n"}])
    assert parameter_defaults(str(path)) == {"n": 3, "name": "x"}


def test_parameter_defaults_without_parameters_cell(tmp_path):
    path = _notebook(tmp_path, [{"cell_type": "code", "metadata": {}, "outputs": [],
                                 "execution_count": None, "source": "n = 3\n"}])
    with pytest.raises(ConfigError, match="no cell tagged 'parameters'"):
        parameter_defaults(path)


def test_defaults_then_check(tmp_path):
    path = _notebook(tmp_path, [{"cell_type": "code", "metadata": {"tags": ["parameters"]},
                                 "outputs": [], "execution_count": None,
                                 "source": "requests = 8\nrate = 1.5\n"}])
    defaults = parameter_defaults(path)
    check_parameters(defaults, {"requests": 4, "rate": 2})
    with pytest.raises(ConfigError, match="-p requests 8"):
        check_parameters(defaults, {"requests": "4"})
