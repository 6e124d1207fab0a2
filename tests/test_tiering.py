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
    five = tx.split_core_env(range(5))                     # the large tier gets the extra core
    assert five == {LARGE: {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2"},
                    SMALL: {"VLLM_CPU_OMP_THREADS_BIND": "3,4"}}
    with pytest.raises(ConfigError, match="cannot each have their own core"):
        tx.split_core_env([0])


def test_split_cores_refuses_a_remote_profile():
    from lab_utils.profiles import load_profile
    with pytest.raises(ConfigError, match="split_cores = False"):
        tx.plan(load_profile("remote", base_url="http://127.0.0.1:9"), {"split_cores": True})


def test_plan_keeps_both_tiers_alive_and_names_what_the_small_one_changes(monkeypatch):
    from lab_utils import capabilities as cap
    from lab_utils.arms import ROLE, env_knob
    from lab_utils.profiles import load_profile
    from test_capabilities import AVX512
    monkeypatch.setattr(cap, "probe", lambda *a, **k: cap.Capabilities(AVX512))
    cpu = load_profile("cpu")
    plan = tx.plan(cpu, {"split_cores": False})
    assert plan.names == [LARGE, SMALL] and plan.problems() == [] and plan.keep == 2
    assert plan.arm(SMALL).role == "small" and plan.arm(SMALL).knob == ROLE
    assert not plan.baseline.env and not plan.arm(SMALL).env
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    split = tx.plan(cpu, {"split_cores": True})
    assert dict(split.baseline.env) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert dict(split.arm(SMALL).env) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert split.arm(SMALL).knob == (ROLE, env_knob("VLLM_CPU_OMP_THREADS_BIND"))
    assert split.problems() == []


def test_the_small_tier_computes_in_a_dtype_its_int8_kernel_runs_here(monkeypatch):
    from lab_utils import capabilities as cap
    from lab_utils.arms import ROLE
    from lab_utils.profiles import load_profile
    from test_capabilities import AMX, AVX512
    cpu = load_profile("cpu")
    # Where W8A8 runs in the profile's float32 (the Zen 4 guest): as the profile says.
    monkeypatch.setattr(cap, "probe", lambda *a, **k: cap.Capabilities(AVX512))
    plan = tx.plan(cpu, {})
    assert not plan.arm(SMALL).flags and plan.arm(SMALL).knob == ROLE and not plan.notes
    # On AMX vLLM's INT8 GEMM takes only bfloat16 activations: the small tier
    # computes in bfloat16, the plan names both knobs and says why.
    monkeypatch.setattr(cap, "probe", lambda *a, **k: cap.Capabilities(AMX))
    plan = tx.plan(cpu, {})
    assert dict(plan.arm(SMALL).flags) == {"dtype": "bfloat16"}
    assert plan.arm(SMALL).knob == (ROLE, "dtype") and plan.problems() == []
    assert "expect A to be bfloat16" in plan.notes[0] and "bfloat16" in plan.arm(SMALL).title
    # Neither runs: no flags; the notebook's engine cell skips the tier with both reasons.
    failing = {**AMX, "w8a8_bf16": {"status": "fails", "reason": "no INT8 kernel"}}
    monkeypatch.setattr(cap, "probe", lambda *a, **k: cap.Capabilities(failing))
    flags, note = tx.small_tier_flags(cpu)
    assert flags == {} and "expect A to be bfloat16" in note and "no INT8 kernel" in note


def test_quality_pass_scores_each_tier_with_its_confidence(monkeypatch):
    from lab_utils.client import Run
    # Hand-made answers to the first two questions (France -> Paris, Italy ->
    # Rome): the large tier right on both, the small tier wrong on the second.
    answers = {LARGE: (["Paris.", "Rome."], [[-0.1, -0.3, -5.0], [-0.2, -0.2]]),
               SMALL: (["Paris", "Milan"], [[-0.5, -0.5], [-1.0, -2.0, -3.0]])}
    sent = []

    def fake_measure(engine, specs, load, *, label, tier, **kw):
        sent.append(specs)
        texts, lps = answers[tier]
        return Run(label, "", [RequestRecord(index=i, tag=s.tag, ok=True, text=t, logprobs=lp,
                                             output_tokens=len(lp))
                               for i, (s, t, lp) in enumerate(zip(specs, texts, lps))], 1.0)

    monkeypatch.setattr(tx, "measure", fake_measure)
    q = tx.quality_pass({LARGE: None, SMALL: None}, questions=2, max_tokens=16, probe_tokens=2)
    assert all(s.extra == {"logprobs": True} and s.temperature == 0.0 and s.max_tokens == 16
               for specs in sent for s in specs)
    assert list(q.columns) == ["tier", "id", "question", "answer", "ok", "correct",
                               "confidence", "output_tokens"]
    assert q.id.tolist() == ["k01", "k02", "k01", "k02"]
    assert q.correct.tolist() == [True, True, True, False]
    assert q.confidence.tolist() == pytest.approx([-0.2, -0.2, -0.5, -1.5])  # first 2 tokens
    assert q.output_tokens.tolist() == [3, 2, 2, 3]


def test_a_remote_engine_with_env_names_the_server_to_map(remote, tmp_path):
    from lab_utils.server import ArmUnavailable, EnginePool
    pool = EnginePool(remote, log_dir=tmp_path)
    with pytest.raises(ArmUnavailable) as err:
        pool.get(env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    text = str(err.value)
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in text and "--env" not in text
    assert '"env:VLLM_CPU_OMP_THREADS_BIND=0"' in text  # the key to map in LAB_REMOTE_ARMS


def _timed(index: int, ttft_s: float, e2e_s: float, text: str = "", route: str = ""):
    return RequestRecord(index=index, tag="", ok=True, ttft=ttft_s, e2e=e2e_s, output_tokens=4,
                         text=text, route=route)


def test_findings_hand_made():
    from lab_utils.client import Run
    work = tx.Workload([spec("What is the capital of France?", tag="fact"), spec("hi")],
                       [["paris"], None])
    # TPOT = (E2E - TTFT) / 3 with 4 output tokens.
    runs = {"large only": Run("large only", "", [_timed(0, 0.100, 0.400, "Paris"),
                                                 _timed(1, 0.300, 0.900)], 1.0),
            "small only": Run("small only", "", [_timed(0, 0.040, 0.160, "Paris"),
                                                 _timed(1, 0.060, 0.360)], 1.0),
            "routed": Run("routed", "", [_timed(0, 0.050, 0.200, "Lyon", "small rule"),
                                         _timed(1, 0.150, 0.750, "", "large rule")], 1.0)}
    runs["routed"].counters = {"large": {"requests_success": 1.0},
                               "small": {"requests_success": 1.0}}
    arms = tx.Arms(work, tx.rule_from(), runs)
    quality = pd.DataFrame({"tier": [LARGE, LARGE, SMALL, SMALL],
                            "correct": [True, False, True, True]})
    found = {f["metric"]: f for f in tx.findings(arms, quality, small_model="w8a8")}
    ttft, tpot = found["TTFT median, routed (ms)"], found["TPOT median, routed (ms)"]
    assert (ttft["baseline"], ttft["treated"]) == pytest.approx((200.0, 100.0))
    assert (tpot["baseline"], tpot["treated"]) == pytest.approx((150.0, 125.0))
    assert ttft["checklist"] == "model tiering:ttft" and tpot["checklist"] == "model tiering:tpot"
    assert ttft["reason"] == ("50% of requests on the small tier (w8a8); facts correct: "
                              "small 100%, large 50%")
    assert "vLLM's request_success counters: large 1, small 1" in ttft["mechanism"]
    assert ttft["samples"][0] == pytest.approx([100.0, 300.0])
    upper = found["TPOT median, small only (ms)"]
    assert (upper["baseline"], upper["treated"]) == pytest.approx((150.0, 70.0))
    assert "checklist" not in upper
    facts = found["fact questions correct (%)"]
    assert (facts["baseline"], facts["treated"]) == (50.0, 100.0)
    assert facts["mechanism"].endswith("the routed mix's scored facts: 0% correct")
    assert len(found) == 5


def test_a_small_tier_slower_than_the_large_one_is_said_to_be_in_the_findings():
    from lab_utils.client import Run
    work = tx.Workload([spec("What is the capital of France?", tag="fact"), spec("hi")],
                       [["paris"], None])
    # small tier alone: TTFT 40/60 ms against 100/300 ms (medians 50 vs 200: 0.25x);
    # TPOT (E2E - TTFT) / 3: 200/300 ms against 100/200 (250 vs 150: 1.67x)
    runs = {"large only": Run("large only", "", [_timed(0, 0.100, 0.400), _timed(1, 0.300, 0.900)], 1.0),
            "small only": Run("small only", "", [_timed(0, 0.040, 0.640), _timed(1, 0.060, 0.960)], 1.0),
            "routed": Run("routed", "", [_timed(0, 0.050, 0.650, "", "small rule"),
                                         _timed(1, 0.150, 0.750, "", "large rule")], 1.0)}
    runs["routed"].counters = {"large": {"requests_success": 1.0}, "small": {"requests_success": 1.0}}
    arms = tx.Arms(work, tx.rule_from(), runs)
    said = tx.tier_speed(arms)
    assert said.startswith("the small tier is not faster here (TTFT 0.25x the large tier's, "
                           "TPOT 1.67x the large tier's")
    assert "cannot cut TPOT on this machine" in said
    found = {f["metric"]: f for f in tx.findings(arms)}
    assert said in found["TPOT median, routed (ms)"]["reason"]
    assert said in found["TPOT median, small only (ms)"]["mechanism"]
    # the faster tier of test_findings_hand_made is called the faster one, and the
    # checklist's reason stays as it was
    fast = dict(runs, **{"small only": Run("small only", "", [_timed(0, 0.040, 0.160),
                                                              _timed(1, 0.060, 0.360)], 1.0)})
    assert tx.tier_speed(tx.Arms(work, tx.rule_from(), fast)).startswith(
        "the small tier is the faster one here")
    assert tx.tier_speed(tx.Arms(work, tx.rule_from(), {"routed": runs["routed"]})) == ""
