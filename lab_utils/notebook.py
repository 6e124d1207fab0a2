"""What every notebook does first and last: check its parameters, load the
profile, open an engine pool and a results file; and the Explore widgets."""
from __future__ import annotations

import ast
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .arms import Arm, Plan
from .errors import ServerError
from .machine import summary_line
from .paths import NOTEBOOKS_DIR, REPO_ROOT
from .profiles import ConfigError, Profile, load_profile
from .results import Results
from .server import ArmUnavailable, EnginePool


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
    plan: Plan | None = None

    def engine(self, role: str | None = None, *, env: Mapping[str, str] | None = None,
               **flags: Any):
        """Start (or reuse) the engine for these flags and print its command.
        With a plan, only an engine the plan declares (`arm` names it)."""
        arm = None
        if self.plan is not None:
            arm = self.plan.find(role, flags, env)
            if arm is None:
                from .arms import engine_key
                raise ConfigError(
                    f"{self.name} asked for an engine its plan does not declare: "
                    f"{engine_key(role, flags, env)}. Declare it as an arm in the experiment "
                    f"module's plan() (declared: {[a.key for a in self.plan.arms]}), or use "
                    "ctx.any_engine(...) for an Explore widget")
        return self._start(role, env, flags, arm.name if arm else None)

    def any_engine(self, role: str | None = None, *, env: Mapping[str, str] | None = None,
                   **flags: Any):
        """An engine outside the plan, for Explore widgets (recorded as
        "explore"), or None (printed) when the target cannot serve it."""
        try:
            return self._start(role, env, flags, "explore")
        except ArmUnavailable as exc:
            print(f"cannot explore this engine here: {exc}")
            return None

    def _start(self, role, env, flags, arm_name):
        engine = self.engines.get(role, env=env, **flags)
        engine.arm = arm_name
        started = f", started in {engine.server.startup_s:.1f} s" if engine.server else ""
        print(f"[{arm_name or engine.label}] {engine.command}{started}")
        self.results.add_engine(engine)
        return engine

    def arm(self, arm: str | Arm):
        """The engine of a declared arm, or None (noted and printed) when this
        target cannot serve it: a remote server with other flags, or an
        `optional` arm whose server failed to start (its log's root cause)."""
        a = self.plan.arm(arm) if self.plan is not None else arm
        if not isinstance(a, Arm):
            raise ConfigError(f"{self.name} has no plan: pass plan= to lab.setup")
        try:
            return self.engine(a.role, env=a.env or None, **dict(a.flags))
        except ArmUnavailable as exc:
            self.skip(a, str(exc))
        except ServerError as exc:
            if not a.optional:
                raise
            from .vllm_logs import root_cause
            self.engines.close()  # a server that failed to start leaves nothing behind
            self.skip(a, f"its server did not start: {root_cause(str(exc)) or exc}")
        return None

    def skip(self, arm: str | Arm, why: str) -> None:
        """Note (in the results) and print that an arm did not run, and why."""
        name = arm.name if isinstance(arm, Arm) else arm
        msg = f"arm {name!r} skipped: {why}"
        self.results.note(msg)
        self.results.data.setdefault("skipped_arms", {})[name] = why
        self.results.save()
        print(msg)

    def close(self) -> None:
        self.engines.close()
        self.results.save()


def setup(name: str, namespace: dict[str, Any],
          plan: Callable[[Profile, Mapping[str, Any]], Plan] | None = None) -> NotebookContext:
    """Check the parameters in `namespace` (the notebook's globals) against the
    notebook's own defaults, then load the profile and open results and engines.
    Under LAB_SMOKE=1 the notebook's smoke parameters replace them, in
    `namespace` too (`lab_utils.smoke`). `plan` is the experiment module's
    `plan(profile, params)`: the engines this notebook may start (`lab_utils.arms`),
    checked, printed and written to the results before anything starts."""
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
    declared = None
    if plan is not None:
        declared = plan(profile, params).check()
        results.data["plan"] = declared.to_dict()
        results.save()
        print(declared.describe())
    engines = EnginePool(profile, log_dir=results_dir / "logs" / name,
                         keep=declared.keep if declared else 1)
    return NotebookContext(name, profile, engines, results, params, declared)


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
