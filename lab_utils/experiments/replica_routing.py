"""Experiments of `13_replica_routing`: N replicas of the same engine behind
vLLM's own router (`lab_utils.router`), the same multi-tenant requests sent
through it under each routing policy; where the requests went and how often
each replica's prefix cache hit, from the replicas' own counters.

The engines are the plan's N replica arms, alive together: the profile's
model with the same flags, each on its own share of the machine (on the
`cpu` profile its own core through `VLLM_CPU_OMP_THREADS_BIND`, or all of them
shared where there are fewer cores than replicas; on `gpu` its
own GPU through `CUDA_VISIBLE_DEVICES`; on `remote` the replicas are servers
you run, mapped with `LAB_REMOTE_ARMS`). Each replica's KV cache gets the same
byte budget (`--kv-cache-memory-bytes`, with the cpu profile's
`VLLM_CPU_KVCACHE_SPACE` dropped as in 06, which would override it), sized so
that a replica holds `kv_prefixes_per_replica` tenants' prompts at once: its
share of the tenants, not all of them. Every replica also runs with
`--enable-scale-out`: it opens vLLM's render endpoints
(`/v1/chat/completions/render`, 403 without it), from which `cache_aware`
takes each request's token ids; generation is unchanged.

The routing policies are not engine arms: they change nothing in any engine,
only which replica a request reaches, so the plan declares the replicas and
notes the policies; each policy is an arm of the results (same replicas, same
requests, a fresh router). Every policy's requests carry their own
`cache_salt` (a vLLM request field that salts the prefix-cache hashes), so a
policy never hits blocks an earlier policy left in the caches.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from .. import arms
from ..client import Client, Load, RequestSpec, Run
from ..counters import delta, scrape
from ..cpu_tuning import all_cores, core_shares
from ..kv_memory import byte_budget_profile
from ..metrics import percentile_stats, records_frame
from ..profiles import ConfigError, Profile
from ..results import Results
from ..router import RouterServer
from ..server import free_port, start_on_a_free_port
from ..workloads import chat, chat_questions, exact_text, tokenizer_for, warm_up

CLAIM = ("beyond the article (one server): past one engine, the router decides the "
         "prefix-cache hit rate; cache-aware routing keeps a tenant's prompt on one replica")
#: The policies compared by default; the first is the reference.
POLICIES = ("round_robin", "cache_aware", "consistent_hash")
BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: A remote replica arm's key for LAB_REMOTE_ARMS (no effect on a server).
REMOTE_KEY = "LAB_REPLICA"
#: The header consistent_hash keys on (vllm-router reads no chat text for it).
TENANT_HEADER = "x-tenant-id"
#: Room in each request after its system prompt: the question, the chat
#: template's tokens and the answer (max_model_len = prefix + this, in blocks).
REQUEST_ROOM_TOKENS = 128


def replica_names(n: int) -> list[str]:
    return [f"replica {i}" for i in range(n)]


def replica_env(profile: Profile, n: int) -> list[dict[str, str]]:
    """Each replica's own share of the machine: a core list (cpu), a GPU
    (cuda), or only a name for LAB_REMOTE_ARMS (remote)."""
    if profile.is_remote:
        return [{REMOTE_KEY: str(i)} for i in range(n)]
    if profile.device == "cpu":
        cpus = sorted(os.sched_getaffinity(0))
        if n <= len(cpus):
            return [{BIND: cores} for cores in core_shares(n, cpus)]
        # Fewer cores than replicas (a 1-core machine, a stream of `make test`):
        # every replica on all of them, told apart by LAB_REPLICA alone (one knob).
        return [{REMOTE_KEY: str(i), BIND: all_cores()} for i in range(n)]
    return [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(n)]


def request_tokens(prefix_tokens: int, block_size: int) -> int:
    """max_model_len of a replica: a system prompt plus the request's room, in whole blocks."""
    per = int(prefix_tokens) + REQUEST_ROOM_TOKENS
    return -(-per // block_size) * block_size


def kv_budget(profile: Profile, params: Mapping[str, Any]) -> dict[str, Any]:
    """The replicas' shared flags and the arithmetic behind them. A tenant's
    system prompt fills `prefix_tokens // block_size` whole KV blocks (the
    ones the prefix cache can share); each KV cache holds
    `kv_prefixes_per_replica` of them (default: its share of the tenants,
    tenants / replicas rounded up) plus, for each of `concurrency` requests in
    flight, the blocks of its own (question and answer). Bytes per token from
    the model's geometry; no budget where it is unknown (remote)."""
    from ..plan import build_engine
    tenants, n = int(params["tenants"]), int(params["replicas"])
    hold = int(params.get("kv_prefixes_per_replica") or math.ceil(tenants / n))
    if profile.is_remote:  # the servers you run (start them with --enable-scale-out)
        return {"flags": {}, "budget_bytes": None, "bytes_per_token": None, "block_size": None,
                "max_model_len": None, "prefix_blocks": None, "own_blocks": None,
                "kv_blocks": None, "prefixes_held": hold, "tenants": tenants, "replicas": n}
    probe = build_engine(profile, arms.Arm("replica"), None)
    block = probe.block_size
    max_len = request_tokens(int(params["prefix_tokens"]), block)
    prefix_blocks = int(params["prefix_tokens"]) // block
    own_blocks = max_len // block - prefix_blocks
    blocks = hold * prefix_blocks + max(1, int(params.get("concurrency", 1))) * own_blocks
    blocks = max(blocks, max_len // block)  # vLLM refuses a cache shorter than max_model_len
    per_token = probe.kv_bytes_per_token
    # --enable-scale-out opens vLLM's render endpoints (403 without it), which
    # cache_aware asks for a request's token ids; generation is unchanged.
    flags: dict[str, Any] = {"max_model_len": max_len, "enable_scale_out": True}
    budget = None
    if per_token:
        budget = blocks * block * per_token
        flags["kv_cache_memory_bytes"] = int(budget)
    return {"flags": flags, "budget_bytes": budget, "bytes_per_token": per_token,
            "block_size": block, "max_model_len": max_len, "prefix_blocks": prefix_blocks,
            "own_blocks": own_blocks, "kv_blocks": blocks, "prefixes_held": hold,
            "tenants": tenants, "replicas": n}


def plan(profile: Profile, params: Mapping[str, Any]) -> arms.Plan:
    """`replicas` copies of the profile's engine, alive together, each on its
    own share of the machine (the only thing in which they differ, declared
    as each arm's knob against replica 0) and with the same KV budget."""
    n, tenants = int(params.get("replicas", 2)), int(params.get("tenants", 6))
    if n < 2:
        raise ConfigError("13_replica_routing needs replicas >= 2 (a router in front of one "
                          "engine routes nothing)")
    size = kv_budget(profile, {**params, "replicas": n, "tenants": tenants})
    if size["prefixes_held"] >= tenants:
        raise ConfigError(f"kv_prefixes_per_replica={size['prefixes_held']} holds every one of "
                          f"the {tenants} tenants' prompts: nothing for routing to win; set it "
                          "below tenants (or leave it 0 for tenants / replicas + 1)")
    envs = replica_env(profile, n)
    knob = arms.env_knob(next(iter(envs[0])))
    names = replica_names(n)
    replicas = tuple(arms.Arm(name, dict(size["flags"]), env=env, knob=knob if i else None,
                              title=f"replica {i}: {', '.join(f'{k}={v}' for k, v in env.items())}")
                     for i, (name, env) in enumerate(zip(names, envs)))
    policies = list(params.get("policies", POLICIES))
    notes = (f"router policies {policies} are router-side arms: the same replicas serve each "
             "policy, no engine flag changes; each policy's requests carry their own cache_salt",)
    if REMOTE_KEY in envs[0] and BIND in envs[0]:
        cores = len(os.sched_getaffinity(0))
        notes += (f"{n} replicas on {cores} core{'s' if cores > 1 else ''}: the replicas share "
                  "them, so one replica's work slows another's requests; where requests go "
                  "and what each cache hits do not depend on it",)
    return arms.Plan("13_replica_routing", replicas, together=(tuple(names),), notes=notes)


def replica_engines(ctx) -> list[Any]:
    """Every replica of the plan, running side by side; KV budgets obeyed
    (the profile without VLLM_CPU_KVCACHE_SPACE, as 06 does)."""
    if any("kv_cache_memory_bytes" in a.flags for a in ctx.plan.arms):
        ctx.serve_with(byte_budget_profile(ctx.profile))
    return list(ctx.arms_together(ctx.plan.names, "replica routing needs every replica")
                .values())


# --------------------------------------------------------------------------
# Workload: T tenants, each with its own long system prompt
# --------------------------------------------------------------------------

@dataclass
class Workload:
    specs: list[RequestSpec]
    tenants: list[int]            # the tenant of each request, in sending order
    prefix_tokens: int

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({"tenant": self.tenants})


def tenant_order(tenants: int, requests: int, seed: int = 0) -> list[int]:
    """Each tenant about equally often (requests // tenants, the first
    `requests % tenants` tenants once more), in a seeded random order."""
    if tenants < 1 or requests < tenants:
        raise ValueError(f"need tenants >= 1 and requests >= tenants, got {tenants}, {requests}")
    order = [i % tenants for i in range(requests)]
    random.Random(seed).shuffle(order)
    return order


def tenant_workload(tok, *, tenants: int, prefix_tokens: int, requests: int, max_tokens: int,
                    seed: int = 0) -> Workload:
    """`requests` chat requests: tenant t's system prompt is `prefix_tokens`
    tokens of its own text (different text from its first token, so tenants
    share nothing but the chat template's first tokens), then a question;
    the tenant's id also rides in the `x-tenant-id` header (consistent_hash's key)."""
    systems = [exact_text(tok, prefix_tokens, offset=(t + 1) * 9973) for t in range(tenants)]
    qs = [q["question"] for q in chat_questions()]
    random.Random(seed).shuffle(qs)
    order = tenant_order(tenants, requests, seed)
    specs = [RequestSpec(messages=chat(qs[i % len(qs)], system=systems[t]), max_tokens=max_tokens,
                         tag=f"tenant {t}", ignore_eos=True,
                         headers={TENANT_HEADER: f"tenant-{t}"})
             for i, t in enumerate(order)]
    return Workload(specs, order, prefix_tokens)


# --------------------------------------------------------------------------
# One policy: a fresh router in front of the replicas
# --------------------------------------------------------------------------

@dataclass
class PolicyRun:
    policy: str
    run: Run
    replicas: dict[str, dict[str, float | None]]   # replica -> its counter deltas
    routed: dict[str, float]                        # replica -> router's decisions
    router: dict[str, Any] = field(default_factory=dict)


def run_policy(engines: Sequence[Any], names: Sequence[str], work: Workload, policy: str, *,
               load: Load, log_dir, results: Results | None = None, progress: bool = True,
               label: str | None = None, router_options: Mapping[str, Any] | None = None
               ) -> PolicyRun:
    """The workload through a fresh `policy` router; each replica's vLLM
    counters (prefix-cache queries and hits, requests) over the run."""
    label = label or policy
    specs = [dataclasses.replace(s, extra={**s.extra, "cache_salt": label}) for s in work.specs]
    before = [scrape(e.base_url, e.api_key) for e in engines]
    def router_on(port: int) -> RouterServer:
        return RouterServer([e.base_url for e in engines], policy, port=port,
                            log_path=log_dir / f"router-{label.replace(' ', '_')}.log",
                            options=router_options)
    with start_on_a_free_port(router_on, free_port()) as router:
        jsonl = results.records_path(label) if results else None
        if jsonl is not None and jsonl.exists():
            jsonl.unlink()
        run = Client(router.base_url, engines[0].model, api_key=engines[0].api_key).run(
            specs, load, label=label, jsonl=jsonl, progress=progress)
        by_url = router.counts()
    per = {n: delta(b, scrape(e.base_url, e.api_key)) for n, e, b in zip(names, engines, before)}
    routed = {n: by_url.get(e.base_url.rstrip("/"), 0.0) for n, e in zip(names, engines)}
    run.counters = {"replicas": per, "router": routed}
    out = PolicyRun(policy, run, per, routed, router.describe())
    if results is not None:
        results.data.setdefault("routers", {})[label] = out.router
        results.add_arm(label, run, policy=policy, replicas=list(names))
    return out


def run_policies(engines: Sequence[Any], names: Sequence[str], work: Workload,
                 policies: Sequence[str], *, concurrency: int, log_dir,
                 results: Results | None = None, progress: bool = True,
                 router_options: Mapping[str, Any] | None = None) -> dict[str, PolicyRun]:
    """Each policy in turn on the same replicas and requests (`concurrency`
    in flight: cache_aware sends a new prefix to the least loaded replica, so
    with one request at a time every replica is idle and it picks the same one)."""
    warm_up(engines)
    load = Load.concurrent(concurrency) if concurrency > 1 else Load.sequential()
    return {p: run_policy(engines, names, work, p, load=load, log_dir=log_dir, results=results,
                          progress=progress, router_options=router_options) for p in policies}


# --------------------------------------------------------------------------
# What happened: per replica, per policy
# --------------------------------------------------------------------------

def hit_rate(hits: float, queries: float) -> float:
    """Share of prompt tokens served from the prefix cache (nan without queries)."""
    return hits / queries if queries else math.nan


def imbalance(counts: Sequence[float]) -> float:
    """Busiest replica's requests over the mean (1 = even; N = one replica took all)."""
    counts = [float(c) for c in counts]
    mean = sum(counts) / len(counts) if counts else 0.0
    return max(counts) / mean if mean else math.nan


def per_replica(runs: Mapping[str, PolicyRun]) -> pd.DataFrame:
    """One row per (policy, replica): requests the engine served (vLLM's
    request_success), requests the router sent there, prefix-cache queries,
    hits and hit rate (vLLM's prefix_cache_* counters)."""
    rows = []
    for label, pr in runs.items():
        for name, d in pr.replicas.items():
            rows.append({"policy": label, "replica": name,
                         "requests served": d["requests_success"],
                         "router sent": pr.routed.get(name, math.nan),
                         "prefix-cache queries": d["prefix_cache_queries"],
                         "prefix-cache hits": d["prefix_cache_hits"],
                         "hit rate (%)": 100 * hit_rate(d["prefix_cache_hits"],
                                                        d["prefix_cache_queries"])})
    return pd.DataFrame(rows).set_index(["policy", "replica"])


def summary(runs: Mapping[str, PolicyRun]) -> pd.DataFrame:
    """One row per policy: TTFT p50/p99 (ms), the hit rate over all replicas,
    requests per replica and the load imbalance (busiest / mean)."""
    rows = {}
    for label, pr in runs.items():
        f = records_frame(pr.run.records)
        f = f[f.ok]
        ttft = percentile_stats(f.ttft_ms, scale=1.0)
        q = sum(d["prefix_cache_queries"] for d in pr.replicas.values())
        h = sum(d["prefix_cache_hits"] for d in pr.replicas.values())
        served = [d["requests_success"] for d in pr.replicas.values()]
        rows[label] = {"requests": len(f), "TTFT p50 (ms)": ttft["median"],
                       "TTFT p99 (ms)": ttft["p99"], "hit rate (%)": 100 * hit_rate(h, q),
                       "requests per replica": " / ".join(f"{s:.0f}" for s in served),
                       "imbalance (max/mean)": imbalance(served)}
    return pd.DataFrame(rows).T


def ttft_frame(runs: Mapping[str, PolicyRun], work: Workload) -> pd.DataFrame:
    """Every request's TTFT with its policy and tenant."""
    frames = []
    for label, pr in runs.items():
        f = records_frame(pr.run.records)
        f["policy"] = label
        f["tenant"] = [work.tenants[i] for i in f["index"]]
        frames.append(f[f.ok])
    return pd.concat(frames, ignore_index=True)


def budget_table(size: Mapping[str, Any]) -> pd.DataFrame:
    """The KV arithmetic of `kv_budget`, with the replicas' reported capacity."""
    rows = {"tenants": size["tenants"], "replicas": size["replicas"],
            "max_model_len (tokens, whole blocks)": size["max_model_len"],
            "KV block size (tokens)": size["block_size"],
            "KV bytes per token": size["bytes_per_token"],
            "whole blocks of one system prompt": size["prefix_blocks"],
            "tenants' prompts a replica holds": size["prefixes_held"],
            "own blocks of a request in flight": size["own_blocks"],
            "KV blocks per replica": size["kv_blocks"],
            "--kv-cache-memory-bytes": size["budget_bytes"]}
    return pd.DataFrame({"value": rows})


def capacity_check(engines: Sequence[Any], names: Sequence[str]) -> pd.DataFrame:
    """Each replica's KV capacity as vLLM reports it (cache_config_info)."""
    rows = []
    for name, e in zip(names, engines):
        cc = e.info.get("cache_config", {}) or {}
        blocks, block = cc.get("num_gpu_blocks"), cc.get("block_size")
        rows.append({"replica": name, "KV blocks": blocks, "block size": block,
                     "KV tokens": int(blocks) * int(block) if blocks and block else None,
                     "command": e.command})
    return pd.DataFrame(rows).set_index("replica")


def findings(runs: Mapping[str, PolicyRun], reference: str = "round_robin") -> list[dict]:
    """Against `reference` (round-robin): TTFT median and p99 per policy with
    bootstrap intervals, the prefix-cache hit rate and the load imbalance."""
    if reference not in runs:
        return []
    base = runs[reference]
    table = summary(runs)
    base_ttft = [r.ttft * 1e3 for r in base.run.records if r.ok and r.ttft is not None]
    out = []
    for label, pr in runs.items():
        if label == reference:
            continue
        ttft = [r.ttft * 1e3 for r in pr.run.records if r.ok and r.ttft is not None]
        mech = (f"prefix-cache hit rate {table.loc[reference, 'hit rate (%)']:.0f}% -> "
                f"{table.loc[label, 'hit rate (%)']:.0f}% over the replicas "
                f"(vllm:prefix_cache_hits / queries); requests per replica "
                f"{table.loc[reference, 'requests per replica']} -> "
                f"{table.loc[label, 'requests per replica']} (vllm:request_success)")
        for stat, key in (("median", "TTFT p50 (ms)"), ("p99", "TTFT p99 (ms)")):
            out.append({"technique": f"replica routing ({label})",
                        "metric": f"TTFT {stat} (ms), {reference} -> {label}",
                        "baseline": float(table.loc[reference, key]),
                        "treated": float(table.loc[label, key]), "article_claim": CLAIM,
                        "mechanism": mech, "samples": (base_ttft, ttft), "stat": stat})
        out.append({"technique": f"replica routing ({label})",
                    "metric": f"prefix-cache hit rate (%), {reference} -> {label}",
                    "baseline": float(table.loc[reference, "hit rate (%)"]),
                    "treated": float(table.loc[label, "hit rate (%)"]),
                    "article_claim": CLAIM, "mechanism": mech})
        out.append({"technique": f"replica routing ({label})",
                    "metric": f"load imbalance (busiest / mean requests), {reference} -> {label}",
                    "baseline": float(table.loc[reference, "imbalance (max/mean)"]),
                    "treated": float(table.loc[label, "imbalance (max/mean)"]),
                    "article_claim": "the cost of affinity: uneven load",
                    "mechanism": mech})
    return out


def plot_ttft(runs: Mapping[str, PolicyRun], work: Workload,
              title: str = "TTFT per routing policy (same requests, same replicas)"):
    from .. import plots
    f = ttft_frame(runs, work).assign(label=lambda d: d.policy)
    return plots.latency_distributions(f, metrics=("ttft_ms",), title=title)


def tenant_sweep(engines: Sequence[Any], names: Sequence[str], tok, tenants: Sequence[int], *,
                 prefix_tokens: int, requests: int, max_tokens: int, concurrency: int, log_dir,
                 policies: Sequence[str] = ("round_robin", "cache_aware"), seed: int = 0,
                 results: Results | None = None, progress: bool = True) -> pd.DataFrame:
    """The same replicas (their KV sized for the notebook's `tenants`) under
    more or fewer tenants: for each count, `requests` requests under each
    policy. One row per (tenants, policy): hit rate, TTFT p50, imbalance."""
    load = Load.concurrent(concurrency) if concurrency > 1 else Load.sequential()
    rows = []
    for t in tenants:
        work = tenant_workload(tok, tenants=t, prefix_tokens=prefix_tokens,
                               requests=max(requests, t), max_tokens=max_tokens, seed=seed)
        runs = {p: run_policy(engines, names, work, p, load=load, log_dir=log_dir,
                              results=results, progress=progress, label=f"{p} tenants={t}")
                for p in policies}
        for label, row in summary(runs).iterrows():
            rows.append({"tenants": t, "policy": label.split(" ", 1)[0],
                         **{k: row[k] for k in ("hit rate (%)", "TTFT p50 (ms)",
                                                "imbalance (max/mean)")}})
    return pd.DataFrame(rows).astype({"hit rate (%)": float, "TTFT p50 (ms)": float,
                                      "imbalance (max/mean)": float})


def plot_sweep(sweep: pd.DataFrame, prefixes_held: int,
               title: str = "Prefix-cache hit rate as tenants outgrow a replica's KV cache"):
    from .. import plots
    fig = plots.xy(sweep, "tenants", "hit rate (%)", hue="policy", xlabel="tenants",
                   ylabel="prefix-cache hit rate over the replicas (%)", title=title)
    ax = fig.axes[0]
    ax.axvline(prefixes_held, color="grey", ls="--", lw=1,
               label=f"one replica's KV: {prefixes_held} prompts")
    ax.legend(fontsize=8)
    return fig


def explore(engines: Sequence[Any], names: Sequence[str], work: Workload, *, policy: str,
            concurrency: int, log_dir) -> pd.DataFrame:
    """One more policy (or the same at another concurrency) on the same
    replicas and requests, with its per-replica counters."""
    label = f"explore {policy} c={concurrency}"
    load = Load.concurrent(concurrency) if concurrency > 1 else Load.sequential()
    pr = run_policy(engines, names, work, policy, load=load, log_dir=log_dir, progress=False,
                    label=label)
    print(summary({label: pr}).to_string())
    return per_replica({label: pr}).round(1)


__all__ = [
    "CLAIM", "POLICIES", "PolicyRun", "Workload", "budget_table", "capacity_check", "explore",
    "findings", "hit_rate", "imbalance", "kv_budget", "per_replica", "plan", "plot_ttft",
    "plot_sweep", "replica_engines", "replica_env", "replica_names", "request_tokens",
    "run_policies", "run_policy", "summary", "tenant_order", "tenant_sweep", "tenant_workload",
    "ttft_frame",
]
