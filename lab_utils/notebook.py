"""What every notebook does first and last: check its parameters, load the
profile, open an engine pool and a results file; and the Explore widgets."""
from __future__ import annotations

import ast
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .machine import summary_line
from .paths import NOTEBOOKS_DIR, REPO_ROOT
from .profiles import ConfigError, Profile, load_profile
from .results import Results
from .server import EnginePool


def parameter_defaults(notebook: str | Path) -> dict[str, Any]:
    """The literal assignments of the notebook's cell tagged `parameters`."""
    path = Path(notebook)
    if not path.is_absolute() and not path.exists():
        path = NOTEBOOKS_DIR / path
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            source = "".join(cell["source"])
            out = {}
            for node in ast.parse(source).body:
                if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                    out[node.targets[0].id] = ast.literal_eval(node.value)
            return out
    raise ConfigError(f"{path} has no cell tagged 'parameters'")


def _same_kind(default: Any, value: Any) -> bool:
    if default is None:
        return True  # an optional parameter: any value overrides it
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple)) and all(
            _same_kind(default[0], v) for v in value) if default else isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def check_parameters(defaults: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """An override must keep the default's type (papermill passes anything)."""
    problems = []
    for name, default in defaults.items():
        if name in values and not _same_kind(default, values[name]):
            problems.append(f"{name}={values[name]!r} ({type(values[name]).__name__}) must be a "
                            f"{type(default).__name__} like its default {default!r}: pass e.g. "
                            f"`-p {name} {json.dumps(default)}`")
    if problems:
        raise ConfigError("bad notebook parameters:\n- " + "\n- ".join(problems))


@dataclass
class NotebookContext:
    name: str
    profile: Profile
    engines: EnginePool
    results: Results
    params: dict[str, Any]

    def engine(self, role: str | None = None, *, env: Mapping[str, str] | None = None,
               **flags: Any):
        """Start (or reuse) the engine for these flags and print its command."""
        engine = self.engines.get(role, env=env, **flags)
        started = f", started in {engine.server.startup_s:.1f} s" if engine.server else ""
        print(f"[{engine.label}] {engine.command}{started}")
        return engine

    def close(self) -> None:
        self.engines.close()
        self.results.save()


def setup(name: str, namespace: dict[str, Any]) -> NotebookContext:
    """Check the parameters in `namespace` (the notebook's globals) against the
    notebook's own defaults, then load the profile and open results and engines.
    Under LAB_SMOKE=1 the notebook's smoke parameters replace them, in
    `namespace` too (`lab_utils.smoke`)."""
    from . import smoke
    defaults = parameter_defaults(f"{name}.ipynb")
    params = {k: namespace[k] for k in defaults if k in namespace}
    check_parameters(defaults, params)
    changed = smoke.apply(name, defaults, params, namespace)
    if changed:
        check_parameters(defaults, params)
        print(f"smoke run ({smoke.ENV_FLAG}=1, {smoke.SMOKE_FILE.name}): "
              + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
    results_dir = Path(params.get("results_dir", "results"))
    if not results_dir.is_absolute():
        results_dir = (NOTEBOOKS_DIR / results_dir).resolve()
    profile = load_profile(params.get("profile", "cpu"), base_url=params.get("base_url", ""))
    results = Results(name, results_dir, profile.name)
    print(f"machine: {summary_line(results.data['environment']['machine'])}")
    results.data["parameters"] = params
    if changed:
        results.data["smoke"] = True
    results.save()
    engines = EnginePool(profile, log_dir=results_dir / "logs" / name)
    return NotebookContext(name, profile, engines, results, params)


def explore(function: Callable[..., Any], **controls: Any):
    """Widgets that re-run `function(**values)` when "Run" is pressed.

    `controls` maps argument names to ipywidgets (or to fixed values). Nothing
    runs until the button is pressed, so headless runs are unaffected."""
    import ipywidgets as w
    from IPython.display import display

    widgets = {k: v for k, v in controls.items() if isinstance(v, w.ValueWidget)}
    fixed = {k: v for k, v in controls.items() if k not in widgets}
    for widget in widgets.values():
        if hasattr(widget, "continuous_update"):
            widget.continuous_update = False
    button = w.Button(description="Run", button_style="primary", icon="play")
    out = w.Output()

    def on_click(_):
        out.clear_output()
        with out:
            button.disabled = True
            try:
                result = function(**fixed, **{k: v.value for k, v in widgets.items()})
                if result is not None:
                    display(result)
            finally:
                button.disabled = False

    button.on_click(on_click)
    box = w.VBox([*widgets.values(), button, out])
    display(box)
    return box


__all__ = [
    "REPO_ROOT",
    "NotebookContext",
    "check_parameters",
    "explore",
    "parameter_defaults",
    "setup",
]
