"""What every notebook does first and last: check its parameters, load the
profile, open an engine pool and a results file; and the Explore widgets."""
from __future__ import annotations

import ast
import difflib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arms import Arm, Plan
from .device_text import setup_line
from .errors import ServerError
from .machine import summary_line
from .paths import NOTEBOOKS_DIR, REPO_ROOT, notebooks
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


# --------------------------------------------------------------------------
# A profile's parameter defaults ([parameters."<notebook>"] tables)
# --------------------------------------------------------------------------

#: Where a run goes and what it targets: set by the caller (runall, papermill,
#: the notebook's own cell), never by a profile's parameter table.
RUN_PARAMETERS = ("profile", "base_url", "results_dir")
#: The first line of the cell papermill injects (`translate_parameters`'
#: comment "Parameters" in papermill/translators.py).
PAPERMILL_COMMENT = "# Parameters"


def _assigned_names(source: str) -> set[str]:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return set()
    return {node.targets[0].id for node in body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}


def parameter_table_problems(tables: Mapping[str, Any],
                             folder: Path = NOTEBOOKS_DIR) -> list[str]:
    """What is wrong with a profile's `[parameters."<notebook>"]` tables, one
    message per problem naming its fix: a table for no notebook of `folder`,
    a name the notebook's parameters cell does not assign (or one of
    `RUN_PARAMETERS`), a value of another type than the notebook's default."""
    found = {p.stem: p for p in notebooks(folder=folder)}
    problems = []
    for nb, table in tables.items():
        if nb not in found:
            close = difflib.get_close_matches(nb, found, n=1)
            hint = f"did you mean \"{close[0]}\"? " if close else ""
            problems.append(f"[parameters.\"{nb}\"] names no notebook: {hint}use a notebook's "
                            f"name without .ipynb, one of {sorted(found)}")
            continue
        defaults = parameter_defaults(found[nb])
        for name, value in table.items():
            where = f"[parameters.\"{nb}\"] {name}"
            if name in RUN_PARAMETERS:
                problems.append(f"{where}: {name} is the run's to set (runall, papermill -p or "
                                "the notebook's cell), not a profile's: remove it")
            elif name not in defaults:
                close = difflib.get_close_matches(name, [d for d in defaults
                                                         if d not in RUN_PARAMETERS], n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                problems.append(f"{where} is not a parameter of {nb}: {hint}its parameters "
                                f"cell assigns {sorted(set(defaults) - set(RUN_PARAMETERS))}")
            elif not _same_kind(defaults[name], value):
                problems.append(f"{where} = {value!r} ({type(value).__name__}) must be a "
                                f"{type(defaults[name]).__name__} like the notebook's default "
                                f"{json.dumps(defaults[name])}")
    return problems


def check_profile_parameters(profile: Profile, folder: Path = NOTEBOOKS_DIR) -> None:
    """ConfigError listing every problem of the profile's parameter tables
    (`parameter_table_problems`), each with its fix."""
    problems = parameter_table_problems(profile.parameters, folder) if profile.parameters else []
    if problems:
        raise ConfigError(f"profile {profile.name!r}: bad [parameters] tables:\n- "
                          + "\n- ".join(problems))


def injected_names(namespace: Mapping[str, Any]) -> set[str]:
    """The names papermill assigned in a notebook's kernel: the cells of
    IPython's input history (`In`, one of the notebook's globals) that start
    with papermill's "# Parameters" line. Empty outside IPython."""
    names: set[str] = set()
    history = namespace.get("In")
    for source in history if isinstance(history, Iterable) else ():
        if isinstance(source, str) and source.lstrip().startswith(PAPERMILL_COMMENT + "\n"):
            names |= _assigned_names(source)
    return names


def interactive(namespace: Mapping[str, Any]) -> bool:
    """A notebook run by hand in IPython (Jupyter): its kernel has an input
    history (`In`) and papermill injected no parameters into it."""
    return isinstance(namespace.get("In"), list) and not injected_names(namespace)


@dataclass
class ProfileParameters:
    """How a profile's table met a notebook's values: `table` (the profile's
    values), `taken` (the names `apply_profile_parameters` set), `explicit`
    (the names papermill passed), `kept` (the values that win over the
    table's: passed explicitly or changed in the notebook)."""
    profile: str
    notebook: str
    table: dict[str, Any] = field(default_factory=dict)
    taken: dict[str, Any] = field(default_factory=dict)
    explicit: set[str] = field(default_factory=set)
    kept: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.table:
            return ""
        used = {k: v for k, v in self.table.items() if k not in self.kept}
        text = (f"profile {self.profile!r} parameters ([parameters.\"{self.notebook}\"]): "
                + (", ".join(f"{k}={v!r}" for k, v in used.items()) or "none used"))
        if self.kept:
            text += ("; kept over the profile's: "
                     + ", ".join(f"{k}={v!r} ({'passed' if k in self.explicit else 'set here'})"
                                 for k, v in self.kept.items()))
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "table": self.table,
                "taken": sorted(self.taken), "kept": self.kept}


def apply_profile_parameters(name: str, profile: Profile, defaults: Mapping[str, Any],
                             params: dict[str, Any],
                             namespace: dict[str, Any] | None = None) -> ProfileParameters:
    """Give a notebook's parameters the profile's defaults for it
    (`[parameters."<name>"]` in the profile's TOML), in `params` and in the
    notebook's globals `namespace`. Returns what happened, for the setup
    output and the results.

    A profile's table replaces the *notebook's* defaults, never a value
    someone chose. setup sees only the notebook's globals, so it tells the two
    apart this way:

    1. A name papermill injected is explicit and kept, whatever its value,
       even when it equals the notebook's default (`papermill -p
       long_prompt_tokens 1536` on the gpu profile means 1536). papermill puts
       its values in a cell of their own that starts with "# Parameters"
       (`PAPERMILL_COMMENT`; tagged "injected-parameters" in the notebook
       file); the kernel ran it, so its source is in IPython's input history
       `In`, which is among the globals (`injected_names`). `runall` passes
       the profile's values that way itself, under the explicit ones.
    2. Otherwise a value that differs from the notebook's own default was
       changed in the parameters cell (an interactive run) and is kept.
    3. Every other value, still the notebook's default, takes the profile's.

    So an interactive run cannot keep a notebook default against its
    profile by leaving it as it is: it passes it with papermill, or uses a
    profile file without that entry. Under LAB_SMOKE=1 the smoke set is
    applied after this and replaces what it names (`lab_utils.smoke`)."""
    check_profile_parameters(profile)
    out = ProfileParameters(profile.name, name, profile.parameters_for(name))
    out.explicit = injected_names(namespace or {}) & set(out.table)
    for key, value in out.table.items():
        current = params.get(key, defaults.get(key))
        if key in out.explicit or current != defaults.get(key):
            if current != value:
                out.kept[key] = current
        elif current != value:
            out.taken[key] = value
    params.update(out.taken)
    if namespace is not None:
        namespace.update(out.taken)
    return out


def profile_defaults(profile: Profile | None, notebook: str | Path,
                     params: Mapping[str, Any] | None = None,
                     smoke: bool = False) -> dict[str, Any]:
    """A notebook's parameters as a run on `profile` passes them: the
    profile's table for it, the notebook's smoke set with `smoke`, then
    `params` (explicit values win), each checked against the notebook's
    defaults; names the notebook does not have are dropped. What `runall`
    gives papermill and the plan checker plans with (over the defaults)."""
    from .smoke import smoke_parameters
    if profile is not None:
        check_profile_parameters(profile)
    path = Path(notebook)
    given = {**(profile.parameters_for(path.stem) if profile is not None else {}),
             **(smoke_parameters(path.stem) if smoke else {})}
    if not given and not params:
        return {}   # nothing to check against the parameters cell (a notebook may have none)
    defaults = parameter_defaults(path)
    values = {**given, **{k: v for k, v in (params or {}).items() if k in defaults}}
    check_parameters(defaults, values)
    return values


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
        return self._start(role, env, flags, arm.name if arm else None, knobs=self.plan)

    def any_engine(self, role: str | None = None, *, env: Mapping[str, str] | None = None,
                   **flags: Any):
        """An engine outside the plan, for Explore widgets (recorded as
        "explore"), or None (printed) when the target cannot serve it."""
        try:
            return self._start(role, env, flags, "explore")
        except ArmUnavailable as exc:
            print(f"cannot explore this engine here: {exc}")
            return None

    def _start(self, role, env, flags, arm_name, knobs=None, ahead=None):
        engine = self.engines.get(role, env=env, knobs=knobs, ahead=ahead, **flags)
        engine.arm = arm_name
        if engine.started_beside and self.plan is not None:  # a key: name its arm
            engine.started_beside = next((a.name for a in self.plan.arms
                                          if a.key == engine.started_beside),
                                         engine.started_beside)
        started = ""
        if engine.server is not None and engine.server.startup_s is not None:
            started = f", started in {engine.server.startup_s:.1f} s"
            if engine.started_beside:
                started += f" side by side with [{engine.started_beside}]"
        elif getattr(engine.server, "reused_from", None):
            started = f", already running (started by {engine.server.reused_from}, shared by the run)"
        print(f"[{arm_name or engine.label}] {engine.command}{started}")
        for note in engine.remote_notes:
            print(f"  remote: {note}")
        self.results.add_engine(engine)
        return engine

    def arm(self, arm: str | Arm):
        """The engine of a declared arm, or None (noted and printed) when this
        target cannot serve it: a remote server with other flags, or an
        `optional` arm whose server failed to start (its log's root cause)."""
        a = self.plan.arm(arm) if self.plan is not None else arm
        if not isinstance(a, Arm):
            raise ConfigError(f"{self.name} has no plan: pass plan= to lab.setup")
        from .capabilities import arm_why_not
        why = arm_why_not(self.profile, a.role, a.flags)
        if why:  # e.g. a quantized model this machine's vLLM build cannot run
            self.skip(a, f"the capability probe: {why}")
            return None
        shared = self.engines.shared
        try:
            self.engines.shared = shared and not a.fresh  # a fresh arm's is never lent
            return self._start(a.role, self._arm_env(a), dict(a.flags),
                               a.name if self.plan is not None else None, knobs=self.plan,
                               ahead=[(x.role, dict(x.flags), self._arm_env(x))
                                      for x in self._arms_after(a)])
        except ArmUnavailable as exc:
            self.skip(a, str(exc))
        except ServerError as exc:
            if not a.optional:
                raise
            from .vllm_logs import root_cause
            self.engines.close()  # a server that failed to start leaves nothing behind
            self.skip(a, f"its server did not start: {root_cause(str(exc)) or exc}")
        finally:
            self.engines.shared = shared
        return None

    def _arm_env(self, a: Arm) -> dict[str, str] | None:
        """The arm's environment (`cpu_tuning.arm_env`: a fresh arm's engine
        core is spawned, as `vllm serve` does, where the profile forks it)."""
        from .cpu_tuning import arm_env
        return arm_env(self.profile.cpu_binding, a.env, a.fresh) or None

    def _arms_after(self, a: Arm) -> list[Arm]:
        """The plan's other arms in the order a notebook asks for them after
        `a` (those after it, then those before), any of which may start side by
        side with it (`EnginePool.get(ahead=...)` starts the first not started
        yet). None where `a` or an arm is `fresh` (its start is what the
        notebook measures, e.g. 03's cold starts) or the plan is not this
        notebook's."""
        arms = list(self.plan.arms) if self.plan is not None else []
        if a not in arms or a.fresh:
            return []
        i = arms.index(a)
        return [x for x in arms[i + 1:] + arms[:i] if not x.fresh]

    def arms_together(self, names: Sequence[str], needs: str) -> dict[str, Any]:
        """The engines of arms that must all run at once ({name: engine}, the
        plan's `together`); NotebookSkipped naming each missing arm and why,
        when this target cannot serve one of them (`needs`: what the notebook
        needs them for, e.g. "model tiering needs both tiers")."""
        from .errors import NotebookSkipped
        engines = {name: self.arm(name) for name in names}
        missing = [name for name, engine in engines.items() if engine is None]
        if missing:
            whys = self.results.data.get("skipped_arms", {})
            raise NotebookSkipped(f"{needs}; {missing} cannot run on profile "
                                  f"{self.profile.name!r}: "
                                  + "; ".join(str(whys.get(n, "")) for n in missing))
        return engines

    def serve_with(self, profile: Profile) -> None:
        """Start this notebook's engines from `profile` from now on (e.g. the
        profile without an environment variable that would override a flag):
        the running engines stop, the pool keeps its log folder and size."""
        keep, log_dir = self.engines.keep, self.engines.log_dir
        self.engines.close()
        self.engines = EnginePool(profile, log_dir=log_dir, keep=keep)

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
    notebook's own defaults, load the profile and give the notebook its
    profile's parameter defaults (`apply_profile_parameters`: explicit and
    edited values win; printed), then open results and engines. Under
    LAB_SMOKE=1 the notebook's smoke parameters replace them, in `namespace`
    too (`lab_utils.smoke`). `plan` is the experiment module's
    `plan(profile, params)`: the engines this notebook may start
    (`lab_utils.arms`), checked, printed and written to the results before
    anything starts."""
    from . import smoke
    defaults = parameter_defaults(f"{name}.ipynb")
    params = {k: namespace[k] for k in defaults if k in namespace}
    check_parameters(defaults, params)
    profile = load_profile(params.get("profile", "cpu"), base_url=params.get("base_url", ""))
    from_profile = apply_profile_parameters(name, profile, defaults, params, namespace)
    if from_profile.table:
        print(from_profile.describe())
    changed = smoke.apply(name, defaults, params, namespace)
    if changed:
        check_parameters(defaults, params)
        print(f"smoke run ({smoke.ENV_FLAG}=1, {smoke.SMOKE_FILE.name}): "
              + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
    results_dir = Path(params.get("results_dir", "results"))
    if not results_dir.is_absolute():
        results_dir = (NOTEBOOKS_DIR / results_dir).resolve()
    results = Results(name, results_dir, profile.name)
    print(f"machine: {summary_line(results.data['environment']['machine'])}")
    if interactive(namespace) and (line := setup_line(profile.device)):
        print(line)
    results.data["parameters"] = params
    if from_profile.table:
        results.data["profile_parameters"] = from_profile.to_dict()
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
    if profile.is_remote:
        describe_remote(engines, results, declared)
    return NotebookContext(name, profile, engines, results, params, declared)


def describe_remote(engines: EnginePool, results: Results, plan: Plan | None) -> None:
    """Print and record what the remote server is and where each of the
    plan's arms runs there (as it is, emulated, mapped, or skipped, and why)."""
    from .remote import Placement, describe_placements, mapped_arms, place
    info = engines.server_info()
    print(info.describe())
    results.data["server"] = info.to_dict()
    if plan is not None:
        mapped = mapped_arms()
        placed = {a.name: (Placement(mapped[a.key], notes=["mapped in LAB_REMOTE_ARMS"])
                           if a.key in mapped else place(a, plan, info)) for a in plan.arms}
        print("arms on the remote server:\n" + describe_placements(placed))
        results.data["remote_arms"] = {
            n: ({"runs": p.label, "emulated": p.emulation.what if p.emulation else None,
                 "notes": p.notes} if isinstance(p, Placement) else {"skipped": p})
            for n, p in placed.items()}
    results.save()


def explore(function: Callable[..., Any], plot: Callable[[Any], Any] | None = None,
            **controls: Any):
    """Widgets that re-run `function(**values)` when "Run" is pressed.

    `controls` maps argument names to ipywidgets (or to fixed values). Nothing
    runs until the button is pressed, so headless runs are unaffected. With
    `plot`, `plot(result)` (a matplotlib Figure, or None) is drawn beside the
    table the function returns (`lab_utils.plots.table_figure` draws one)."""
    import ipywidgets as w
    from IPython.display import display

    widgets = {k: v for k, v in controls.items() if isinstance(v, w.ValueWidget)}
    fixed = {k: v for k, v in controls.items() if k not in widgets}
    for widget in widgets.values():
        if hasattr(widget, "continuous_update"):
            widget.continuous_update = False
    button = w.Button(description="Run", button_style="primary", icon="play")
    out = w.Output(layout=w.Layout(flex="1 1 auto", overflow="auto"))
    # the figure keeps its width: beside the table where both fit, else below it
    figure = w.Output(layout=w.Layout(flex="0 0 auto", min_width="480px")) \
        if plot is not None else None

    def on_click(_):
        out.clear_output()
        if figure is not None:
            figure.clear_output()
        with out:
            button.disabled = True
            try:
                result = function(**fixed, **{k: v.value for k, v in widgets.items()})
                if result is not None:
                    display(result)
            finally:
                button.disabled = False
        if figure is not None and result is not None:
            with figure:  # a failing plot shows its error here, the table stays
                show_figure(plot(result))

    button.on_click(on_click)
    shown = (w.HBox([out, figure], layout=w.Layout(flex_flow="row wrap",
                                                   align_items="flex-start"))
             if figure is not None else out)
    box = w.VBox([*widgets.values(), button, shown])
    display(box)
    return box


def show_figure(fig: Any) -> None:
    """Display a matplotlib Figure once (a widget callback is not a cell: the
    inline backend would not show it) and close it; None shows nothing."""
    if fig is None:
        return
    import matplotlib.pyplot as plt
    from IPython.display import display
    display(fig)
    plt.close(fig)


__all__ = [
    "PAPERMILL_COMMENT",
    "REPO_ROOT",
    "RUN_PARAMETERS",
    "NotebookContext",
    "ProfileParameters",
    "apply_profile_parameters",
    "check_parameters",
    "check_profile_parameters",
    "explore",
    "injected_names",
    "parameter_defaults",
    "parameter_table_problems",
    "profile_defaults",
    "setup",
]
