"""Every notebook's engines come from its declared plan (`lab_utils.arms`).

For each notebook, its module's `plan(profile, params)` is read on the `cpu`
profile with the notebook's default and smoke parameters, on an AVX-512, an
AVX2-only and an AMX machine's probe results (no engine starts), and each arm's command
line is parsed by the installed vLLM's own argument parser: what vLLM sees
changing between an arm and its reference must be exactly the knob the arm
names. The notebook must hand that plan to `lab.setup`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils import capabilities
from lab_utils.experiments import module_for
from lab_utils.notebook import parameter_defaults
from lab_utils.paths import NOTEBOOKS_DIR
from lab_utils.profiles import engine_argv, load_profile
from lab_utils.smoke import smoke_parameters
from test_capabilities import AMX, AVX2, AVX512

NOTEBOOKS = sorted(p.stem for p in NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
MACHINES = {"avx512": AVX512, "avx2": AVX2, "amx": AMX}

_PARSE = r"""
import json, sys
sys.argv = ["vllm"]
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
p = make_arg_parser(FlexibleArgumentParser())
out = []
for argv in json.loads(sys.stdin.read()):
    ns = vars(p.parse_args(argv))
    out.append({k: repr(v) for k, v in ns.items() if k not in ("host", "port")})
print(json.dumps(out))
"""


def plans_on(machine: str, monkeypatch) -> dict[tuple[str, str], object]:
    caps = capabilities.Capabilities(MACHINES[machine])
    monkeypatch.setattr(capabilities, "probe", lambda *a, **k: caps)
    cpu = load_profile("cpu")
    out = {}
    for nb in NOTEBOOKS:
        defaults = parameter_defaults(f"{nb}.ipynb")
        for kind, params in (("defaults", defaults),
                             ("smoke", {**defaults, **smoke_parameters(nb)})):
            if hasattr(module_for(nb), "plan"):
                out[(nb, kind)] = module_for(nb).plan(cpu, params)
    return out


@pytest.fixture(scope="module")
def parsed():
    """Every plan's arms on both machines, with vLLM's parse of each command line."""
    mp = pytest.MonkeyPatch()
    try:
        plans = {(m, *k): p for m in MACHINES for k, p in plans_on(m, mp).items()}
    finally:
        mp.undo()
    cpu = load_profile("cpu")
    arms = [(key, a) for key, plan in plans.items() for a in plan.arms]
    argvs = [engine_argv(cpu, a.flags, port=8000, model="MODEL")[5:] for _, a in arms]
    proc = subprocess.run([sys.executable, "-c", _PARSE], input=json.dumps(argvs),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    namespaces = json.loads(proc.stdout.strip().splitlines()[-1])
    seen = {(key, a.name): ns for (key, a), ns in zip(arms, namespaces)}
    return plans, seen


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_each_arm_changes_exactly_its_knob_as_vllm_parses_it(notebook, parsed):
    plans, seen = parsed
    assert hasattr(module_for(notebook), "plan"), f"{notebook}'s module declares no plan()"
    cpu = load_profile("cpu")
    for (machine, nb, kind), plan in plans.items():
        if nb != notebook:
            continue
        where = f"{nb} ({kind} parameters, {machine} probe)"
        assert plan.notebook == nb, where
        assert plan.problems() == [], where
        for a in plan.arms:
            ref = plan.reference_of(a)
            if ref is None:
                assert a is plan.baseline, where
                continue
            mine, theirs = seen[((machine, nb, kind), a.name)], seen[((machine, nb, kind), ref.name)]
            changed = {k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
            if a.role != ref.role:
                changed.add("model_role")
            env_a, env_r = cpu.server_env(a.env), cpu.server_env(ref.env)
            changed |= {f"env:{k}" for k in set(env_a) | set(env_r) if env_a.get(k) != env_r.get(k)}
            named = {a.knob} if isinstance(a.knob, str) else set(a.knob or ())
            assert changed == named, (f"{where}: arm {a.name!r} against {ref.name!r}: vLLM sees "
                                      f"{sorted(changed)} change, the plan names {sorted(named)}")


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_the_notebook_runs_its_modules_plan(notebook):
    nb = json.loads((NOTEBOOKS_DIR / f"{notebook}.ipynb").read_text())
    source = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    module = module_for(notebook).__name__.rsplit(".", 1)[1]
    assert f'lab.setup("{notebook}", globals(), plan=' in source, notebook
    call = source.split(f'lab.setup("{notebook}", globals(), plan=', 1)[1].split(")", 1)[0]
    alias = call.rsplit(".", 1)[0]
    assert (f"import {module} as {alias}" in source or f"import {module}\n" in source
            and alias == module), f"{notebook}: plan={call} is not {module}.plan"


def test_runall_plan_prints_without_starting_and_fails_on_a_refused_plan(monkeypatch, capsys):
    from lab_utils import runall
    from lab_utils.experiments import baseline
    from lab_utils.server import lab_server_processes
    assert runall.main(["--plan", "--only", "00"]) == 0
    out = capsys.readouterr().out
    # the profile's own flags, and the same with vLLM's profiler on (profile_tokens > 0)
    assert "plan of 00_baseline: 2 engine arm(s)" in out and not lab_server_processes(os.getpid())
    from lab_utils.arms import Arm, Plan
    monkeypatch.setattr(baseline, "plan", lambda profile, params: Plan(
        "00_baseline", (Arm("b"), Arm("x", {"max_num_batched_tokenz": 1}, knob="max_num_batched_tokenz"))))
    assert runall.main(["--plan", "--only", "00"]) == 1
    assert "unknown vLLM option 'max_num_batched_tokenz'" in capsys.readouterr().out
