"""Arms as data: the engines a notebook starts, declared before anything starts.

Every experiment module has ``plan(profile, params) -> Plan``: the notebook's
engine arms on that profile for those parameters (the notebook's own,
after smoke overrides). Each :class:`Arm` names its model role, its technique
flags (layered on the profile's ``[engine]`` flags), its extra environment, the
arm it is compared with (``reference``, the plan's first arm by default) and
the one ``knob`` it changes against that arm. A plan can be read, printed and
checked without starting anything (:meth:`Plan.problems`); ``lab.setup(...,
plan=module.plan)`` makes it the notebook's, and from then on
``ctx.engine(...)`` starts only engines the plan declares, and
``ctx.arm(name)`` / :func:`run` start an arm with the per-arm error handling
written once: an arm the target cannot serve is noted and skipped.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from .profiles import ConfigError

T = TypeVar("T")

#: The knob name of an arm's model role (another checkpoint of the profile).
ROLE = "model_role"


def env_knob(name: str) -> str:
    """The knob name of an environment variable of the server."""
    return f"env:{name}"


def engine_key(role: str | None = None, flags: Mapping[str, Any] | None = None,
               env: Mapping[str, Any] | None = None) -> str:
    """Canonical text of one engine: its flags, model role and extra
    environment ('baseline' when none). `EnginePool` keys its engines by it."""
    items = {**(flags or {}), **({ROLE: role} if role else {}),
             **{env_knob(k): str(v) for k, v in (env or {}).items()}}
    if not items:
        return "baseline"
    return ",".join(f"{k}={json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v}"
                    for k, v in sorted(items.items()))


@dataclass(frozen=True)
class Arm:
    """One engine configuration of a notebook.

    ``knob`` is the setting this arm changes against ``reference``: a flag name
    (``"enable_prefix_caching"``), ``"model_role"``, ``"env:NAME"``, or a tuple
    of flags that vLLM only accepts together (declared, so still checked).
    ``None`` for the plan's baseline arm. ``optional`` arms (e.g. a format this
    CPU may not run) are skipped with a note when their server fails to start;
    any other arm's failure stops the notebook. A ``fresh`` arm's engine is
    always a process of the notebook's own that has served nothing (03 times
    the first request after a start): the run's broker never lends it one, so
    a run plans no shared engine for it (`runall.planned_keys`)."""
    name: str
    flags: Mapping[str, Any] = field(default_factory=dict)
    role: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    knob: str | tuple[str, ...] | None = None
    reference: str | None = None
    title: str = ""
    optional: bool = False
    fresh: bool = False

    @property
    def key(self) -> str:
        return engine_key(self.role, self.flags, self.env)

    def settings(self) -> dict[str, Any]:
        """Everything that makes this engine what it is, one entry per knob."""
        return {**self.flags, ROLE: self.role,
                **{env_knob(k): str(v) for k, v in self.env.items()}}


def knobs_between(a: Arm, b: Arm) -> set[str]:
    """The knobs in which two arms differ (a flag absent on one side counts)."""
    sa, sb = a.settings(), b.settings()
    return {k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k)}


def _knob_set(knob: str | tuple[str, ...] | None) -> set[str]:
    if knob is None:
        return set()
    return {knob} if isinstance(knob, str) else set(knob)


@dataclass(frozen=True)
class Plan:
    """A notebook's engine arms; the first is its baseline.

    ``together`` lists groups of arms that must be alive at the same time (the
    pool keeps that many servers); ``notes`` say which arms were left out on
    this profile and why."""
    notebook: str
    arms: tuple[Arm, ...]
    together: tuple[tuple[str, ...], ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", tuple(self.arms))
        object.__setattr__(self, "together", tuple(tuple(g) for g in self.together))
        object.__setattr__(self, "notes", tuple(self.notes))
        if not self.arms:
            raise ConfigError(f"{self.notebook}: a plan needs at least its baseline arm")

    @property
    def baseline(self) -> Arm:
        return self.arms[0]

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.arms]

    def arm(self, name: str | Arm) -> Arm:
        if isinstance(name, Arm):
            return name
        for a in self.arms:
            if a.name == name:
                return a
        raise ConfigError(f"{self.notebook} declares no arm {name!r}; its plan has "
                          f"{self.names}")

    def reference_of(self, arm: str | Arm) -> Arm | None:
        a = self.arm(arm)
        if a is self.baseline and a.reference is None:
            return None
        return self.arm(a.reference or self.baseline.name)

    def find(self, role: str | None, flags: Mapping[str, Any],
             env: Mapping[str, Any] | None = None) -> Arm | None:
        """The declared arm of exactly this engine, or None."""
        key = engine_key(role, flags, env)
        return next((a for a in self.arms if a.key == key), None)

    @property
    def keep(self) -> int:
        """How many servers must be alive at once (1 unless `together` says more)."""
        return max([1, *(len(g) for g in self.together)])

    def problems(self) -> list[str]:
        """What is wrong with the plan as data: duplicate names or engines,
        unknown references, and every arm that does not differ from its
        reference in exactly the knob it names."""
        out = []
        seen: dict[str, str] = {}
        for a in self.arms:
            if a.name in seen.values():
                out.append(f"arm name {a.name!r} is used twice")
            if a.key in seen:
                out.append(f"arms {seen[a.key]!r} and {a.name!r} are the same engine ({a.key})")
            seen[a.key] = a.name
        for group in self.together:
            out += [f"together names unknown arm {n!r}" for n in group if n not in self.names]
        for a in self.arms:
            try:
                ref = self.reference_of(a)
            except ConfigError:
                out.append(f"arm {a.name!r}: reference {a.reference!r} is not in the plan")
                continue
            if ref is None:
                if a.knob is not None:
                    out.append(f"baseline arm {a.name!r} names a knob ({a.knob!r})")
                continue
            if ref is a:
                out.append(f"arm {a.name!r} is its own reference")
                continue
            changed, named = knobs_between(a, ref), _knob_set(a.knob)
            if not named:
                out.append(f"arm {a.name!r} names no knob against {ref.name!r} "
                           f"(it changes {sorted(changed) or 'nothing'})")
            elif changed != named:
                out.append(f"arm {a.name!r} should change only {sorted(named)} against "
                           f"{ref.name!r}, but changes {sorted(changed) or 'nothing'}")
        return out

    def check(self) -> Plan:
        """The plan itself, or ConfigError listing its problems."""
        problems = self.problems()
        if problems:
            raise ConfigError(f"{self.notebook}'s plan is inconsistent:\n- "
                              + "\n- ".join(problems))
        return self

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for a in self.arms:
            ref = self.reference_of(a)
            knob = a.knob if isinstance(a.knob, str) or a.knob is None else "+".join(a.knob)
            out.append({"arm": a.name, "title": a.title, "reference": ref.name if ref else "",
                        "knob": knob or "", "role": a.role or "",
                        "flags": json.dumps(dict(a.flags), sort_keys=True),
                        "env": json.dumps(dict(a.env), sort_keys=True),
                        "optional": a.optional,
                        "together": [n for g in self.together if a.name in g for n in g
                                     if n != a.name]})
        return out

    def frame(self):
        """The plan as a table (one row per arm), for a notebook to show."""
        import pandas as pd
        frame = pd.DataFrame(self.rows()).set_index("arm")
        frame.attrs["notes"] = list(self.notes)
        return frame

    def to_dict(self) -> dict[str, Any]:
        """The plan for the results file."""
        return {"baseline": self.baseline.name, "arms": self.rows(),
                "together": [list(g) for g in self.together], "notes": list(self.notes)}

    def describe(self) -> str:
        lines = [f"plan of {self.notebook}: {len(self.arms)} engine arm(s)"]
        for a in self.arms:
            ref = self.reference_of(a)
            change = (f"{a.knob if isinstance(a.knob, str) else '+'.join(a.knob)} vs {ref.name}"
                      if ref else "baseline")
            flags = a.key if a.key != "baseline" else "the profile's flags only"
            fresh = "; a new engine of its own each time" if a.fresh else ""
            lines.append(f"  {a.name}: {change}; {flags}{fresh}")
        lines += [f"  alive together: {' + '.join(g)}" for g in self.together]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def with_references(catalogue: Mapping[str, Arm], names: Iterable[str],
                    needs_reference: Callable[[Arm], bool] = lambda a: True) -> list[str]:
    """`names` in order, each arm of `catalogue` for which `needs_reference`
    holds preceded by its `reference` (once); an unknown name is a ConfigError
    listing the catalogue."""
    out: list[str] = []
    for n in names:
        if n not in catalogue:
            raise ConfigError(f"unknown arm {n!r}; choose from {sorted(catalogue)}")
        ref = catalogue[n].reference
        if ref and needs_reference(catalogue[n]) and ref not in out:
            out.append(ref)
        if n not in out:
            out.append(n)
    return out


def unavailable(profile, arm: Arm) -> str:
    """Why `profile` cannot serve `arm` before anything starts ("" if it
    can): a model role it names no model for, or other flags or another model
    on a remote server (which serves one model with fixed flags)."""
    if arm.role is not None and arm.role not in profile.models:
        return f"profile {profile.name!r} names no model for role {arm.role!r}"
    if profile.is_remote and (arm.role or arm.flags or arm.env):
        return "the remote server serves one model with fixed flags"
    return ""


def catalogue_plan(notebook: str, catalogue: Mapping[str, Arm], names: Sequence[str],
                   why_not: Callable[[Arm], str], needs_reference: Callable[[Arm], bool]
                   = lambda a: True, notes: Sequence[str] = ()) -> Plan:
    """A plan of the catalogue's arms `names` (`with_references`), leaving out
    (with a note) each arm `why_not` gives a reason for and each whose needed
    reference is left out. A kept arm is compared with its reference in its
    `knob`; one whose reference comes later (e.g. float32 after bfloat16) is
    the reference of that one, compared the other way round. The first kept
    arm is the baseline; ConfigError when none is kept."""
    notes, keep = list(notes), []
    for n in with_references(catalogue, names, needs_reference):
        a = catalogue[n]
        why = why_not(a)
        if not why and a.reference and needs_reference(a) and a.reference not in keep:
            ref_why = why_not(catalogue[a.reference]) if a.reference in catalogue else ""
            why = f"its reference {a.reference!r} cannot run here" + (f" ({ref_why})"
                                                                     if ref_why else "")
        if why:
            notes.append(f"arm {n!r} skipped: {why}")
        else:
            keep.append(n)
    out = []
    for i, n in enumerate(keep):
        a, ref, knob = catalogue[n], None, None
        if a.reference in keep[:i]:
            ref, knob = a.reference, a.knob
        elif i:
            back = next((m for m in keep[:i] if catalogue[m].reference == n), None)
            if back is None:
                raise ConfigError(f"arm {n!r} has no one-knob reference among {keep[:i]}: "
                                  f"ask for {a.reference!r} too")
            ref, knob = back, catalogue[back].knob
        out.append(replace(a, knob=knob, reference=ref))
    if not out:
        raise ConfigError(f"{notebook}: no arm of {list(names)} can run on this profile: "
                          + "; ".join(notes))
    return Plan(notebook, tuple(out), notes=tuple(notes))


def run(ctx, arms: Iterable[str | Arm], measure: Callable[[Arm, Any], T]) -> dict[str, T]:
    """``measure(arm, engine)`` for each arm in order, on that arm's engine;
    arms the target cannot serve are noted and skipped (`ctx.arm`)."""
    out: dict[str, T] = {}
    for a in arms:
        a = ctx.plan.arm(a)
        engine = ctx.arm(a)
        if engine is not None:
            out[a.name] = measure(a, engine)
    return out


__all__ = ["ROLE", "Arm", "Plan", "catalogue_plan", "engine_key", "env_knob", "knobs_between",
           "run", "unavailable", "with_references"]
