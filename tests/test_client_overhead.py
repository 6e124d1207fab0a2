"""The client holds 200 concurrent streams (the benchmark's part (b)).

The sub-millisecond latency goal of part (a) is machine-dependent and stays in
`benchmarks/client_overhead.py`; here part (a) only has to run and succeed."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "client_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("client_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_200_concurrent_streams_all_succeed(bench):
    result = bench.measure_concurrency(streams=200, hold_s=1.0)
    assert result["errors"] == []
    assert result["ok"] == 200
    assert result["max_in_flight"] == 200          # all held open at the same time
    assert result["e2e_max_s"] >= 1.0              # each stream really stayed open ~1 s
    assert result["wall_s"] < 20                   # together, not one after another


def test_sequential_part_runs(bench):
    result = bench.measure_latency(requests=20, warmup=5, tokens=8)
    assert result["requests"] == result["ok"] == 20
    assert result["all_tokens"]
    assert result["e2e_p50_ms"] > 0 and result["e2e_p99_ms"] >= result["e2e_p50_ms"]


def test_stream_shape(bench):
    from lab_utils.sse import pop_sse_data
    first, rest = bench.build_stream(4)
    messages = list(pop_sse_data(bytearray(first + rest)))
    assert messages[-1] == "[DONE]"
    assert len(messages) == 1 + 4 + 1 + 1       # role, 4 tokens, usage, [DONE]
