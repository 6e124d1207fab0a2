"""Cross-check lab_utils' client against `vllm bench serve` on one server and
one workload: median and p99 TTFT, TPOT, ITL and E2E side by side.

    .venv/bin/python benchmarks/compare_with_vllm_bench.py            # starts a cpu engine
    .venv/bin/python benchmarks/compare_with_vllm_bench.py --base-url http://HOST:PORT \
        --model NAME --tokenizer PATH_OR_HUB_ID

Both tools send the same completions requests (exact-length prompts, greedy,
`ignore_eos` so every request yields the same number of tokens) at the same
concurrency, in alternating rounds so drift hits both alike. Prefix caching is
off on the engine it starts, so repeated prompts cost the same every round.
Exits 1 if any median differs by more than --tolerance-pct (default 5).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import lab_utils as lab
from lab_utils.paths import REPO_ROOT

METRICS = ("ttft", "tpot", "itl", "e2el")


def bench_serve(base_url: str, model: str, tokenizer: str, dataset: Path, n: int,
                output_len: int, concurrency: int, out_dir: Path, tag: str) -> dict:
    """Run vLLM's own benchmark client; returns its result JSON."""
    cmd = [sys.executable, "-m", "lab_utils.vllm_cli", "bench", "serve",
           "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
           "--model", model, "--tokenizer", tokenizer, "--dataset-name", "custom",
           "--dataset-path", str(dataset), "--skip-chat-template", "--disable-shuffle",
           "--custom-output-len", str(output_len), "--ignore-eos", "--temperature", "0",
           "--num-prompts", str(n), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--num-warmups", "0",
           "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{tag}.json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError("vllm bench serve failed:\n" + proc.stdout[-2000:] + proc.stderr[-3000:])
    return json.loads((out_dir / f"{tag}.json").read_text())


def lab_client(base_url: str, model: str, prompts: list[str], output_len: int,
               concurrency: int) -> dict:
    specs = [lab.RequestSpec(prompt=p, max_tokens=output_len, ignore_eos=True) for p in prompts]
    run = lab.Client(base_url, model).run(specs, lab.Load.concurrent(concurrency), progress=False)
    ok = [r for r in run.records if r.ok]
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2e for r in ok]}
    out = {}
    for m, values in series.items():
        arr = np.asarray(values) * 1000
        out[f"median_{m}_ms"] = float(np.median(arr))
        out[f"p99_{m}_ms"] = float(np.percentile(arr, 99))
    out["completed"] = len(ok)
    return out


def compare(base_url: str, model: str, tokenizer_path: str, *, n: int, input_len: int,
            output_len: int, concurrency: int, rounds: int, out_dir: Path) -> dict:
    tok = lab.workloads.local_tokenizer(tokenizer_path)
    prompts = lab.workloads.shared_prefix_prompts(tok, n, 0, input_len, seed=11)
    dataset = out_dir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "output_tokens": output_len}) + "\n"
                               for p in prompts))
    per_tool: dict[str, list[dict]] = {"vllm_bench": [], "lab_utils": []}
    for r in range(rounds):
        order = ("vllm_bench", "lab_utils") if r % 2 == 0 else ("lab_utils", "vllm_bench")
        for tool in order:
            print(f"round {r + 1}/{rounds}: {tool} ...", flush=True)
            if tool == "vllm_bench":
                res = bench_serve(base_url, model, tokenizer_path, dataset, n, output_len,
                                  concurrency, out_dir, f"bench_round{r}")
            else:
                res = lab_client(base_url, model, prompts, output_len, concurrency)
            per_tool[tool].append(res)
    rows = []
    for m in METRICS:
        for stat in ("median", "p99"):
            key = f"{stat}_{m}_ms"
            b = float(np.mean([x[key] for x in per_tool["vllm_bench"]]))
            ours = float(np.mean([x[key] for x in per_tool["lab_utils"]]))
            rows.append({"metric": m, "stat": stat, "vllm_bench_ms": b, "lab_utils_ms": ours,
                         "diff_pct": (ours - b) / b * 100 if b else float("nan")})
    return {"workload": {"num_prompts": n, "input_len": input_len, "output_len": output_len,
                         "concurrency": concurrency, "rounds": rounds, "endpoint": "/v1/completions"},
            "rows": rows}


def markdown(result: dict, tolerance: float) -> str:
    w = result["workload"]
    lines = [f"{w['num_prompts']} prompts x {w['rounds']} rounds, {w['input_len']} -> "
             f"{w['output_len']} tokens, concurrency {w['concurrency']}", "",
             "| metric | stat | vllm bench serve (ms) | lab_utils (ms) | diff (%) |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        flag = " ⚠" if r["stat"] == "median" and abs(r["diff_pct"]) > tolerance else ""
        lines.append(f"| {r['metric']} | {r['stat']} | {r['vllm_bench_ms']:.2f} | "
                     f"{r['lab_utils_ms']:.2f} | {r['diff_pct']:+.1f}{flag} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="", help="use this running server instead of starting one")
    ap.add_argument("--model", default="", help="served model name (with --base-url)")
    ap.add_argument("--tokenizer", default="", help="tokenizer path or hub id (with --base-url)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tolerance-pct", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    args = ap.parse_args(argv)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="crosscheck-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    kw = dict(n=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
              concurrency=args.concurrency, rounds=args.rounds, out_dir=out_dir)
    if args.base_url:
        if not (args.model and args.tokenizer):
            ap.error("--base-url needs --model and --tokenizer")
        result = compare(args.base_url, args.model, args.tokenizer, **kw)
    else:
        profile = lab.load_profile("cpu")
        with lab.EnginePool(profile, log_dir=out_dir / "logs") as pool:
            engine = pool.get(enable_prefix_caching=False)
            print(engine.command, flush=True)
            result = compare(engine.base_url, engine.model, engine.model_path, **kw)
    (out_dir / "crosscheck.json").write_text(json.dumps(result, indent=2))
    print(markdown(result, args.tolerance_pct))
    print(f"\nsaved: {out_dir / 'crosscheck.json'}")
    bad = [r for r in result["rows"] if r["stat"] == "median"
           and abs(r["diff_pct"]) > args.tolerance_pct]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
