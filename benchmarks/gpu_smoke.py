"""Start every distinct engine configuration of a profile's plan once, send it
one request, and say which ones work: what to run first on a new GPU machine.

    python benchmarks/gpu_smoke.py --dry-run               # what it would start, nothing starts
    python benchmarks/gpu_smoke.py                         # the gpu profile, one engine at a time
    python benchmarks/gpu_smoke.py --gpu h200-141gb --only 01 05 --max-model-len 4096
    python benchmarks/gpu_smoke.py --profile my.toml -p draft_models '["profile"]'

The configurations come from the plan checker (`lab_utils.plan`): every
notebook's declared arms on the profile with its parameters (the profile's
`[parameters."<notebook>"]` tables, then `-p` values), deduplicated by what
vLLM would be started with, each with a short `--max-model-len` so a start is
quick and a configuration is tested once however many notebooks use it. Each
starts alone (engines a notebook runs side by side, 11's tiers, start one
after the other here: their memory shares are the plan checker's to size), gets
one short chat request, and is stopped. It prints PASS or FAIL per
configuration (a failure with the root cause from the server's log), then a
summary, and exits 1 if any configuration failed or any notebook's plan has a
problem (`python -m lab_utils.plan` explains it).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils import plan as checker
from lab_utils.arms import Arm, engine_key
from lab_utils.profiles import ConfigError, Profile, load_profile

#: A context long enough for the chat request, short enough to start fast.
SMOKE_MAX_MODEL_LEN = 2048


@dataclass
class Configuration:
    """One engine configuration and the notebook arms that start it."""
    role: str | None
    flags: dict[str, Any]
    env: dict[str, str]
    command: str
    arms: list[str] = field(default_factory=list)   # "notebook: arm"

    @property
    def key(self) -> str:
        return engine_key(self.role, self.flags, self.env)


def configurations(profile: Profile, gpu=None, only=None, params=None,
                   max_model_len: int = SMOKE_MAX_MODEL_LEN
                   ) -> tuple[list[Configuration], list[checker.PlanCheck]]:
    """The distinct engine configurations of every notebook's checked plan
    (first use first), each at `max_model_len`, and the checks themselves."""
    checks = checker.check_all(profile, gpu, only, params)
    found: dict[str, Configuration] = {}
    for check in checks:
        for e in check.engines:
            flags = {**e.arm.flags, "max_model_len": int(max_model_len)}
            arm = Arm(e.name, flags, e.arm.role, dict(e.arm.env))
            if arm.key not in found:
                built = checker.build_engine(profile, arm, e.device)
                found[arm.key] = Configuration(arm.role, flags, dict(arm.env), built.command)
            found[arm.key].arms.append(f"{check.notebook}: {e.name}")
    return list(found.values()), checks


def plan_problems(checks: list[checker.PlanCheck]) -> list[str]:
    return [f"{c.notebook}: {p}" for c in checks for p in c.problems]


def smoke(profile: Profile, config: Configuration, log_dir: Path) -> tuple[bool, str]:
    """Start one configuration, send one chat request, stop it: (passed, what happened)."""
    from lab_utils.client import Client
    from lab_utils.errors import ServerError
    from lab_utils.server import EnginePool
    from lab_utils.vllm_logs import root_cause
    from lab_utils.workloads import chat_specs
    t0 = time.perf_counter()
    try:
        with EnginePool(profile, log_dir=log_dir) as pool:
            engine = pool.get(config.role, env=config.env or None, **config.flags)
            started = time.perf_counter() - t0
            [record] = Client.for_engine(engine).run(chat_specs(1, max_tokens=16)).records
    except ServerError as exc:
        return False, f"did not start: {root_cause(str(exc)) or str(exc).splitlines()[0]}"
    except Exception as exc:  # a smoke test reports every failure and goes on
        return False, f"did not start: {type(exc).__name__}: {exc}"
    if not record.ok or not record.output_tokens:
        return False, f"started in {started:.0f} s, the request failed: {record.error}"
    return True, (f"started in {started:.0f} s, answered {record.output_tokens} tokens "
                  f"(TTFT {record.ttft * 1e3:.0f} ms)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=os.environ.get("LAB_PROFILE", "gpu"),
                    help="a profile name or a .toml file (default gpu)")
    ap.add_argument("--gpu", choices=sorted(checker.devices()), default=checker.DEFAULT_GPU,
                    help="the GPU the plan is checked for")
    ap.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 01 05")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                    metavar=("NAME", "JSON"), help="a notebook parameter, value as JSON")
    ap.add_argument("--max-model-len", type=int, default=SMOKE_MAX_MODEL_LEN)
    ap.add_argument("--dry-run", action="store_true", help="print what would start, start none")
    ap.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: a temp dir)")
    args = ap.parse_args(argv)
    try:
        profile = load_profile(args.profile)
        if profile.is_remote:
            raise ConfigError("the remote profile launches nothing: smoke-test its server "
                              "with a request instead")
        gpu = checker.device(args.gpu) if profile.device == "cuda" else None
        configs, checks = configurations(profile, gpu, args.only,
                                         checker.parse_parameters(args.parameter),
                                         args.max_model_len)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 1
    problems = plan_problems(checks)
    where = gpu.title if gpu else profile.device
    print(f"{len(configs)} distinct engine configurations of profile {profile.name!r} "
          f"({len(checks)} notebooks, checked for {where}), max_model_len {args.max_model_len}")
    # a dry run starts nothing, so it leaves no empty log folder behind
    log_dir = args.log_dir or (None if args.dry_run else Path(tempfile.mkdtemp(prefix="gpu-smoke-")))
    failed = 0
    for i, config in enumerate(configs, 1):
        print(f"\n[{i}/{len(configs)}] {config.command}\n  used by {'; '.join(config.arms)}",
              flush=True)
        if args.dry_run:
            continue
        passed, what = smoke(profile, config, log_dir / f"{i:02d}")
        failed += not passed
        print(f"  {'PASS' if passed else 'FAIL'}: {what}", flush=True)
    for p in problems:
        print(f"\nPLAN PROBLEM {p}")
    ran = "not started (--dry-run)" if args.dry_run else \
        f"{len(configs) - failed} passed, {failed} failed (logs in {log_dir})"
    print(f"\n{len(configs)} configurations: {ran}; {len(problems)} plan problems")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
