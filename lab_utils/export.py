"""Export a run in `vllm bench serve`'s result-JSON shape (`--save-result
--save-detailed`), so the vLLM ecosystem's own plotting and comparison tools
read the lab's measurements."""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .metrics import SLO, summarize

PERCENTILES = (50, 90, 99)


def to_vllm_bench(records: Sequence, duration_s: float, *, model_id: str, label: str = "",
                  backend: str = "openai-chat", request_rate: float | str = "inf",
                  burstiness: float = 1.0, max_concurrency: int | None = None,
                  slo: SLO | None = None, tokenizer_id: str | None = None) -> dict[str, Any]:
    """The keys `vllm bench serve` writes (times in seconds per request, ms in stats)."""
    s = summarize(records, duration_s, slo)
    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {
        "date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend,
        "backend": backend, "label": label or None, "model_id": model_id,
        "tokenizer_id": tokenizer_id or model_id, "num_prompts": len(records),
        "request_rate": request_rate, "burstiness": burstiness,
        "max_concurrency": max_concurrency, "duration": duration_s,
        "completed": s["completed"], "failed": s["failed"],
        "total_input_tokens": s["input_tokens"], "total_output_tokens": s["output_tokens"],
        "request_throughput": s["request_throughput"],
        "request_goodput": s["goodput"] if slo is not None else None,
        "output_throughput": s["output_throughput"],
        "total_token_throughput": (s["input_tokens"] + s["output_tokens"]) / duration_s
        if duration_s > 0 else None,
        "input_lens": [r.prompt_tokens or 0 for r in records],
        "output_lens": [r.output_tokens or 0 for r in records],
        "ttfts": [r.ttft or 0.0 for r in records],
        "itls": [list(r.itl) for r in records],
        "latencies": [r.e2e or 0.0 for r in records],
        "start_times": [r.start for r in records],
        "generated_texts": [r.text for r in records],
        "errors": [r.error for r in records],
    }
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2e for r in ok]}
    for name, values in series.items():
        arr = np.asarray(values, dtype=float) * 1000 if values else np.zeros(1)
        out[f"mean_{name}_ms"] = float(arr.mean())
        out[f"median_{name}_ms"] = float(np.median(arr))
        out[f"std_{name}_ms"] = float(arr.std())
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def export_arm(results_json: str | Path, arm: str, out_path: str | Path) -> Path:
    """Write one arm of a notebook's results (its JSONL records) as a vLLM
    bench result file."""
    from .client import RequestRecord
    results_json = Path(results_json)
    data = json.loads(results_json.read_text())
    if arm not in data["arms"]:
        raise KeyError(f"no arm {arm!r} in {results_json}; arms: {sorted(data['arms'])}")
    info = data["arms"][arm]
    records = [RequestRecord.from_json(json.loads(line))
               for line in (results_json.parent / info["records"]).read_text().splitlines()
               if line.strip()]
    env = data.get("environment", {})
    doc = to_vllm_bench(records, info["summary"]["duration_s"],
                        model_id=env.get("served_model_name") or env.get("model") or "",
                        label=f"{data['notebook']}:{arm}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2))
    return out_path


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="Export one arm of a notebook's results as a "
                                             "`vllm bench serve` result JSON.")
    ap.add_argument("results_json", help="e.g. runs/latest/results/02_prefix_caching.json")
    ap.add_argument("arm", help="the arm's label (a key of 'arms' in that file)")
    ap.add_argument("out", help="output .json path")
    args = ap.parse_args(argv)
    print(export_arm(args.results_json, args.arm, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
