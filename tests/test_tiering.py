"""The model-tiering router (lab_utils.tiering) and the 11_model_tiering
experiment helpers that need no engine: rules, decisions, the confidence probe
against the fake server, user-seen records, the quality composition."""
from __future__ import annotations

import math

import pandas as pd
import pytest
from fake_openai import CHAT_FIRST_S, CHAT_GAP_S, CHAT_TOKENS
from stand_ins import word_tokenizer

from lab_utils.client import Client, Load, RequestRecord, RequestSpec
from lab_utils.experiments import model_tiering as tx
from lab_utils.profiles import ConfigError
from lab_utils.tiering import (
    LARGE,
    SMALL,
    Router,
    TieredClient,
    TierRule,
    confidence,
    escalated,
    held_until,
    released,
    tier_of,
)
from lab_utils.workloads import chat


def words(text: str) -> int:
    return len(text.split())


def spec(text: str, tag: str = "chat", **kw) -> RequestSpec:
    return RequestSpec(messages=chat(text), tag=tag, **kw)


# -- the rule ---------------------------------------------------------------

def test_task_type_comes_first():
    router = Router(TierRule(max_small_prompt_tokens=100), words)
    d = router.route(spec("fix this", tag="code"))
    assert (d.tier, d.reason) == (LARGE, "task code")


def test_prompt_length_sends_long_prompts_large():
    router = Router(TierRule(max_small_prompt_tokens=5), words)
    assert router.route(spec("one two three four five")).tier == SMALL
    d = router.route(spec("one two three four five six"))
    assert d.tier == LARGE and d.reason == "prompt 6 > 5 tokens"


def test_system_prompt_counts_toward_the_length():
    router = Router(TierRule(max_small_prompt_tokens=5), words)
    long_system = RequestSpec(messages=chat("hi", system="a b c d e f"), tag="chat")
    assert router.route(long_system).tier == LARGE


def test_token_id_prompts_are_counted_as_ids():
    router = Router(TierRule(max_small_prompt_tokens=3), words)
    assert router.route(RequestSpec(prompt=[1, 2, 3, 4], tag="x")).tier == LARGE


def test_zero_limit_sends_everything_large():
    router = Router(TierRule(max_small_prompt_tokens=0), words)
    assert router.route(spec("hi")).tier == LARGE


@pytest.mark.parametrize("kw, fix", [
    ({"large_tasks": "code"}, "large_tasks=('code',)"),
    ({"max_small_prompt_tokens": -1}, ">= 0"),
    ({"max_small_prompt_tokens": 2.5}, ">= 0"),
    ({"min_confidence": 0.5}, "<= 0"),
    ({"probe_tokens": 0}, ">= 1"),
])
def test_bad_rules_name_the_fix(kw, fix):
    with pytest.raises(ConfigError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        TierRule(**kw)


def test_describe_names_every_part():
    text = TierRule(min_confidence=-0.6, probe_tokens=4).describe()
    assert "code, document -> large" in text and "over 256 tokens" in text
    assert "first 4 tokens is below -0.6" in text
    assert "escalated" not in TierRule().describe()


def test_rule_from_notebook_parameters():
    rule = tx.rule_from("code, chat", 64, -0.5, 0)
    assert rule.large_tasks == ("code", "chat") and not rule.probes
    assert tx.rule_from("", 64, -0.5, 4) == TierRule((), 64, -0.5, 4)


# -- confidence and user-seen records ------------------------------------------

def test_confidence_is_the_mean_of_the_first_tokens():
    assert confidence([-0.1, -0.3, -2.0], 2) == pytest.approx(-0.2)
    assert confidence([-0.1, -0.3]) == pytest.approx(-0.2)
    assert math.isnan(confidence([]))


def test_router_confident_without_a_probe_is_always_true():
    assert Router(TierRule(), words).confident([])
    probing = Router(TierRule(min_confidence=-0.5, probe_tokens=2), words)
    assert probing.confident([-0.4, -0.6, -9])
    assert not probing.confident([-0.4, -0.7])
    assert not probing.confident([])


def record(**kw) -> RequestRecord:
    base = dict(index=3, tag="fact", ok=True, ttft=0.1, e2e=0.5, output_tokens=5,
                chunk_times=[0.1, 0.2, 0.3, 0.4, 0.5], chunk_tokens=[1, 2, 3, 4, 5],
                itl=[0.1] * 4)
    return RequestRecord(**{**base, **kw})


def test_released_shows_the_probe_tokens_together():
    out = released(record(), 3)
    assert out.ttft == pytest.approx(0.3) and out.e2e == pytest.approx(0.5)
    assert out.itl == pytest.approx([0.1, 0.1])
    assert held_until(record(), 3) == pytest.approx(0.3)


def test_an_answer_shorter_than_the_probe_appears_whole():
    out = released(record(), 8)
    assert out.ttft == out.e2e == pytest.approx(0.5) and out.itl == []
    assert out.tpot == 0.0


def test_escalated_counts_from_the_first_send():
    probe = record(index=7, label="routed", send_time=100.0, start=5.0)
    final = record(index=0, ttft=0.2, e2e=1.0, chunk_times=[0.2, 1.0], chunk_tokens=[1, 2],
                   output_tokens=2, itl=[0.8])
    out = escalated(probe, final, offset_s=0.35)
    assert (out.index, out.label, out.send_time, out.start) == (7, "routed", 100.0, 5.0)
    assert out.ttft == pytest.approx(0.55) and out.e2e == pytest.approx(1.35)
    assert out.chunk_times == pytest.approx([0.55, 1.35]) and out.itl == [0.8]


def test_tier_of_reads_the_route():
    assert tier_of(RequestRecord(0, "", route="small->large (x)")) == "small->large"
    assert tier_of(RequestRecord(0, "")) == ""


# -- TieredClient against the fake server -----------------------------------

def tiered(fake, rule: TierRule) -> TieredClient:
    # Both tiers are the fake server: the router's choice shows in `route` and
    # in the requests the fake saw.
    return TieredClient(Client(fake.base_url, "chat"), Client(fake.base_url, "chat"),
                        Router(rule, words))


def test_routes_without_a_probe(fake):
    client = tiered(fake, TierRule(max_small_prompt_tokens=3))
    run = client.run([spec("short one"), spec("a b c d e"), spec("x", tag="code")],
                     Load.sequential(), progress=False)
    assert [tier_of(r) for r in run.records] == [SMALL, LARGE, LARGE]
    assert all(r.ok and r.output_tokens == CHAT_TOKENS for r in run.records)
    assert not any("logprobs" in req["body"] for req in fake.requests)


def test_a_confident_probe_keeps_the_small_answer(fake):
    fake.logprob = -0.2
    client = tiered(fake, TierRule(min_confidence=-0.5, probe_tokens=2))
    rec = client.run([spec("hello")], progress=False).records[0]
    assert tier_of(rec) == SMALL and "confidence -0.20" in rec.route
    assert rec.logprobs == [-0.2] * CHAT_TOKENS and rec.output_tokens == CHAT_TOKENS
    assert fake.requests[0]["body"]["logprobs"] is True and len(fake.requests) == 1
    # The user sees the first 2 tokens together, when the second arrives (the
    # stream's first chunk is the assistant role, with no token).
    assert rec.chunk_tokens[:3] == [0, 1, 2]
    assert rec.ttft == pytest.approx(rec.chunk_times[2])
    assert rec.ttft >= CHAT_FIRST_S + 2 * CHAT_GAP_S - 0.005


def test_an_unsure_probe_hangs_up_and_asks_the_large_model(fake):
    fake.logprob = -1.5
    client = tiered(fake, TierRule(min_confidence=-0.5, probe_tokens=2))
    rec = client.run([spec("hello")], progress=False).records[0]
    assert tier_of(rec) == f"{SMALL}->{LARGE}" and "-1.50 < -0.5" in rec.route
    assert len(fake.requests) == 2 and "logprobs" not in fake.requests[1]["body"]
    assert rec.ok and rec.output_tokens == CHAT_TOKENS and rec.logprobs == []
    # User-seen TTFT: the probe's two tokens, then the large model's first chunk.
    probe_s = CHAT_FIRST_S + 2 * CHAT_GAP_S
    assert rec.ttft >= probe_s + CHAT_FIRST_S - 0.005


def test_stop_when_hangs_up_and_keeps_what_arrived(fake):
    run = Client(fake.base_url, "chat")
    import asyncio

    async def go():
        async with run._session() as session:
            return await run.send(session, spec("hello"),
                                  stop_when=lambda r: len(r.chunk_times) >= 3)
    rec = asyncio.run(go())
    assert rec.ok and rec.finish_reason == "client_stop"
    assert rec.output_tokens == 2 and len(rec.chunk_times) == 3  # role chunk + 2 tokens
    assert rec.e2e == pytest.approx(rec.chunk_times[-1])


# -- the experiment's pure parts ------------------------------------------------

def test_mixed_workload_is_seeded_and_scored_only_for_facts():
    a = tx.mixed_workload(facts=4, chats=2, code=1, seed=1)
    b = tx.mixed_workload(facts=4, chats=2, code=1, seed=1)
    assert [s.messages for s in a.specs] == [s.messages for s in b.specs]
    assert sorted(s.tag for s in a.specs) == ["chat", "chat", "code", "fact", "fact", "fact",
                                              "fact"]
    assert all((e is not None) == (s.tag == "fact") for s, e in zip(a.specs, a.expected))


@pytest.mark.parametrize("kw, match", [({"facts": -1}, "facts"), ({"facts": 0, "chats": 0,
                                                                       "code": 0}, "empty"),
                                       ({"facts": 41}, "at most")])
def test_mixed_workload_rejects_bad_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        tx.mixed_workload(**kw)


def test_routing_plan_uses_the_rule():
    work = tx.mixed_workload(facts=2, chats=1, code=1)
    plan = tx.routing_plan(Router(TierRule(), word_tokenizer().count), work)
    assert set(plan[plan.task == "code"].tier) == {LARGE}
    assert set(plan[plan.task != "code"].tier) == {SMALL}


def test_threshold_sweep_composes_measured_answers():
    q = pd.DataFrame([
        {"tier": SMALL, "id": "a", "correct": True, "confidence": -0.2},
        {"tier": SMALL, "id": "b", "correct": False, "confidence": -0.9},
        {"tier": LARGE, "id": "a", "correct": False, "confidence": -0.3},
        {"tier": LARGE, "id": "b", "correct": True, "confidence": -0.4},
    ])
    sweep = tx.threshold_sweep(q, [-0.5, -0.1]).set_index("threshold")
    assert sweep.loc["no probe", "correct_pct"] == 50
    assert sweep.loc["-0.5", "escalated_pct"] == 50 and sweep.loc["-0.5", "correct_pct"] == 100
    assert sweep.loc["-0.1", "escalated_pct"] == 100 and sweep.loc["-0.1", "correct_pct"] == 50
    assert sweep.loc["large only", "correct_pct"] == 50


# -- tiers on their own cores ---------------------------------------------------

def test_split_core_env_gives_each_tier_half_the_cores():
    assert tx.split_core_env([1, 0]) == {LARGE: {"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                         SMALL: {"VLLM_CPU_OMP_THREADS_BIND": "1"}}
    assert tx.split_core_env(range(5))[SMALL] == {"VLLM_CPU_OMP_THREADS_BIND": "2,3,4"}
    with pytest.raises(ConfigError, match="at least 2 cores"):
        tx.split_core_env([0])


def test_split_cores_refuses_a_remote_profile(monkeypatch, tmp_path):
    from lab_utils.profiles import load_profile
    from lab_utils.server import EnginePool

    class Ctx:
        profile = load_profile("remote", base_url="http://127.0.0.1:9")
        engines = EnginePool(profile, log_dir=tmp_path)

    with pytest.raises(ConfigError, match="split_cores = False"):
        tx.tier_engines(Ctx(), split_cores=True)


def test_a_remote_engine_with_env_names_the_server_to_map(monkeypatch, tmp_path):
    from lab_utils.profiles import load_profile
    from lab_utils.server import ArmUnavailable, EnginePool
    monkeypatch.delenv("LAB_REMOTE_ARMS", raising=False)
    pool = EnginePool(load_profile("remote", base_url="http://127.0.0.1:9"), log_dir=tmp_path)
    with pytest.raises(ArmUnavailable) as err:
        pool.get(env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    text = str(err.value)
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in text and "--env" not in text
    assert '"env:VLLM_CPU_OMP_THREADS_BIND=0"' in text  # the key to map in LAB_REMOTE_ARMS
