"""The remote route against a real vLLM engine (marked `engine`): one local CPU
engine started with VLLM_SERVER_DEV_MODE=1 and --max-num-seqs 8 is the
"remote" server. What `lab_utils.remote` reads must be what the engine was
started with, and the emulated "prefix caching off" (a fresh cache_salt per
request) must keep vLLM's own hit counter at 0 where the same requests hit
without it."""
from __future__ import annotations

import pytest

import lab_utils as lab
from lab_utils.counters import scrape
from lab_utils.remote import read_server
from lab_utils.server import EnginePool

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with EnginePool(lab.load_profile("cpu"), log_dir=tmp_path_factory.mktemp("logs")) as pool:
        yield pool.get(env={"VLLM_SERVER_DEV_MODE": "1"}, max_num_seqs=8)


def test_what_the_server_tells_is_what_it_was_started_with(server):
    info = read_server(server.base_url)
    known = info.known()
    assert known["max_num_seqs"] == 8                        # --max-num-seqs 8
    assert known["max_model_len"] == 4096                    # the cpu profile's --max-model-len
    assert known["scheduling_policy"] == "fcfs" and known["speculative_config"] is None
    assert known["enable_prefix_caching"] is True and info.model == server.model
    assert known["block_size"] == int(server.info["cache_config"]["block_size"])


def test_emulated_off_never_hits_where_the_same_requests_do(server, monkeypatch):
    monkeypatch.delenv("LAB_REMOTE_ARMS", raising=False)
    pool = EnginePool(lab.load_profile("remote", base_url=server.base_url))
    off = pool.get(enable_prefix_caching=False)
    on = pool.get(enable_prefix_caching=True)
    assert off.emulation.name == "cache_salt" and on.emulation is None
    tok = lab.tokenizer_for(server)
    block = int(server.info["cache_config"]["block_size"])
    prompt = lab.synthetic_specs(tok, 1, 3 * block, max_tokens=2)[0].prompt
    specs = [lab.RequestSpec(prompt=prompt, max_tokens=2) for _ in range(3)]

    def hits(engine) -> float:
        before = scrape(server.base_url).counters["prefix_cache_hits"]
        run = lab.Client.for_engine(engine).run(specs, lab.Load.sequential(), progress=False)
        assert all(r.ok for r in run.records), [r.error for r in run.records]
        return scrape(server.base_url).counters["prefix_cache_hits"] - before
    assert hits(off) == 0
    assert hits(on) >= 2 * 2 * block  # the 2nd and 3rd request hit at least 2 full blocks
