"""The request prefetcher (predictor, TTL cache, typing model, ledger), its
datasets, and the pure parts of the 10_request_prefetch experiments. The
prefetcher itself runs against the fake OpenAI server (no vLLM needed)."""
import asyncio
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
from fake_openai import CHAT_TOKENS

from lab_utils import prefetch as pf
from lab_utils.client import Client, run_sync
from lab_utils.experiments import request_prefetch as px
from lab_utils.paths import DATASETS_DIR, REPO_ROOT


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# --------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------

LOG = [("how do i reset my password", 50), ("how do i reset my router", 20),
       ("how to boil an egg", 30), ("how to tie a tie", 30), ("What is DNA?", 5)]


def test_normalize():
    assert pf.normalize("  What   is DNA? ") == "what is dna"
    assert pf.normalize("How To Boil an egg!") == "how to boil an egg"


def test_predict_ranks_prefix_matches_by_frequency():
    p = pf.QueryPredictor(LOG)
    assert p.predict("how", 2) == ["how do i reset my password", "how to boil an egg"]
    assert p.predict("how do i reset my r") == ["how do i reset my router"]
    assert p.predict("how to", 3) == ["how to boil an egg", "how to tie a tie"]  # tie: a-z
    assert p.predict("what is d") == ["what is dna"]
    assert p.predict("zebra") == []


def test_a_typed_space_is_part_of_the_prefix():
    p = pf.QueryPredictor([("how to fly", 1), ("how tom sawyer ends", 9)])
    assert p.predict("how to ", 2) == ["how to fly"]
    assert p.predict("how to", 2) == ["how tom sawyer ends", "how to fly"]


def test_duplicate_log_entries_add_up():
    p = pf.QueryPredictor([("a b c", 1), ("A B C?", 2), ("a b d", 2)])
    assert p.counts["a b c"] == 3 and p.predict("a b", 1) == ["a b c"]


# --------------------------------------------------------------------------
# The TTL cache
# --------------------------------------------------------------------------

def test_ttl_cache_expires_after_ttl():
    clock = Clock()
    cache = pf.TTLCache(30.0, clock=clock)
    cache.set("q", "answer")
    clock.now = 29.9
    assert "q" in cache and cache.get("q") == "answer" and cache.ttl("q") == pytest.approx(0.1)
    clock.now = 30.0
    assert "q" not in cache and cache.get("q") is None and cache.ttl("q") is None
    assert (cache.hits, cache.misses, cache.expired) == (1, 1, 1)


def test_ttl_cache_set_restarts_the_clock_and_purges():
    clock = Clock()
    cache = pf.TTLCache(10.0, clock=clock)
    cache.set("a", 1)
    cache.set("b", 2)
    clock.now = 8.0
    cache.set("a", 3)                # SETEX again: 10 s from now
    clock.now = 12.0
    assert len(cache) == 1 and cache.get("a") == 3 and cache.expired == 1


def test_ttl_cache_rejects_non_positive_ttl():
    with pytest.raises(ValueError):
        pf.TTLCache(0)


# --------------------------------------------------------------------------
# Typing
# --------------------------------------------------------------------------

def test_typing_timeline_is_seeded_and_realistic():
    text = "how do i make a budget for my family"
    keys, enter = pf.typing_timeline(text, np.random.default_rng(3))
    again = pf.typing_timeline(text, np.random.default_rng(3))
    assert (keys, enter) == again
    assert len(keys) == len(text) and keys[0] == 0 and enter > keys[-1]
    assert all(b >= a for a, b in itertools.pairwise(keys))
    gaps = np.diff(pf.typing_timeline("x" * 4001, np.random.default_rng(0))[0])
    assert 225 < gaps.mean() < 252          # ~238 ms mean inter-key interval


def test_typing_session_checks_and_retime():
    s = pf.TypingSession("s1", "abc", (0, 200, 500), 900)
    assert list(s.prefixes()) == [(0.0, "a"), (0.2, "ab"), (0.5, "abc")]
    fast = pf.retime(s, 2.0)
    assert fast.keys_ms == (0, 100, 250) and fast.enter_ms == 450
    with pytest.raises(ValueError):
        pf.TypingSession("s2", "abc", (0, 200), 900)
    with pytest.raises(ValueError):
        pf.TypingSession("s3", "ab", (0, 300), 100)
    assert pf.TypingSession.from_json(s.to_json()) == s


# --------------------------------------------------------------------------
# The shipped datasets
# --------------------------------------------------------------------------

def test_query_log_is_skewed_and_sessions_match_it():
    log = pf.query_log()
    assert len(log) == 100 and sum(r["count"] for r in log) == 3000
    counts = [r["count"] for r in log]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > 20 * counts[-1]                 # a Zipf-like head and tail
    assert len({r["id"] for r in log}) == len(log)
    logged = {pf.normalize(r["query"]) for r in log}
    sessions = pf.typing_sessions()
    assert len(sessions) == 64
    for s in sessions:
        assert (pf.normalize(s.query) in logged) == s.in_log
    assert 0 < sum(not s.in_log for s in sessions) < len(sessions) / 3


def test_query_datasets_are_reproducible():
    out = subprocess.run([sys.executable, str(DATASETS_DIR / "build_query_datasets.py"),
                          "--check"], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_replay_counts_find_the_lead_time():
    p = pf.QueryPredictor(LOG)
    s = pf.TypingSession("s", "how to tie a tie", tuple(range(0, 1600, 100)), 2000)
    row = px.prefetch_replay_counts([s], p).iloc[0]
    # "how" predicts password and egg; "how t" (5th key) predicts egg and tie
    assert row["predicted at char"] == 5
    assert row["lead before Enter (s)"] == pytest.approx(2.0 - 0.4)
    assert row["queries predicted"] == 3
    new = pf.TypingSession("n", "zebra crossing", tuple(range(0, 1400, 100)), 1500)
    assert pd_isna(px.prefetch_replay_counts([new], p).iloc[0]["predicted at char"])


def pd_isna(value):
    import pandas as pd
    return pd.isna(value)


# --------------------------------------------------------------------------
# The prefetcher against the fake server (150 ms per answer, 5 tokens)
# --------------------------------------------------------------------------



def _prefetcher(fake, session, **kw):
    client = Client(fake.base_url, "chat")
    return pf.RequestPrefetcher(client, session, pf.QueryPredictor(LOG), pf.TTLCache(30.0), **kw)


def test_hit_in_flight_hit_and_miss(fake):
    async def go():
        from lab_utils.admission import client_session
        async with client_session(Client(fake.base_url, "chat")) as session:
            p = _prefetcher(fake, session)
            assert p.on_keystroke("ho") == []                      # below min_prefix_chars
            started = p.on_keystroke("how")
            assert started == ["how do i reset my password", "how to boil an egg"]
            assert p.on_keystroke("how ") == []                     # same top 2: nothing new
            await asyncio.sleep(0.3)                                # both answers cached
            hit = await p.answer("How do I reset my password?")
            p.on_keystroke("how to t")                              # -> "how to tie a tie"
            in_flight = await p.answer("how to tie a tie")         # still generating
            miss = await p.answer("what is the weather")
            await p.drain()
            return p, hit, in_flight, miss

    p, hit, in_flight, miss = run_sync(go())
    # a hit is served from memory: well under the > 50 ms of a request still generating
    assert hit.outcome == "hit" and hit.full_ms < 25 and hit.output_tokens == CHAT_TOKENS
    assert in_flight.outcome == "in-flight hit" and 50 < in_flight.full_ms < 1000
    assert miss.outcome == "miss" and miss.first_ms < miss.full_ms
    bodies = [r["body"]["messages"][-1]["content"] for r in fake.requests]
    assert bodies.count("how do i reset my password") == 1         # prefetched once, served
    cost = p.cost()
    assert cost["prefetches"] == 3 and cost["prefetches_used"] == 2
    assert cost["tokens_generated"] == 3 * CHAT_TOKENS
    assert cost["tokens_wasted"] == CHAT_TOKENS                    # the egg nobody asked for


def test_disabled_prefetcher_only_misses(fake):
    async def go():
        from lab_utils.admission import client_session
        async with client_session(Client(fake.base_url, "chat")) as session:
            p = _prefetcher(fake, session, enabled=False)
            assert p.on_keystroke("how do i") == []
            return p, await p.answer("how do i reset my password")

    p, served = run_sync(go())
    assert served.outcome == "miss" and len(fake.requests) == 1
    assert p.cost()["prefetches"] == 0


def test_in_flight_cap_skips_predictions(fake):
    async def go():
        from lab_utils.admission import client_session
        async with client_session(Client(fake.base_url, "chat")) as session:
            p = _prefetcher(fake, session, max_in_flight=1)
            started = p.on_keystroke("how")
            await p.drain()
            return p, started

    p, started = run_sync(go())
    assert started == ["how do i reset my password"] and p.skipped_at_cap == 1


def test_records_reach_the_callback(fake):
    seen = []

    async def go():
        from lab_utils.admission import client_session
        async with client_session(Client(fake.base_url, "chat")) as session:
            p = _prefetcher(fake, session, on_record=seen.append)
            p.on_keystroke("how to b")
            await p.drain()
            await p.answer("zzz")

    run_sync(go())
    assert [r.tag for r in seen] == ["prefetch", "typed"]
    assert json.dumps(seen[0].to_json())


def _arm(label, outcomes, bg_ttfts, gen_tokens, t_start):
    from lab_utils.client import RequestRecord, Run
    sessions = [pf.TypingSession(f"s{i}", "abc", (0, 100, 200), 300) for i in range(len(outcomes))]
    served = [pf.Served("abc", o, 0.0 if o == "hit" else 100.0, 0.0 if o == "hit" else 900.0, 5)
              for o in outcomes]
    bg = Run("bg", "", [RequestRecord(index=i, tag="background", ttft=t, e2e=t + 1.0, ok=True,
                                      output_tokens=11) for i, t in enumerate(bg_ttfts)], 10.0)
    cost = {"prefetches": 3, "prefetches_failed": 0, "prefetches_used": 1, "tokens_generated": 15,
            "tokens_used": 5, "tokens_wasted": 10, "skipped_at_cap": 0}
    counters = {"generation_tokens": gen_tokens, "prompt_tokens": 1, "requests_success": 4,
                "preemptions": 0}
    return px.PrefetchArm(label, sessions, [0.0] * len(sessions), served, cost, bg, [], counters,
                          10.0, {"t_start": t_start})


def test_merge_pools_rounds_and_round_table_keeps_them():
    a = px.merge([_arm("with prefetch", ["hit", "miss"], [0.1, 0.3], 100, 2.0),
                  _arm("with prefetch", ["hit"], [0.2], 50, 5.0)])
    b = px.merge([_arm("without prefetch", ["miss"], [0.1], 80, 1.0),
                  _arm("without prefetch", ["miss", "miss"], [0.1, 0.1], 70, 6.0)])
    assert len(a.served) == 3 and a.cost["tokens_wasted"] == 20
    assert a.counters["generation_tokens"] == 150 and len(a.background.records) == 3
    row = px.summary_row(a)
    assert row["hit (%)"] == pytest.approx(200 / 3) and row["wasted tokens per served query"] == \
        pytest.approx(20 / 3)
    rounds = px.round_table([a, b])
    assert list(rounds.index) == [(1, "without prefetch"), (1, "with prefetch"),
                                  (2, "with prefetch"), (2, "without prefetch")]
    assert rounds.loc[(1, "with prefetch"), "background TTFT p50"] == pytest.approx(200.0)
    table = px.outcome_table([a, b])
    assert table.loc[("with prefetch", "hit"), "sessions"] == 2


def test_findings_carry_the_engine_counters():
    without = px.merge([_arm("without prefetch", ["miss", "miss"], [0.1, 0.2], 80, 1.0)])
    with_ = px.merge([_arm("with prefetch", ["hit", "miss"], [0.3, 0.4], 120, 2.0)])
    found = px.findings(without, with_)
    assert len(found) == 5 and all(f["article_claim"] == px.CLAIM for f in found)
    hit_rate, latency, cost = found[:3]
    assert (hit_rate["baseline"], hit_rate["treated"]) == (0.0, 50.0)
    assert latency["treated"] == 0.0 and latency["baseline"] == pytest.approx(900.0)
    assert cost["treated"] == pytest.approx(5.0) and "80 -> 120" in cost["mechanism"]
    assert found[3]["baseline"] == pytest.approx(150.0) and found[3]["treated"] == pytest.approx(350.0)


def test_plan_is_the_one_baseline_engine():
    from lab_utils.profiles import load_profile
    plan = px.plan(load_profile("cpu"), {})
    assert plan.names == ["baseline"] and plan.problems() == []
    assert not plan.baseline.flags and plan.baseline.role is None
