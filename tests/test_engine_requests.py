"""Requests against one real vLLM CPU engine shared by this module (marked
`engine`), started with VLLM_SERVER_DEV_MODE=1 and --max-num-seqs 8: streamed
timings and token counts, exact output lengths, counters, a client hanging up
through the lab's app, and the remote route with this engine as the "remote"
server (what `lab_utils.remote` reads must be what the engine was started with;
the emulated "prefix caching off", a fresh cache_salt per request, must keep
vLLM's own hit counter at 0 where the same requests hit without it). One start
serves them all; the tests that start, stop or kill an engine
(test_engine_lifecycle.py) start their own."""
from __future__ import annotations

import os

import pytest

import lab_utils as lab
from lab_utils.app import AppServer
from lab_utils.counters import scrape
from lab_utils.remote import read_server
from lab_utils.server import EnginePool, lab_server_processes

pytestmark = pytest.mark.engine


def _mine() -> list:
    return lab_server_processes(owner=os.getpid())


@pytest.fixture(scope="module")
def profile():
    return lab.load_profile("cpu")


@pytest.fixture(scope="module")
def engine(profile, tmp_path_factory):
    with lab.EnginePool(profile, log_dir=tmp_path_factory.mktemp("logs")) as pool:
        yield pool.get(env={"VLLM_SERVER_DEV_MODE": "1"}, max_num_seqs=8)
    assert _mine() == [], "the shared engine left processes behind"


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


def test_hang_up_through_the_app_aborts_the_generation(engine, tmp_path):
    """Through the app, a client reads a few tokens of a 512-token answer and
    hangs up: vLLM stops running the request at once and generates no more."""
    from lab_utils.experiments.streaming import disconnect_aborts

    with AppServer.for_engine(engine, log_dir=tmp_path) as app:
        started = {app.proc.pid}
        cut, timeline = disconnect_aborts(engine, app, max_tokens=512, read_tokens=5)
    assert cut["pieces_read_before_hang_up"] >= 5
    assert cut["running_before_hang_up"] == 1, "the request was not running while streamed"
    assert timeline.running.max() == 1
    assert cut["running_zero_after_ms"] is not None and cut["running_zero_after_ms"] < 3000
    assert cut["generated_tokens"] < 100, cut
    assert cut["vllm_requests_finished"] == 0, "the request finished instead of being aborted"
    assert cut["app_client_disconnects"] == 1 and cut["app_upstream_aborted"] == 1
    # The app is gone; the module's engine still serves.
    assert [p for p in _mine() if p[0] in started] == []
    assert engine.server.alive


# The remote route, with this engine as the "remote" server

def test_what_the_server_tells_is_what_it_was_started_with(engine):
    info = read_server(engine.base_url)
    known = info.known()
    assert known["max_num_seqs"] == 8                        # --max-num-seqs 8
    assert known["max_model_len"] == 4096                    # the cpu profile's --max-model-len
    assert known["scheduling_policy"] == "fcfs" and known["speculative_config"] is None
    assert known["enable_prefix_caching"] is True and info.model == engine.model
    assert known["block_size"] == int(engine.info["cache_config"]["block_size"])


def test_emulated_off_never_hits_where_the_same_requests_do(engine, monkeypatch):
    monkeypatch.delenv("LAB_REMOTE_ARMS", raising=False)
    pool = EnginePool(lab.load_profile("remote", base_url=engine.base_url))
    off = pool.get(enable_prefix_caching=False)
    on = pool.get(enable_prefix_caching=True)
    assert off.emulation.name == "cache_salt" and on.emulation is None
    tok = lab.tokenizer_for(engine)
    block = int(engine.info["cache_config"]["block_size"])
    prompt = lab.synthetic_specs(tok, 1, 3 * block, max_tokens=2)[0].prompt
    specs = [lab.RequestSpec(prompt=prompt, max_tokens=2) for _ in range(3)]

    def hits(arm) -> float:
        before = scrape(engine.base_url).counters["prefix_cache_hits"]
        run = lab.Client.for_engine(arm).run(specs, lab.Load.sequential(), progress=False)
        assert all(r.ok for r in run.records), [r.error for r in run.records]
        return scrape(engine.base_url).counters["prefix_cache_hits"] - before
    assert hits(off) == 0
    assert hits(on) >= 2 * 2 * block  # the 2nd and 3rd request hit at least 2 full blocks
