"""Execute every notebook headless with papermill into `runs/<timestamp>/`.

    python -m lab_utils.runall                    # all notebooks, cpu profile
    python -m lab_utils.runall --only 00 02       # a subset (name prefixes)
    python -m lab_utils.runall --smoke            # smoke parameters: a quick check of everything
    python -m lab_utils.runall --profile remote --base-url http://host:8000
    python -m lab_utils.runall --plan --profile gpu   # each plan checked (lab_utils.plan); starts none

Each run folder holds the executed notebooks, `results/` (findings JSON and
per-request JSONL), `logs/` (engine logs) and `index.md`/`index.html`;
`runs/latest` points at the newest. A failing notebook is reported and the
others still run; the exit status is 1 if any failed, 130 if interrupted.
Off the cpu profile each notebook runs without its cells of CPU reference
runs (`notebook_input`, `lab_utils.device_text`).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import run_estimate
from .paths import NOTEBOOKS_DIR, RUNS_DIR, notebooks
from .report import build_index


def _wait_for_no_orphans(timeout_s: float = 30) -> list[tuple[int, str]]:
    """Servers whose kernel is gone must stop by themselves (PDEATHSIG); any
    still alive after `timeout_s` are leaks: they are returned, then killed."""
    import signal
    from .server import orphan_servers
    deadline = time.monotonic() + timeout_s
    while (leaks := orphan_servers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in leaks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return leaks


def nothing_measured(results_dir: Path, name: str) -> str | None:
    """Why a notebook that ran measured nothing (every arm skipped: no arm, no
    finding, no request record), or None when it measured something."""
    path = Path(results_dir) / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # no results file: nothing to judge by (not a lab notebook)
    records = Path(results_dir) / name
    if data.get("arms") or data.get("findings") or any(
            f.stat().st_size for f in records.glob("*.jsonl")):
        return None
    skipped = data.get("skipped_arms") or {}
    if skipped:
        return "; ".join(f"{arm}: {why}" for arm, why in skipped.items())
    return "no arm ran and nothing was recorded"


def kernel_config():
    """Kernels papermill starts get CurveZMQ keys from jupyter_client (its
    `transport_encryption`, "auto": where the kernelspec declares "curve", as
    ipykernel's does), so their traffic is encrypted and ipykernel does not warn
    "Kernel is running over TCP without encryption" once per notebook. A pyzmq
    built without CurveZMQ keeps the plain default (and the warning)."""
    import zmq
    from traitlets.config import Config
    return Config({"KernelManager": {"transport_encryption": "auto"}} if zmq.has("curve")
                  else {})


@functools.cache
def kernel_manager_class():
    """jupyter_client's `AsyncKernelManager`, except that shutting a kernel down
    does not interrupt it first. jupyter_client sends SIGINT before every
    shutdown request; papermill shuts the kernel down as soon as the reply to
    its last request (`kernel_info`) arrives, and a kernel still finishing
    that request's handler takes the signal there and logs
    "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel." into the
    run's progress line, though every cell ran. The kernels runall shuts down
    are idle (all cells ran, or one failed), and a kernel that does not stop
    on the request is killed after jupyter_client's `shutdown_wait_time`;
    engines the notebook started stop with it (PR_SET_PDEATHSIG, and runall
    checks for orphans)."""
    from jupyter_client import AsyncKernelManager

    class ShutdownWithoutInterrupt(AsyncKernelManager):
        async def _async_interrupt_kernel(self) -> None:
            if self.shutting_down:
                return
            await super()._async_interrupt_kernel()

    return ShutdownWithoutInterrupt


def notebook_input(path: Path, profile, params: dict | None = None):
    """What papermill executes for the notebook at `path` on `profile`: the
    path itself on the cpu profile (the notebook as committed), else the
    notebook for that device (`lab_utils.device_text.for_device`): its cells of
    CPU reference runs replaced by a note, with the plan checker's estimates
    for the GPU `LAB_GPU` names (or the command that prints them)."""
    if profile.device == "cpu":
        return str(path)
    import nbformat

    from .device_text import for_device
    from .plan import estimate_note
    nb = nbformat.read(str(path), as_version=4)
    return for_device(nb, profile.device, note=estimate_note(path, profile, params))


def _name_input(output: Path, path: Path) -> None:
    """papermill records a NotebookNode input as the whole notebook in the
    output's metadata (`papermill.input_path`): name the source file instead."""
    try:
        data = json.loads(output.read_text())
    except (OSError, ValueError):
        return
    meta = data.get("metadata", {}).get("papermill", {})
    if isinstance(meta.get("input_path"), dict):
        meta["input_path"] = str(path)
        output.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def _point_latest(run_dir: Path) -> None:
    latest = run_dir.parent / "latest"
    tmp = run_dir.parent / ".latest.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, latest)


def run_all(profile: str = "cpu", base_url: str = "", only: list[str] | None = None,
            runs_dir: Path = RUNS_DIR, parameters: dict | None = None,
            notebooks_dir: Path = NOTEBOOKS_DIR, smoke: bool = False) -> int:
    """Execute the notebooks. Each gets, as papermill parameters, its
    profile's defaults for it (`[parameters."<notebook>"]` in the profile's
    TOML), then with `smoke` its smoke parameters (`lab_utils.smoke`), then
    the explicit `parameters`, which always win (`lab.setup` keeps every
    value papermill injected, `lab_utils.notebook.apply_profile_parameters`)."""
    from .facts import device
    from .notebook import check_profile_parameters
    from .plan import named_gpu
    from .profiles import load_profile

    todo = notebooks(only, notebooks_dir)  # fail before making a run folder
    target = load_profile(profile, base_url=base_url)
    check_profile_parameters(target)
    if target.device == "cuda" and named_gpu():
        device(named_gpu())  # an unknown LAB_GPU fails here, naming the known ones
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(runs_dir) / stamp
    for sub in ("notebooks", "results", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    _point_latest(run_dir)
    from .machine import fingerprint
    same = run_estimate.key(profile, base_url, smoke, parameters,
                            None if target.is_remote else fingerprint())
    status = {**same, "started": _dt.datetime.now().isoformat(timespec="seconds"),
              "finished": None,
              "notebooks": [{"name": p.stem, "status": "pending"} for p in todo]}
    estimates = run_estimate.previous_seconds(runs_dir, same, exclude=run_dir)

    def save_status() -> None:
        (run_dir / "status.json").write_text(json.dumps(status, indent=2))
        build_index(run_dir)

    def params_for(path: Path) -> dict:
        return run_params(target, path, smoke=smoke, results_dir=run_dir / "results",
                          base_url=base_url, parameters=parameters, profile_name=profile)

    save_status()
    print(f"run folder: {run_dir}  ({len(todo)} notebooks, profile {profile})", flush=True)
    expected = run_estimate.expected_line([p.stem for p in todo], estimates)
    if expected:
        print(expected, flush=True)
    with shared_engines(target, todo, params_for) as broker:
        code = _run_each(todo, status, run_dir, target, params_for, save_status, notebooks_dir,
                         estimates)
        if broker is not None:
            status["shared_engines"] = broker.describe()
    if code == 130:
        return code
    status["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    save_status()
    print(f"report: {run_dir / 'index.md'}", flush=True)
    return code


def run_params(target, path: Path, *, smoke: bool, results_dir, base_url: str = "",
               parameters: dict | None = None, profile_name: str = "") -> dict:
    """The papermill parameters of notebook `path` in a run on profile `target`
    (`profile_name`: as the run was asked for it; the profile's name if empty)."""
    from .notebook import profile_defaults
    return {"profile": profile_name or target.name, "base_url": base_url,
            "results_dir": str(Path(results_dir).resolve()),
            **profile_defaults(target, path, smoke=smoke), **(parameters or {})}


def planned_keys(paths: Sequence[Path], profile, params: Mapping[str, Mapping] | None = None,
                 ) -> list[tuple[str, list[str]]]:
    """Each notebook with the configuration keys its declared plan starts on
    `profile` (`lab_utils.plan.check_notebook`), in run order. A notebook whose
    plan cannot be derived ahead (it reads an earlier notebook's findings)
    plans nothing: its engines start and stop as without a broker; nor does a
    `fresh` arm (never lent), so no idle engine waits for it."""
    from . import plan as checker
    from .engine_lease import config_key
    out = []
    for path in paths:
        keys: list[str] = []
        with contextlib.suppress(Exception):
            check = checker.check_notebook(Path(path), profile, None,
                                           dict((params or {}).get(Path(path).stem, {})))
            keys = [config_key(e.command) for e in check.engines if not e.arm.fresh]
        out.append((Path(path).stem, keys))
    return out


@contextlib.contextmanager
def shared_engines(target, todo: list[Path], params_for):
    """The run's engine broker (`lab_utils.engine_share`) for local profiles,
    its URL in LAB_ENGINE_SHARE for the kernels, with the demand the notebooks'
    plans declare; None on a remote target, inside a run that has one already,
    or with LAB_SHARE_ENGINES=0 (every notebook starts its own)."""
    from . import engine_share
    if (target.is_remote or engine_share.broker_url()
            or os.environ.get("LAB_SHARE_ENGINES", "1") == "0"):
        yield None
        return
    demand = planned_keys(todo, target, {p.stem: params_for(p) for p in todo})
    with engine_share.Broker(demand) as broker:
        os.environ[engine_share.SHARE_ENV] = broker.url
        try:
            yield broker
        finally:
            os.environ.pop(engine_share.SHARE_ENV, None)


def _run_each(todo, status, run_dir, target, params_for, save_status, notebooks_dir,
              estimates=None) -> int:
    """Each notebook in turn (papermill); 130 when interrupted, 1 if one failed.
    `estimates`: `run_estimate.previous_seconds`, printed as each starts and ends.
    In a terminal papermill's bar counts each notebook's cells (on the line of its
    name, gone when it ends); a log (CI) gets one line per notebook."""
    import papermill as pm
    estimates = estimates or {}
    code = 0
    for i, (path, entry) in enumerate(zip(todo, status["notebooks"]), 1):
        params = params_for(path)
        entry["status"] = "running"
        save_status()
        name = f"[{i}/{len(todo)}] {path.stem}{run_estimate.before(path.stem, estimates)}"
        bar = ({"desc": name, "leave": False, "unit": "cell", "file": sys.stderr}
               if sys.stderr.isatty() else False)
        if not bar:
            print(f"{name} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        output = run_dir / "notebooks" / path.name
        source = str(path)  # or, off the cpu profile, a notebook made for the device
        try:
            source = notebook_input(path, target, params)
            pm.execute_notebook(source, str(output),
                                parameters=params, kernel_name="python3",
                                cwd=str(notebooks_dir), progress_bar=bar,
                                report_mode=False, config=kernel_config(),
                                kernel_manager_class=kernel_manager_class())
            entry["status"] = "ok"
            why = nothing_measured(run_dir / "results", path.stem)
            if why is not None:  # it ran, but every arm was skipped: never "ok"
                entry["status"], entry["skipped"] = "skipped", why
        except KeyboardInterrupt:
            entry["status"] = "interrupted"
            entry["seconds"] = round(time.perf_counter() - t0, 1)
            if not isinstance(source, str):
                _name_input(output, path)
            for rest in status["notebooks"][i:]:
                rest["status"] = "not run (interrupted)"
            status["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
            save_status()
            print(f"interrupted: results so far are in {run_dir}", flush=True)
            return 130
        except Exception as exc:  # a failing notebook must not stop the others
            if getattr(exc, "ename", "") == "NotebookSkipped":  # the target cannot serve it
                entry["status"], entry["skipped"] = "skipped", str(getattr(exc, "evalue", exc))
            else:
                entry["status"] = "failed"
                entry["error"] = (str(exc) if exc.__class__.__name__ == "PapermillExecutionError"
                                  else traceback.format_exc())
                code = 1
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        if not isinstance(source, str):  # a notebook made for this device, not the file
            _name_input(output, path)
        leaks = _wait_for_no_orphans()
        if leaks:  # a notebook's engine outlived its kernel: report it, then clean up
            entry["status"] = "failed"
            entry["error"] = (entry.get("error", "") + "\nservers left running after the "
                              "notebook: " + "; ".join(cmd[:120] for _, cmd in leaks))
            code = 1
        save_status()
        why = f": {entry['skipped'][:200]}" if entry.get("skipped") else ""
        rest = run_estimate.left([p.stem for p in todo[i:]], estimates)
        print(f"{name} ... " if bar else "", end="")
        print(f"{entry['status']} ({entry['seconds']} s){why}{rest}", flush=True)
    return code


def print_plans(profile_name: str, base_url: str = "", only: list[str] | None = None,
                params: dict | None = None, folder: Path = NOTEBOOKS_DIR,
                smoke: bool = False, gpu: str | None = None) -> int:
    """Print each notebook's declared plan (`lab_utils.arms`) on a profile with
    its parameters, checked by `lab_utils.plan` (the installed vLLM's parser,
    the device rules, memory, vocabularies, quantization, implicit knobs),
    without starting an engine; 1 if any plan has a problem. On the cpu
    profile 05 and 06 read this machine's capability probe (run once, under
    a minute per candidate, if it is not cached yet)."""
    from .plan import report
    return report(profile_name, gpu, base_url, only, params, folder, smoke)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=os.environ.get("LAB_PROFILE", "cpu"))
    parser.add_argument("--base-url", default=os.environ.get("LAB_REMOTE_URL", ""))
    parser.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 00 02")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR)
    parser.add_argument("--notebooks-dir", type=Path, default=NOTEBOOKS_DIR)
    parser.add_argument("--smoke", action="store_true",
                        help="each notebook's smoke parameters (notebooks/smoke_parameters.toml)")
    parser.add_argument("--plan", action="store_true",
                        help="print the engines each notebook would start, checked "
                             "(lab_utils.plan), start nothing")
    parser.add_argument("--gpu", help="with --plan: the GPU a cuda profile is sized for "
                                      "(lab_utils/profiles/facts/devices.toml)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                        metavar=("NAME", "JSON"),
                        help="extra notebook parameter, value as JSON (e.g. -p repeats 3)")
    args = parser.parse_args(argv)
    from .plan import parse_parameters
    params = parse_parameters(args.parameter)
    if args.plan:
        return print_plans(args.profile, args.base_url, args.only, params, args.notebooks_dir,
                           smoke=args.smoke, gpu=args.gpu)
    return run_all(args.profile, args.base_url, args.only, args.runs_dir, params,
                   args.notebooks_dir, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
