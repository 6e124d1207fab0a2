"""Requests against one real vLLM CPU engine, the session's `default_engine`
(tests/conftest.py; marked `engine`)."""
from __future__ import annotations

import pytest

import lab_utils as lab

pytestmark = pytest.mark.engine


@pytest.fixture
def engine(default_engine):
    return default_engine


def test_streamed_chat_request_times_and_counts(engine):
    spec = lab.RequestSpec(messages=lab.chat("Name three colours."), max_tokens=24)
    run = lab.Client.for_engine(engine).run([spec], progress=False)
    rec = run.records[0]
    assert rec.ok, rec.error
    assert 0 < rec.ttft < rec.e2e
    assert rec.output_tokens == rec.chunk_tokens[-1], "usage must match the streamed tokens"
    assert 1 <= rec.output_tokens <= 24
    assert len(rec.itl) == len(rec.chunk_times) - 1
    assert abs(sum(rec.itl) - (rec.e2e - rec.ttft)) < 1e-6
    tok = lab.tokenizer_for(engine)
    # The text decodes from exactly the counted tokens (give or take the EOS token).
    assert abs(tok.count(rec.text) - rec.output_tokens) <= 1


def test_completions_with_ignore_eos_give_exact_output_length(engine):
    tok = lab.tokenizer_for(engine)
    specs = lab.synthetic_specs(tok, 2, 100, max_tokens=12)
    run = lab.Client.for_engine(engine).run(specs, lab.Load.concurrent(2), progress=False)
    assert [r.output_tokens for r in run.records] == [12, 12]
    assert all(abs(r.prompt_tokens - 100) <= 2 for r in run.records)
    assert all(r.tpot and r.tpot > 0 for r in run.records)


def test_measure_records_counters_and_jsonl(engine, tmp_path):
    results = lab.Results("itest", tmp_path, "cpu")
    tok = lab.tokenizer_for(engine)
    specs = lab.synthetic_specs(tok, 3, 300, prefix_tokens=256, max_tokens=4, seed=99)
    run = lab.measure(engine, specs, label="shared-prefix", results=results, progress=False)
    # 256 shared tokens = 2 full KV blocks of 128: requests 2 and 3 hit them.
    assert [r.cached_tokens for r in run.records][1:] == [256, 256]
    assert run.counters["prefix_cache_hits"] >= 512
    saved = list(results.iter_records())
    assert len(saved) == 3 and all(r["ok"] for r in saved)
    assert "shared-prefix" in results.data["arms"]
