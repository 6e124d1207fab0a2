"""Cross-check the lab's client against `vllm bench serve`: the same server,
the same completions requests (exact-length prompts, greedy, `ignore_eos`), the
same concurrency, in alternating rounds so drift hits both alike; every round
of `vllm bench serve` runs in one process (`lab_utils.bench_rounds`). Used by
`benchmarks/compare_with_vllm_bench.py` and the checklist notebook."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .bench_rounds import BenchRounds
from .client import Client, Load, RequestSpec
from .workloads import local_tokenizer, shared_prefix_prompts

METRICS = ("ttft", "tpot", "itl", "e2el")


def bench_args(base_url: str, model: str, tokenizer: str, dataset: Path, n: int,
               output_len: int, concurrency: int, out_dir: Path, tag: str) -> list[str]:
    """The arguments of `vllm bench serve` (after `vllm`) for one round."""
    return ["bench", "serve",
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "custom",
            "--dataset-path", str(dataset), "--skip-chat-template", "--disable-shuffle",
            "--custom-output-len", str(output_len), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(n), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--num-warmups", "0",
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{tag}.json"]


def bench_serve(bench: BenchRounds, base_url: str, model: str, tokenizer: str, dataset: Path,
                n: int, output_len: int, concurrency: int, out_dir: Path, tag: str) -> dict:
    """Run vLLM's own benchmark client for one round in `bench` (one process
    for every round); returns its result JSON."""
    out = Path(out_dir) / f"{tag}.json"
    out.unlink(missing_ok=True)
    bench.run(bench_args(base_url, model, tokenizer, dataset, n, output_len, concurrency,
                         out_dir, tag))
    return json.loads(out.read_text())


def lab_client(base_url: str, model: str, prompts: list[str], output_len: int,
               concurrency: int) -> dict:
    specs = [RequestSpec(prompt=p, max_tokens=output_len, ignore_eos=True) for p in prompts]
    run = Client(base_url, model).run(specs, Load.concurrent(concurrency), progress=False)
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
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = local_tokenizer(tokenizer_path)
    prompts = shared_prefix_prompts(tok, n, 0, input_len, seed=11)
    dataset = out_dir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "output_tokens": output_len}) + "\n"
                               for p in prompts))
    per_tool: dict[str, list[dict]] = {"vllm_bench": [], "lab_utils": []}
    with BenchRounds(out_dir / "vllm_bench.log") as bench:
        for r in range(rounds):
            order = ("vllm_bench", "lab_utils") if r % 2 == 0 else ("lab_utils", "vllm_bench")
            for tool in order:
                print(f"round {r + 1}/{rounds}: {tool} ...", flush=True)
                if tool == "vllm_bench":
                    res = bench_serve(bench, base_url, model, tokenizer_path, dataset, n,
                                      output_len, concurrency, out_dir, f"bench_round{r}")
                else:
                    res = lab_client(base_url, model, prompts, output_len, concurrency)
                per_tool[tool].append(res)
    rows = summarize_rounds(per_tool)
    return {"workload": {"num_prompts": n, "input_len": input_len, "output_len": output_len,
                         "concurrency": concurrency, "rounds": rounds, "endpoint": "/v1/completions"},
            "rows": rows}


def summarize_rounds(per_tool: dict[str, list[dict]]) -> list[dict]:
    """One row per metric and statistic: each tool's value is the median of its
    rounds (one round disturbed by other work on a small machine moves it less
    than a mean would); the per-round values are kept beside it."""
    rows = []
    for m in METRICS:
        for stat in ("median", "p99"):
            key = f"{stat}_{m}_ms"
            b_rounds = [float(x[key]) for x in per_tool["vllm_bench"]]
            o_rounds = [float(x[key]) for x in per_tool["lab_utils"]]
            b, ours = float(np.median(b_rounds)), float(np.median(o_rounds))
            rows.append({"metric": m, "stat": stat, "vllm_bench_ms": b, "lab_utils_ms": ours,
                         "diff_pct": (ours - b) / b * 100 if b else float("nan"),
                         "vllm_bench_rounds_ms": b_rounds, "lab_utils_rounds_ms": o_rounds})
    return rows


def markdown(result: dict, tolerance: float) -> str:
    w = result["workload"]
    lines = [f"{w['num_prompts']} prompts x {w['rounds']} rounds, {w['input_len']} -> "
             f"{w['output_len']} tokens, concurrency {w['concurrency']}; each tool's value is the "
             "median of its rounds", "",
             "| metric | stat | vllm bench serve (ms) | lab_utils (ms) | diff (%) |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        flag = " ⚠" if r["stat"] == "median" and abs(r["diff_pct"]) > tolerance else ""
        lines.append(f"| {r['metric']} | {r['stat']} | {r['vllm_bench_ms']:.2f} | "
                     f"{r['lab_utils_ms']:.2f} | {r['diff_pct']:+.1f}{flag} |")
    return "\n".join(lines)
