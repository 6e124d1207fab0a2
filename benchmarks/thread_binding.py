#!/usr/bin/env python3
"""Which thread binding, allocator and OpenMP runtime make the `cpu` profile fastest.

    .venv/bin/python benchmarks/thread_binding.py                 # all configurations, 2 rounds
    .venv/bin/python benchmarks/thread_binding.py --configs auto all+tcmalloc --rounds 1
    .venv/bin/python benchmarks/thread_binding.py --configs all+tcmalloc --profile   # where a step goes

Each configuration starts the `cpu` profile's engine with one environment
(see `lab_utils.cpu_tuning.binding_env`) and measures, one request at a time,
TTFT of distinct `--prompt-tokens` prompts and TPOT of `--output-tokens`
answers, then TPOT with `--concurrency` requests in flight. Rounds run the
configurations in ABBA order so drift of the machine hits all alike.

It also measures the machine's memory read bandwidth (1 thread and all
threads) and prints the decode floor: weight bytes read per step / bandwidth;
single-stream TPOT cannot be lower than that. And it times the step's matrix
products alone, through the GEMM vLLM picks for them (`cpu_tuning.decode_linears_ms`):
what the forward pass cannot beat with vLLM's kernels. Every engine logs its steps
(`--enable-logging-iteration-details`), so the single-stream series also says
how much of TPOT is the engine's decode step and how much the rest of the
serving path (not for the "inproc" configurations: with the worker inside the
engine core, vLLM's step timer covers the sampling only). During that series it
also counts the cores the engine's processes kept busy ("cores c=1": the ones
computing the model / the others, e.g. an engine core polling its worker's
queue), and the TLB shootdowns the machine's CPUs received per answer token
("TLB/token": a process unmapping memory while its threads run on other
CPUs; `lab_utils.pystack`). Results go to `--out` (a folder) as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import lab_utils as lab
from lab_utils import cpu_tuning, host, step_profile
from lab_utils.engine_steps import StepLog
from lab_utils.facts import model_facts
from lab_utils.machine import parse_engine_binding

CONFIGS = {
    "auto": dict(bind="auto"),
    "auto+tcmalloc": dict(bind="auto", tcmalloc=True),
    "all": dict(bind="all"),
    "all+tcmalloc": dict(bind="all", tcmalloc=True),
    "all+iomp": dict(bind="all", iomp=True),
    "all+tcmalloc+iomp": dict(bind="all", tcmalloc=True, iomp=True),
    # the profile's binding with torch.compile (vLLM's DYNAMO_TRACE_ONCE + inductor on
    # CPU) instead of the profile's --enforce-eager: does compiled decode near the floor?
    "all+tcmalloc+compiled": dict(bind="all", tcmalloc=True),
    # the profile's binding with OpenMP threads that sleep instead of spinning between
    # parallel regions: on 2 cores the worker's spinning threads compete with the
    # engine-core and API-server processes for the same cores
    "all+tcmalloc+passive": dict(bind="all", tcmalloc=True),
    # the worker inside the engine-core process (vLLM's "uni" executor, which its CPU
    # platform allows only with VLLM_ENABLE_V1_MULTIPROCESSING=0;
    # `cpu_tuning.in_process_env`): no worker process whose shared-memory queue the
    # engine core polls, spinning, while the worker's threads need every core
    "all+tcmalloc+inproc": dict(bind="all", tcmalloc=True, in_process=True),
    "all+tcmalloc+inproc+compiled": dict(bind="all", tcmalloc=True, in_process=True),
    # the profile's binding with vLLM's engine-core process forked from the API server
    # instead of spawned (`lab_utils.vllm_cli.fork_engine_core`; the worker is still
    # spawned): one import of torch and vLLM fewer per start, the same serving path?
    "all+tcmalloc+forked-core": dict(bind="all", tcmalloc=True, fork_core=True),
    "all+tcmalloc+inproc+forked-core": dict(bind="all", tcmalloc=True, in_process=True,
                                            fork_core=True),
    # vLLM's engine-core and worker loops with room on Python's frame stack
    # (`lab_utils.pystack`): no chunk of it mapped and unmapped at every crossing
    "all+tcmalloc+stackroom": dict(bind="all", tcmalloc=True, stack_room=True),
    "all+tcmalloc+compiled+stackroom": dict(bind="all", tcmalloc=True, stack_room=True),
    # traced by Dynamo once (vLLM's mode 2, DYNAMO_TRACE_ONCE) and run by torch's
    # "eager" backend instead of Inductor's kernels (what vLLM's CPU platform does under
    # its internal VLLM_CPU_CI_ENV, "to save time"): no kernels compiled at the start;
    # how much of eager's Python time per step does one traced graph save?
    "all+tcmalloc+dynamo+stackroom": dict(bind="all", tcmalloc=True, stack_room=True),
    # an eager engine's RMSNorm and SiLU-and-mul in vLLM's C kernels instead of 7 and 3
    # PyTorch ops each (`lab_utils.cpu_kernels`): 91 calls a decode step of 30 layers
    "all+tcmalloc+stackroom+ckernels": dict(bind="all", tcmalloc=True, stack_room=True,
                                            c_kernels=True),
    # glibc's malloc on transparent huge pages instead of tcmalloc (`lab_utils.huge_pages`):
    # the weights a decode step streams in 2 MiB pages, 512x fewer TLB misses
    "all+stackroom+ckernels+hugepages": dict(bind="all", stack_room=True, c_kernels=True,
                                             huge_pages=True),
    # the same with torch.compile instead of the C kernels (Inductor fuses the norms and
    # activations itself): the fastest decode of the two, and by how much
    "all+stackroom+hugepages+compiled": dict(bind="all", stack_room=True, huge_pages=True),
}
#: Engine flags of a configuration besides the profile's (default: none).
FLAGS = {"all+tcmalloc+compiled": {"enforce_eager": False},
         "all+tcmalloc+inproc+compiled": {"enforce_eager": False},
         "all+tcmalloc+compiled+stackroom": {"enforce_eager": False},
         "all+stackroom+hugepages+compiled": {"enforce_eager": False},
         "all+tcmalloc+dynamo+stackroom": {"enforce_eager": False,
                                            "compilation_config": {"mode": 2,
                                                                   "backend": "eager"}}}
#: Environment of a configuration besides its binding (default: none).
#: Compiled configurations compile with the lab's caches (`lab_utils.compile_cache`,
#: from the profile's environment): Inductor's caches under LAB_CACHE_DIR, shared by
#: every config, and vLLM's AOT file off (VLLM_USE_AOT_COMPILE=0), with which a new
#: config hit no cache (torch names the compiled function with a fresh uuid that is
#: part of AOTAutograd's cache key). Earlier, without the lab's fix, vllm-cpu 0.32.0
#: with torch 2.13 also failed to load that file ("'function' object has no attribute
#: 'finalize_loading'") and compiled again at every start.
ENV = {"all+tcmalloc+passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
#: Every configuration logs each engine step (vLLM's --enable-logging-iteration-details)
#: so that single-stream TPOT splits into the engine's step (forward pass, sampling and
#: the hand-over to the worker) and the rest (scheduling, output processing, the API
#: server, the client).
STEP_LOG = {"enable_logging_iteration_details": True}


#: The competing job of the "busy" series: another process computing with as many
#: torch threads as there are cores (small matrix products with short pauses, as
#: another engine's decode steps), for at most `argv[1]` seconds.
COMPETITOR = r"""
import os, sys, time, torch
torch.set_num_threads(len(os.sched_getaffinity(0)))
a = torch.randn(256, 256)
t0 = time.time()
while time.time() - t0 < float(sys.argv[1]):
    for _ in range(50):
        a @ a
    time.sleep(0.002)
"""


@contextlib.contextmanager
def competing_job(limit_s: float = 600.0):
    """A process competing for every core while the block runs: how an engine
    configuration holds up on a machine that is not idle (two test streams, a
    notebook beside another job, a neighbour on a shared host)."""
    proc = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(limit_s)])
    try:
        time.sleep(1.0)  # past its imports
        yield
    finally:
        proc.kill()
        proc.wait()


def measure_config(pool, name: str, env: dict, tok, args, seed: int, profile_dir=None) -> dict:
    profiling = step_profile.profiler_flags(profile_dir) if profile_dir else {}
    engine = pool.get(env={**env, **ENV.get(name, {})}, **STEP_LOG, **FLAGS.get(name, {}),
                      **profiling)
    print(f"[{name}] {engine.command} (started in {engine.server.startup_s:.1f} s)", flush=True)
    warm = lab.synthetic_specs(tok, 1, 64, max_tokens=4, seed=999)
    lab.Client.for_engine(engine).run(warm, lab.Load.sequential(), progress=False)
    ttft_specs = lab.synthetic_specs(tok, args.requests, args.prompt_tokens, max_tokens=2,
                                     seed=seed)
    tpot_specs = lab.synthetic_specs(tok, args.requests, 128, max_tokens=args.output_tokens,
                                     seed=seed + 1)
    conc_specs = lab.synthetic_specs(tok, 2 * args.concurrency, 128,
                                     max_tokens=args.output_tokens, seed=seed + 2)
    client = lab.Client.for_engine(engine)
    ttft = client.run(ttft_specs, lab.Load.sequential(), progress=False)
    steps = StepLog(engine).start()
    tlb_before = host.tlb_shootdowns()
    with host.EngineCPU(engine) as cpu:
        tpot = client.run(tpot_specs, lab.Load.sequential(), progress=False)
    tlb_after = host.tlb_shootdowns()
    steps = steps.read()
    decode = steps[(steps.ctx_requests == 0) & (steps.gen_requests == 1)]
    conc = client.run(conc_specs, lab.Load.concurrent(args.concurrency), progress=False)
    busy_specs = lab.synthetic_specs(tok, args.requests, 128, max_tokens=args.output_tokens,
                                     seed=seed + 3)
    with competing_job():
        busy = client.run(busy_specs, lab.Load.sequential(), progress=False)
    breakdown = {}
    if profile_dir:
        # vLLM's torch profiler over single-request decoding: short prompts, so the
        # prefill steps stay a small part of the profile (step_profile.decode_breakdown)
        prof_specs = lab.synthetic_specs(tok, 2, 16, max_tokens=args.output_tokens,
                                         seed=seed + 4)
        with step_profile.Profiling(engine):
            client.run(prof_specs, lab.Load.sequential(), progress=False)
        breakdown = step_profile.decode_breakdown(step_profile.read_table(profile_dir))
    got = parse_engine_binding(engine.server.log_path.read_text(errors="replace"))
    binding = (f"{got.get('executor')}: core ids={got.get('core_ids', '-')} "
               f"reserved={got.get('reserved_cpus', '-')} threads={got.get('torch_threads')}")
    return {"config": name, "env": env, "startup_s": engine.server.startup_s,
            "binding_log": binding,
            "ttft_ms": [r.ttft * 1e3 for r in ttft.records if r.ok],
            "tpot_ms": [r.tpot * 1e3 for r in tpot.records if r.ok and r.tpot],
            # the engine's own time of each single-request decode step in that series;
            # none with the worker in the engine core, where vLLM's step timer starts
            # after the forward pass (cpu_tuning.STEP_TIMING_FLAG)
            "decode_step_ms": ([] if env.get(cpu_tuning.MULTIPROCESSING) == "0"
                               else [float(v) for v in decode.elapsed_ms]),
            # cores the engine's processes kept busy during that series: the ones that
            # compute the model (the worker, or the engine core holding it), and the
            # rest (API server; engine core polling the worker's queue)
            "cores_model": cpu.worker_cpu_s / cpu.wall_s,
            "cores_other": (cpu.cpu_s - cpu.worker_cpu_s) / cpu.wall_s,
            # TLB shootdowns the machine's CPUs received per answer token of that
            # series: a process unmapping memory while its threads run on other CPUs
            # (`lab_utils.pystack`); None where /proc/interrupts has no TLB row
            "tlb_per_token": (None if tlb_before is None or tlb_after is None else
                              (tlb_after - tlb_before) / max(1, sum(
                                  r.output_tokens or 0 for r in tpot.records if r.ok))),
            "tpot_conc_ms": [r.tpot * 1e3 for r in conc.records if r.ok and r.tpot],
            # single-stream TPOT beside a job computing on every core
            "tpot_busy_ms": [r.tpot * 1e3 for r in busy.records if r.ok and r.tpot],
            # ms per single-request decode step by vLLM's torch profiler (--profile)
            "step_profile": breakdown,
            "answers": [r.text for r in tpot.records],   # greedy: equal across configurations
            "failed": sum(not r.ok for r in (*ttft.records, *tpot.records, *conc.records,
                                             *busy.records))}


def stats(values) -> str:
    v = np.asarray(values, dtype=float)
    if not len(v):
        return "–"
    return f"{np.median(v):8.1f} / {np.percentile(v, 90):8.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=5, help="requests per series and round")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also profile single-request decode steps with vLLM's torch profiler "
                         "and print where a step's time goes (lab_utils.step_profile)")
    args = ap.parse_args()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="thread-binding-"))
    out_dir.mkdir(parents=True, exist_ok=True)

    profile = lab.load_profile("cpu")
    # The profile's own binding variables would hide the ones under test.
    profile_env = {k: v for k, v in profile.env.items()
                   if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                                "LD_PRELOAD")}
    import dataclasses
    profile = dataclasses.replace(profile, env=profile_env, cpu_binding={})
    model_dir = profile.model_for()
    tok = lab.tokenizer_for(lab.Engine(profile, {}, "", "", model_path=model_dir))
    weights = cpu_tuning.weight_bytes(model_dir)
    cores = len(os.sched_getaffinity(0))
    bw = {t: cpu_tuning.read_bandwidth_gbs(t) for t in sorted({1, cores})}
    print("read bandwidth: " + ", ".join(f"{t} thread(s) {g:.1f} GB/s" for t, g in bw.items()))
    print(f"weights {weights / 2**20:.0f} MiB -> decode floor "
          + ", ".join(f"{cpu_tuning.decode_floor_ms(weights, g):.1f} ms ({t} thr)"
                      for t, g in bw.items()))

    # what vLLM's own GEMM needs for one step's matrix products, and nothing else
    shapes = model_facts(str(model_dir)).decode_linear_shapes()
    linears = cpu_tuning.decode_linears_ms(shapes, cores)
    floor_now = cpu_tuning.decode_floor_ms(weights, max(bw.values()))
    print(f"the {len(shapes)} matrix products of one decode step alone, through vLLM's GEMM "
          f"({cores} threads): {linears['ms_median']:.1f} ms (min {linears['ms_min']:.1f}) = "
          f"{linears['ms_median'] / floor_now:.2f}x the floor; through ATen's linear "
          f"{linears['aten_ms_median']:.1f} ms = {linears['aten_ms_median'] / floor_now:.2f}x")

    runs: list[dict] = []
    order = []  # (round, configuration)
    for r in range(args.rounds):
        order += [(r, c) for c in (args.configs if r % 2 == 0 else reversed(args.configs))]
    base_seed = int(time.time())  # distinct prompts every round: no prefix-cache hits
    with lab.EnginePool(profile, log_dir=out_dir / "logs") as pool:
        for i, (rnd, name) in enumerate(order, 1):
            try:
                env = cpu_tuning.binding_env(**CONFIGS[name])
            except cpu_tuning.LibraryMissing as exc:
                print(f"[{name}] skipped: {exc}")
                continue
            print(f"--- {i}/{len(order)}: {name}", flush=True)
            # the floor beside each series: a shared host's bandwidth drifts
            # (26-67 GB/s within ~70 minutes on one 2-core guest)
            bw_now = max(cpu_tuning.read_bandwidth_gbs(t) for t in sorted({1, cores}))
            runs.append({"round": rnd, "bandwidth_gbs": bw_now,
                         "floor_ms": cpu_tuning.decode_floor_ms(weights, bw_now),
                         **measure_config(pool, name, env, tok, args,
                                          seed=base_seed + 10 * rnd,
                                          profile_dir=(out_dir / "profiles" / f"{name}-{rnd}"
                                                       if args.profile else None))})
            pool.close()  # one engine at a time: the configurations must not share cores
            (out_dir / "thread_binding.json").write_text(json.dumps(
                {"bandwidth_gbs": bw, "weight_bytes": weights, "linears_ms": linears,
                 "runs": runs}, indent=2))

    width = max(22, *map(len, args.configs))
    print(f"\n{'config':{width}s} {'start s':>13s} {'TTFT ms p50 / p90':>19s} {'TPOT c=1 p50 / p90':>19s} "
          f"{'step c=1 p50 / p90':>19s} "
          f"{'TPOT c=' + str(args.concurrency) + ' p50 / p90':>19s} "
          f"{'TPOT busy p50 / p90':>19s} {'cores c=1':>11s} {'TLB/token':>9s}  binding")
    for name in args.configs:
        mine = [r for r in runs if r["config"] == name]
        if not mine:
            continue
        pool_of = lambda key: [v for r in mine for v in r[key]]  # noqa: E731
        starts = "/".join(f"{r['startup_s']:.1f}" for r in mine)
        # cores busy during the single-stream series: model / other processes
        cores = (f"{np.median([r['cores_model'] for r in mine]):.2f}/"
                 f"{np.median([r['cores_other'] for r in mine]):.2f}")
        tlbs = [r["tlb_per_token"] for r in mine if r.get("tlb_per_token") is not None]
        tlb = f"{np.median(tlbs):.1f}" if tlbs else "–"
        print(f"{name:{width}s} {starts:>13s} {stats(pool_of('ttft_ms')):>19s} {stats(pool_of('tpot_ms')):>19s} "
              f"{stats(pool_of('decode_step_ms')):>19s} "
              f"{stats(pool_of('tpot_conc_ms')):>19s} "
              f"{stats(pool_of('tpot_busy_ms')):>19s} {cores:>11s} {tlb:>9s}  {mine[0]['binding_log']}")
    fastest = min((np.median([v for r in runs if r["config"] == n for v in r["tpot_ms"]]), n)
                  for n in {r["config"] for r in runs})
    # each series against the floor measured just before it, then the median
    ratios = {n: float(np.median([np.median(r["tpot_ms"]) / r["floor_ms"] for r in runs
                                  if r["config"] == n and r["tpot_ms"]]))
              for n in {r["config"] for r in runs}}
    bws = [*bw.values(), *(r["bandwidth_gbs"] for r in runs)]
    floor = float(np.median([r["floor_ms"] for r in runs]))
    first = runs[0]["config"] if runs else None
    for name in args.configs:  # same round, same prompts: greedy answers must match
        pairs = [(a["answers"], b["answers"]) for a in runs for b in runs
                 if a["config"] == first and b["config"] == name and a["round"] == b["round"]]
        if name != first and pairs:
            same = sum(x == y for xs, ys in pairs for x, y in zip(xs, ys))
            print(f"{name}: {same} of {sum(len(xs) for xs, _ in pairs)} greedy answers equal "
                  f"{first}'s")
    print(f"\nread bandwidth {min(bws):.1f}-{max(bws):.1f} GB/s over the run: decode floor "
          f"{cpu_tuning.decode_floor_ms(weights, max(bws)):.1f}-"
          f"{cpu_tuning.decode_floor_ms(weights, min(bws)):.1f} ms")
    for name in args.configs:
        if name in ratios:
            print(f"  {name:{width}s} single-stream TPOT / floor measured before it: "
                  f"{ratios[name]:.2f}x (median of its series)")
    print(f"fastest single-stream TPOT: {fastest[1]} {fastest[0]:.1f} ms = "
          f"{ratios[fastest[1]]:.2f}x the floor")
    step = [v for r in runs if r["config"] == fastest[1] for v in r["decode_step_ms"]]
    if step:
        s = float(np.median(step))
        print(f"  of which the engine's decode step (forward pass, sampling, hand-over to the "
              f"worker) {s:.1f} ms = {s / floor:.2f}x the floor; the other {fastest[0] - s:.1f} ms "
              f"are scheduling, output processing, the API server and the client")
        print(f"  the step's matrix products alone take {linears['ms_median']:.1f} ms = "
              f"{linears['ms_median'] / floor:.2f}x the floor; the step's other "
              f"{s - linears['ms_median']:.1f} ms are attention, norms, rotary, sampling and "
              f"the hand-over")
    profiled = [r for r in runs if r.get("step_profile")]
    if profiled:
        parts = ["matrix products", "attention", "compiled kernels", "other ops",
                 "python in the step"]
        print("\nwhere a single-request decode step goes under vLLM's torch profiler "
              "(ms per step, median over rounds; the profiler adds to every op):")
        print(f"{'config':{width}s} {'step':>6s} " + " ".join(f"{p:>18s}" for p in parts))
        for name in args.configs:
            mine = [r["step_profile"] for r in profiled if r["config"] == name]
            if mine:
                med = lambda k: float(np.median([m[k] for m in mine]))  # noqa: E731
                print(f"{name:{width}s} {med('step_ms'):6.1f} "
                      + " ".join(f"{med(p):18.1f}" for p in parts))
    print(f"saved: {out_dir / 'thread_binding.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
