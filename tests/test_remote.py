"""`lab_utils.remote`: what a server tells of itself, and which of a plan's
arms it serves as it is, emulated per request, or not (hand-made cases of a
default vLLM server: prefix caching on, FCFS, no speculative decoding)."""
from __future__ import annotations

import pytest
from fake_openai import FakeOpenAI

from lab_utils.arms import Arm, Plan
from lab_utils.client import Client, Load, RequestSpec
from lab_utils.remote import Placement, ServerInfo, place, plan_knobs, read_server

DEFAULT = ServerInfo("http://s:8000", model="m", max_model_len=8192,
                     cache={"enable_prefix_caching": "True", "block_size": "16",
                            "cache_dtype": "auto", "num_gpu_blocks": "47784"},
                     spec_decode=False)
#: The same server started with VLLM_SERVER_DEV_MODE=1: /server_info tells its config.
DEV = ServerInfo("http://s:8000", model="m", max_model_len=8192, cache=DEFAULT.cache,
                 spec_decode=False, config={"scheduler_config": {
                     "enable_chunked_prefill": True, "max_num_batched_tokens": 2048,
                     "max_num_seqs": 256, "policy": "fcfs", "long_prefill_token_threshold": 0},
                     "speculative_config": None})


def plan_of(*arms: Arm) -> Plan:
    return Plan("nb", tuple(arms))


def test_known_flags_are_what_the_server_told():
    assert DEFAULT.known() == {"enable_prefix_caching": True, "block_size": 16,
                               "kv_cache_dtype": "auto", "max_model_len": 8192,
                               "speculative_config": None}
    assert {k: DEV.known()[k] for k in ("max_num_batched_tokens", "scheduling_policy",
                                        "max_num_seqs")} == {
        "max_num_batched_tokens": 2048, "scheduling_policy": "fcfs", "max_num_seqs": 256}
    assert "VLLM_SERVER_DEV_MODE=1" in DEFAULT.describe()
    assert "max_num_batched_tokens 2048" in DEV.describe()
    assert ServerInfo("u").known() == {}  # a server that tells nothing


def test_prefix_caching_off_is_emulated_with_a_fresh_salt_per_request():
    off = Arm("off", flags={"enable_prefix_caching": False})
    on = Arm("on", flags={"enable_prefix_caching": True}, knob="enable_prefix_caching",
             reference="off")
    plan = plan_of(off, on)
    p_off, p_on = place(off, plan, DEFAULT), place(on, plan, DEFAULT)
    assert isinstance(p_on, Placement) and p_on.emulation is None
    assert isinstance(p_off, Placement) and p_off.emulation.name == "cache_salt"
    salts = {p_off.emulation.request_fields()["cache_salt"] for _ in range(3)}
    assert len(salts) == 3
    # a server with prefix caching off cannot emulate it on
    off_server = ServerInfo("u", cache={"enable_prefix_caching": "False"})
    assert "the server runs enable_prefix_caching=False" in place(on, plan, off_server)
    assert place(off, plan, off_server).emulation is None


def test_slots_and_order_the_server_does_not_tell_are_the_clients_queue():
    fcfs = Arm("fcfs", flags={"max_num_seqs": 4})
    prio = Arm("priority", flags={"max_num_seqs": 4, "scheduling_policy": "priority"},
               knob="scheduling_policy", reference="fcfs")
    plan = plan_of(fcfs, prio)
    assert plan_knobs(plan) == {"scheduling_policy"}
    a, b = place(fcfs, plan, DEFAULT), place(prio, plan, DEFAULT)
    assert (a.emulation.slots, a.emulation.by_priority) == (4, False)
    assert (b.emulation.slots, b.emulation.by_priority) == (4, True)
    assert a.emulation.request_fields() == {} and "emulated by the client" in a.notes[0]
    # a server that tells 256 slots and FCFS: 4 slots emulated all the same
    assert place(prio, plan, DEV).emulation.by_priority
    # the server has the arm's slots and tells its FCFS policy: the engine queues
    same = ServerInfo("u", config={"scheduler_config": {"max_num_seqs": 4, "policy": "fcfs"}})
    assert place(fcfs, plan, same).emulation is None
    assert "the server runs scheduling_policy='fcfs'" in place(prio, plan, same)
    prio_server = ServerInfo("u", config={"scheduler_config": {"max_num_seqs": 4,
                                                               "policy": "priority"}})
    assert place(prio, plan, prio_server).emulation is None
    fcfs_there = place(fcfs, plan, prio_server)  # relies on the default fcfs: emulated
    assert fcfs_there.emulation.request_fields() == {"priority": 0}
    # no slot count to queue at: the priority order cannot be emulated
    bare = Arm("p", flags={"scheduling_policy": "priority"}, knob="scheduling_policy",
               reference="fcfs")
    assert "does not tell its own scheduling_policy" in place(bare, plan_of(fcfs, bare), DEFAULT)


def test_the_client_queue_serves_in_order_at_most_its_slots():
    import asyncio

    from lab_utils.admission import ClientQueue
    from lab_utils.client import RequestSpec

    def order(by_priority: bool) -> tuple[list[str], int]:
        queue, started = ClientQueue(2, by_priority), []
        # six arrive at once: batch (priority 1) first, then interactive (priority 0)
        specs = [RequestSpec(prompt=f"b{i}", max_tokens=1, priority=1, tag=f"b{i}")
                 for i in range(4)] + [RequestSpec(prompt=f"i{i}", max_tokens=1, priority=0,
                                                   tag=f"i{i}") for i in range(2)]
        most = 0

        async def one(spec):
            await queue.admit(spec)
            nonlocal most
            most = max(most, queue.in_flight)
            started.append(spec.tag)
            await asyncio.sleep(0.01)
            queue.release(spec)

        async def main():
            await asyncio.gather(*(one(s) for s in specs))
        asyncio.run(main())
        assert queue.in_flight == 0
        return started, most
    assert order(False) == (["b0", "b1", "b2", "b3", "i0", "i1"], 2)
    assert order(True) == (["b0", "b1", "i0", "i1", "b2", "b3"], 2)  # no preemption of b0, b1


def test_an_unknown_compared_knob_skips_an_uncompared_one_is_the_servers():
    off = Arm("off", flags={"enable_chunked_prefill": False, "max_num_batched_tokens": 4096,
                            "enable_logging_iteration_details": True})
    on = Arm("on", flags={"enable_chunked_prefill": True, "max_num_batched_tokens": 256},
             knob=("enable_chunked_prefill", "max_num_batched_tokens"), reference="off")
    why = place(off, plan_of(off, on), DEFAULT)
    assert isinstance(why, str) and "does not tell its own enable_chunked_prefill" in why
    alone = place(off, plan_of(off), DEFAULT)  # nothing compared: the server's own values
    assert isinstance(alone, Placement)
    assert any("engine-step log" in n for n in alone.notes)
    # a dev-mode server tells: the off arm cannot run there, a 2048 budget can
    assert "the server runs enable_chunked_prefill=True" in place(off, plan_of(off, on), DEV)
    at_2048 = Arm("on", flags={"enable_chunked_prefill": True, "max_num_batched_tokens": 2048},
                  knob=on.knob, reference="off")
    assert isinstance(place(at_2048, plan_of(off, at_2048), DEV), Placement)


def test_roles_env_knobs_and_other_lengths():
    plan = plan_of(Arm("a"), Arm("b", env={"X": "1"}, knob="env:X", reference="a"))
    assert "another model" in place(Arm("s", role="small"), plan, DEFAULT)
    assert "environment" in place(plan.arms[1], plan, DEFAULT)
    shorter = place(Arm("c", flags={"max_model_len": 1024}), plan, DEFAULT)
    assert isinstance(shorter, Placement)  # the server's 8192 holds every 1024-token request
    assert "the server runs max_model_len=8192" in place(
        Arm("c", flags={"max_model_len": 16384}), plan, DEFAULT)
    fp8 = Arm("f", flags={"kv_cache_dtype": "fp8"}, knob="kv_cache_dtype", reference="a")
    assert "the server runs kv_cache_dtype='auto'" in place(fp8, plan_of(Arm("a"), fp8), DEFAULT)
    # not compared, a setting both arms share is the server's (noted)
    shared = place(Arm("f", flags={"kv_cache_dtype": "fp8"}), plan, DEFAULT)
    assert any("kv_cache_dtype is the server's 'auto'" in n for n in shared.notes)


@pytest.fixture
def fake():
    f = FakeOpenAI().start()
    yield f
    f.stop()


def test_read_server_of_a_server_without_metrics_leaves_them_unknown(fake):
    info = read_server(fake.base_url)
    assert info.model == "chat" and info.spec_decode is None and info.cache == {}
    assert "prefix caching not told" in info.describe()


def test_an_emulated_engines_requests_each_carry_their_own_salt(fake):
    from lab_utils.profiles import load_profile
    from lab_utils.server import EnginePool
    profile = load_profile("remote", base_url=fake.base_url)
    pool = EnginePool(profile)
    pool._server_info = ServerInfo(fake.base_url, model="chat",
                                   cache={"enable_prefix_caching": "True"})
    engine = pool.get(enable_prefix_caching=False)
    assert engine.emulation.name == "cache_salt" and "emulated" in engine.describe()["emulated"]
    specs = [RequestSpec(messages=[{"role": "user", "content": "hi"}], max_tokens=2)] * 3
    run = Client.for_engine(engine).run(specs, Load.sequential(), label="off", progress=False)
    assert all(r.ok for r in run.records)
    salts = [r["body"].get("cache_salt") for r in fake.requests]
    assert len(set(salts)) == 3 and None not in salts
    fake.reset()
    Client.for_engine(pool.get()).run(specs, Load.sequential(), label="on", progress=False)
    assert [r["body"].get("cache_salt") for r in fake.requests] == [None] * 3


def test_a_queued_requests_times_start_when_it_entered_the_queue():
    from lab_utils.admission import since_queued
    from lab_utils.client import RequestRecord
    rec = RequestRecord(index=0, tag="", start=10.0, send_time=100.0, ttft=0.2, e2e=1.2,
                        output_tokens=11, chunk_times=[0.2, 1.2], ok=True)
    tpot = rec.tpot
    since_queued(rec, 0.5)
    assert (rec.start, rec.send_time, rec.ttft, rec.e2e) == (9.5, 99.5, 0.7, 1.7)
    assert rec.chunk_times == [0.7, 1.7] and rec.tpot == pytest.approx(tpot)  # 0.1 s either way
