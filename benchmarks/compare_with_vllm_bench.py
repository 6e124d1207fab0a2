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
import sys
import tempfile
from pathlib import Path

import lab_utils as lab
from lab_utils.crosscheck import compare, markdown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="", help="use this running server instead of starting one")
    ap.add_argument("--model", default="", help="served model name (with --base-url)")
    ap.add_argument("--tokenizer", default="", help="tokenizer path or hub id (with --base-url)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds per tool; each tool reports the median of its rounds")
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
