"""`13_replica_routing`'s module without an engine: the plan on the cpu and
gpu profiles, the KV budget arithmetic (checked by hand from the model's
config.json: 30 layers, 3 KV heads of 64 in float32), the tenant workload,
and the per-replica tables and findings from hand-made counters."""
from __future__ import annotations

from collections import Counter

import pytest
from stand_ins import word_tokenizer

from lab_utils.client import RequestRecord, Run
from lab_utils.experiments import replica_routing as rr
from lab_utils.kv_memory import CPU_KV_ENV, byte_budget_profile
from lab_utils.profiles import ConfigError

PARAMS = {"replicas": 2, "tenants": 6, "prefix_tokens": 512, "concurrency": 2}


def test_kv_budget_holds_a_replicas_share_of_the_prompts(cpu):
    size = rr.kv_budget(cpu, PARAMS)
    # 2 (K, V) x 30 layers x 3 KV heads x 64 x 4 bytes
    assert size["bytes_per_token"] == 46_080
    assert size["block_size"] == 128                        # vLLM's CPU default
    assert size["max_model_len"] == 640                     # 512 + 128, whole blocks
    assert (size["prefix_blocks"], size["own_blocks"]) == (4, 1)
    # 3 tenants' 4 blocks + 2 requests in flight x 1 block of their own
    assert size["kv_blocks"] == 14
    assert size["flags"] == {"max_model_len": 640, "enable_scale_out": True,
                             "kv_cache_memory_bytes": 14 * 128 * 46_080}


def test_plan_declares_replicas_alive_together_differing_in_their_cores(cpu, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    plan = rr.plan(cpu, PARAMS)
    assert plan.problems() == []
    assert plan.names == ["replica 0", "replica 1"] and plan.together == (("replica 0", "replica 1"),)
    assert [dict(a.env) for a in plan.arms] == [{"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                               {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    assert plan.arms[1].knob == "env:VLLM_CPU_OMP_THREADS_BIND"
    assert "router-side" in plan.notes[0]
    assert len(plan.notes) == 1


def test_more_replicas_than_cores_share_them_differing_only_in_their_name(cpu, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    plan = rr.plan(cpu, {**PARAMS, "replicas": 3})
    assert plan.problems() == []
    assert [dict(a.env) for a in plan.arms] == [
        {"LAB_REPLICA": str(i), "VLLM_CPU_OMP_THREADS_BIND": "0-1"} for i in range(3)]
    assert plan.arms[2].knob == "env:LAB_REPLICA"
    assert "3 replicas on 2 cores" in plan.notes[1]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})  # one core, e.g. taskset -c 3
    one = rr.plan(cpu, PARAMS)
    assert [dict(a.env) for a in one.arms] == [
        {"LAB_REPLICA": "0", "VLLM_CPU_OMP_THREADS_BIND": "3"},
        {"LAB_REPLICA": "1", "VLLM_CPU_OMP_THREADS_BIND": "3"}]
    assert "2 replicas on 1 core:" in one.notes[1]


def test_plan_refuses_what_cannot_show_anything(cpu, gpu):
    with pytest.raises(ConfigError, match="replicas >= 2"):
        rr.plan(cpu, {**PARAMS, "replicas": 1})
    with pytest.raises(ConfigError, match="holds every one"):
        rr.plan(cpu, {**PARAMS, "kv_prefixes_per_replica": 6})
    plan = rr.plan(gpu, PARAMS)  # one GPU each
    assert [dict(a.env) for a in plan.arms] == [{"CUDA_VISIBLE_DEVICES": "0"},
                                               {"CUDA_VISIBLE_DEVICES": "1"}]


def test_byte_budget_profile_drops_the_cpu_override(cpu, monkeypatch):
    assert cpu.env.get(CPU_KV_ENV) == "1"             # lab_utils/profiles/cpu.toml
    monkeypatch.delenv(CPU_KV_ENV, raising=False)
    kept = byte_budget_profile(cpu)
    assert CPU_KV_ENV not in kept.env
    assert {k: v for k, v in cpu.env.items() if k != CPU_KV_ENV} == dict(kept.env)
    monkeypatch.setenv(CPU_KV_ENV, "4")
    with pytest.raises(ConfigError, match="Unset it"):
        byte_budget_profile(cpu)


def test_tenant_order_is_balanced_and_seeded():
    order = rr.tenant_order(4, 10, seed=3)
    assert Counter(order) == {0: 3, 1: 3, 2: 2, 3: 2}
    assert order == rr.tenant_order(4, 10, seed=3) != rr.tenant_order(4, 10, seed=4)
    with pytest.raises(ValueError):
        rr.tenant_order(4, 3)


def test_each_tenant_has_its_own_prompt_and_key():
    tok = word_tokenizer()
    work = rr.tenant_workload(tok, tenants=3, prefix_tokens=40, requests=9, max_tokens=4)
    systems = {}
    for spec, t in zip(work.specs, work.tenants):
        system = spec.messages[0]["content"]
        assert tok.count(system) == 40
        assert systems.setdefault(t, system) == system          # one prompt per tenant
        assert spec.headers == {"x-tenant-id": f"tenant-{t}"}
        assert spec.ignore_eos and spec.max_tokens == 4
    firsts = {s.split()[0] for s in systems.values()}
    assert len(systems) == 3 and len(set(systems.values())) == 3 and len(firsts) == 3


def counters(requests: float, queries: float, hits: float) -> dict:
    return {"requests_success": requests, "prefix_cache_queries": queries,
            "prefix_cache_hits": hits}


def policy_run(policy: str, ttfts: list[float], replicas: dict) -> rr.PolicyRun:
    recs = [RequestRecord(index=i, tag="", ttft=t, e2e=t + 0.1, output_tokens=4, ok=True)
            for i, t in enumerate(ttfts)]
    return rr.PolicyRun(policy, Run(policy, "c=2", recs, 1.0), replicas,
                        {n: c["requests_success"] for n, c in replicas.items()})


def test_tables_and_findings_from_the_counters():
    runs = {"round_robin": policy_run("round_robin", [0.5, 0.6, 0.4, 0.5],
                                      {"replica 0": counters(2, 1000, 250),
                                       "replica 1": counters(2, 1000, 250)}),
            "cache_aware": policy_run("cache_aware", [0.2, 0.3, 0.2, 0.5],
                                      {"replica 0": counters(3, 1500, 1000),
                                       "replica 1": counters(1, 500, 0)})}
    table = rr.summary(runs)
    assert table.loc["round_robin", "hit rate (%)"] == 25.0            # 500 / 2000
    assert table.loc["cache_aware", "hit rate (%)"] == 50.0            # 1000 / 2000
    assert table.loc["cache_aware", "imbalance (max/mean)"] == 1.5     # 3 / 2
    assert table.loc["cache_aware", "requests per replica"] == "3 / 1"
    assert table.loc["cache_aware", "TTFT p50 (ms)"] == pytest.approx(250.0)
    per = rr.per_replica(runs)
    assert per.loc[("cache_aware", "replica 1"), "hit rate (%)"] == 0.0
    found = {f["metric"]: f for f in rr.findings(runs)}
    hit = found["prefix-cache hit rate (%), round_robin -> cache_aware"]
    assert (hit["baseline"], hit["treated"]) == (25.0, 50.0)
    ttft = found["TTFT median (ms), round_robin -> cache_aware"]
    assert ttft["baseline"] == pytest.approx(500.0) and ttft["treated"] == pytest.approx(250.0)
    assert len(ttft["samples"][0]) == 4


def test_imbalance_and_hit_rate_by_hand():
    assert rr.imbalance([8, 8]) == 1.0 and rr.imbalance([16, 0]) == 2.0
    assert rr.hit_rate(1, 4) == 0.25
    assert rr.hit_rate(0, 0) != rr.hit_rate(0, 0)  # nan without queries
