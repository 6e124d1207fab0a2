"""`vllm bench serve` round after round in one process (lab_utils.bench_rounds),
against the vLLM stand-in (tests/fake_vllm.py): each round is vLLM's own
benchmark with its own result, a failing round names vLLM's error and the next
round still runs, and a process that died is reported, not waited for."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from fake_vllm import MODEL

from lab_utils.bench_rounds import BenchRounds
from lab_utils.crosscheck import bench_args, bench_serve

pytestmark = pytest.mark.engine   # imports vLLM in a child (~12 s), as the engine tests do


@pytest.fixture(scope="module")
def tokenizer(cpu) -> str:
    path = Path(cpu.model_for())
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"no embedded model at {path}: run `make model` first")
    return str(path)


@pytest.fixture(scope="module")
def cpu():
    from lab_utils.profiles import load_profile
    return load_profile("cpu")


def dataset(folder: Path, n: int) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question number {i} about caching",
                                        "output_tokens": 8}) + "\n" for i in range(n)))
    return path


def test_rounds_run_in_one_process_each_with_vllms_own_result(vllm_like, tokenizer, tmp_path):
    data = dataset(tmp_path, 5)
    with BenchRounds(tmp_path / "bench.log") as bench:
        pid = bench.proc.pid
        first = bench_serve(bench, vllm_like.base_url, MODEL, tokenizer, data, 5, 8, 2,
                            tmp_path, "round0")
        assert bench.proc.pid == pid and bench.proc.poll() is None
        second = bench_serve(bench, vllm_like.base_url, MODEL, tokenizer, data, 3, 8, 1,
                             tmp_path, "round1")
        assert bench.proc.poll() is None
    # vLLM's result files: what each round sent and got back
    assert (first["completed"], first["num_prompts"], first["max_concurrency"]) == (5, 5, 2)
    assert (second["completed"], second["num_prompts"], second["max_concurrency"]) == (3, 3, 1)
    assert first["median_ttft_ms"] > 0 and second["median_tpot_ms"] > 0
    assert bench.proc is None   # the child has ended with the block


def test_a_failing_round_names_vllms_error_and_the_next_round_runs(vllm_like, tokenizer,
                                                                     tmp_path):
    data = dataset(tmp_path, 2)
    args = bench_args(vllm_like.base_url, MODEL, tokenizer, data, 2, 8, 1, tmp_path, "ok")
    bad = list(args)
    bad[bad.index("--request-rate") + 1] = "not-a-rate"
    with BenchRounds(tmp_path / "bench.log") as bench:
        with pytest.raises(RuntimeError, match="request-rate"):
            bench.run(bad)
        bench.run(args)
    assert json.loads((tmp_path / "ok.json").read_text())["completed"] == 2


def test_a_process_that_died_is_reported_with_its_log(vllm_like, tokenizer, tmp_path):
    data = dataset(tmp_path, 2)
    with BenchRounds(tmp_path / "bench.log") as bench:
        os.kill(bench.proc.pid, signal.SIGKILL)
        bench.proc.wait()
        with pytest.raises(RuntimeError, match="process ended"):
            bench.run(bench_args(vllm_like.base_url, MODEL, tokenizer, data, 2, 8, 1, tmp_path,
                                 "never"))
