"""One module per notebook (`NN_name.ipynb` -> `name`): its `plan(profile, params)`
(the engines it starts, `lab_utils.arms`) and the experiment functions it calls (and its Explore
widgets re-call). Each returns a DataFrame and records its arms in `Results`."""

import importlib
from types import ModuleType


def module_for(notebook: str) -> ModuleType:
    """The experiment module of a notebook: ``NN_name`` -> ``lab_utils.experiments.name``."""
    stem = notebook.removesuffix(".ipynb").rsplit("/", 1)[-1]
    return importlib.import_module(f"{__name__}.{stem.split('_', 1)[1]}")
