"""What the notebooks found in this session's run (`make test`: every notebook
under nbval with its smoke parameters, results in LAB_SMOKE_RESULTS), read back
from `results/<notebook>.json` and asserted. Only mechanisms, from vLLM's own
counters and logs, never latencies: a slow or busy machine changes the times,
not whether the prefix cache hit or the chunk budget held.

These run after the notebooks (tests/conftest.py orders them) and skip only
when no notebook ran in the session (e.g. `pytest tests` alone).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from lab_utils import cpu_kernels
from lab_utils.article_table import ARTICLE_TABLE
from lab_utils.smoke import smoke_parameters

pytestmark = pytest.mark.findings


def results_of(smoke_results, notebook: str) -> dict:
    folder, ran = smoke_results
    if notebook not in ran:
        pytest.skip(f"{notebook} was not run in this session")
    path = Path(folder) / f"{notebook}.json"
    assert path.is_file(), f"{notebook} ran but wrote no results to {path}"
    data = json.loads(path.read_text())
    smoke_set = smoke_parameters(notebook)
    ran_with = {k: data["parameters"].get(k) for k in smoke_set}
    assert ran_with == smoke_set, f"{path} is not from a smoke run: {ran_with}"
    return data


def records(smoke_results, data: dict, arm: str) -> list[dict]:
    path = Path(smoke_results[0]) / data["arms"][arm]["records"]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def engine_flags(data: dict, label: str) -> dict:
    return next(e["flags"] for e in data["engines"] if e["label"] == label)


def block_size(data: dict, label: str) -> int:
    engine = next(e for e in data["engines"] if e["label"] == label)
    return int(engine["cache_config"]["block_size"])


def test_every_result_names_its_machine(smoke_results):
    folder, ran = smoke_results
    for notebook in ran:
        data = results_of(smoke_results, notebook)
        machine = data["environment"].get("machine", {})
        assert machine.get("cpu_model") and machine.get("isa_summary"), notebook
        assert machine.get("vllm_version"), notebook


#: Where a notebook starts other engines than its plan's command lines say,
#: today: what differs, and why. 06 and 13 drop VLLM_CPU_KVCACHE_SPACE from
#: the profile's env when they start their engines (kv_memory.byte_budget_profile:
#: vLLM's CPU build would take it over --kv-cache-memory-bytes), which a plan
#: cannot declare (an arm's env only adds variables), so the plan checker
#: prints and sizes a command with the variable set. The fix: a plan that
#: says so (an env entry that removes a variable), then drop the entries here.
KNOWN_UNPLANNED = {notebook: {"env only in the plan": ["VLLM_CPU_KVCACHE_SPACE"]}
                   for notebook in ("06_fp8_kv_cache", "13_replica_routing")}


def split_command(command: str) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of a `K=V ... vllm serve ...` line, the port set to
    8000 (the plan checker's; a real start takes a free one)."""
    import re
    import shlex
    words = shlex.split(re.sub(r"--port \d+", "--port 8000", command))
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def unplanned(folder: Path, data: dict) -> dict:
    """How the engines a notebook recorded (each with its arm and exact
    command) differ from the plan the plan checker derives now from the
    recorded profile and parameters, findings read from `folder`: arms it
    does not declare, and per arm the environment and argv that differ."""
    from lab_utils import plan as checker
    from lab_utils.paths import NOTEBOOKS_DIR
    from lab_utils.profiles import load_profile
    params = {**data["parameters"], "results_dir": str(folder)}
    check = checker.check_notebook(NOTEBOOKS_DIR / f"{data['notebook']}.ipynb",
                                   load_profile(data["profile"]), None, params)
    planned = {e.name: split_command(e.command) for e in check.engines}
    out: dict = {}
    for engine in data["engines"]:
        arm = engine.get("arm")
        if arm == "explore":
            continue
        if arm not in planned:
            out.setdefault("arms not in the plan", []).append(str(arm))
            continue
        (env_p, argv_p), (env_r, argv_r) = planned[arm], split_command(engine["command"])
        if argv_p != argv_r:
            out.setdefault("argv", {})[arm] = {"plan": argv_p, "run": argv_r}
        only_plan = sorted(set(env_p) - set(env_r))
        if only_plan:
            out["env only in the plan"] = only_plan
        if sorted(set(env_r) - set(env_p)):
            out["env only in the run"] = sorted(set(env_r) - set(env_p))
        if {k: env_p[k] for k in env_p if k in env_r} != {k: env_r[k] for k in env_r
                                                          if k in env_p}:
            out.setdefault("env values", []).append(arm)
    return out


def test_each_notebook_started_exactly_its_declared_plan(smoke_results):
    # The plan is written before anything starts (lab.setup), each engine is
    # recorded with the arm it served: every engine belongs to the plan, and
    # every arm of the plan either ran or was skipped with a reason. Then the
    # plan checker derives the plan again from the profile and the recorded
    # parameters, and each recorded command line (the one the server really
    # started with) must be the checker's for that arm, port aside. Works on
    # any run's results: LAB_FINDINGS_RESULTS=runs/latest/results for `make run`.
    folder, ran = smoke_results
    found = {}
    for notebook in ran:
        data = json.loads((Path(folder) / f"{notebook}.json").read_text())
        assert "plan" in data, f"{notebook} declared no plan"
        declared = {a["arm"]: a for a in data["plan"]["arms"]}
        started = {e.get("arm") for e in data["engines"]}
        assert started <= set(declared), f"{notebook} started engines outside its plan: " \
                                         f"{sorted(map(str, started - set(declared)))}"
        for e in data["engines"]:
            a = declared[e["arm"]]
            assert json.loads(a["flags"]) == e["flags"], e["arm"]
        skipped = set(data.get("skipped_arms", {}))
        missing = set(declared) - started - skipped
        assert not missing, f"{notebook}: declared arms neither started nor skipped: {missing}"
        if data["profile"] != "remote":
            differs = unplanned(Path(folder), data)
            if differs:
                found[notebook] = differs
    assert found == {k: v for k, v in KNOWN_UNPLANNED.items() if k in ran}


def test_00_baseline_runs_without_cache_hits_and_with_the_profiles_binding(smoke_results):
    data = results_of(smoke_results, "00_baseline")
    for label, arm in data["arms"].items():
        assert arm["counters"]["prefix_cache_hits"] == 0, f"{label}: fresh prompts must miss"
    binding = data["engines"][0]["binding"]
    asked = data["environment"]["machine"]["thread_binding"]["VLLM_CPU_OMP_THREADS_BIND"]
    from vllm.utils.cpu_resource_utils import parse_id_list
    if asked == "auto":
        return
    if binding.get("executor") == "uni":
        # the worker inside the engine core (cpu_tuning.in_process_env): only where
        # the binding gives it every core, and its threads are that many
        assert parse_id_list(asked) == sorted(os.sched_getaffinity(0))
        # vLLM's torch threads follow an OMP_NUM_THREADS set outside it, and it logs
        # nothing when that is 1 (`set_torch_threads_for_runtime`)
        threads = binding.get("torch_threads") or int(
            re.search(r"\bOMP_NUM_THREADS=(\d+)", data["engines"][0]["command"]).group(1))
        assert threads == len(parse_id_list(asked))
    else:  # vLLM applied what the profile asked for, by its own parser
        applied = sorted(c for rank in binding["core_ids"] for c in rank)
        assert applied == parse_id_list(asked)


def test_00_single_stream_tpot_is_not_below_the_decode_floor(smoke_results):
    # A step reads every weight once: TPOT below weights / bandwidth would mean the
    # floor counts bytes the engine does not read or overstates the bandwidth; the
    # step's matrix products are part of every step, so alone they take less than it.
    data = results_of(smoke_results, "00_baseline")
    found = [f for f in data["findings"] if f["technique"] == "baseline: decode floor"]
    assert len(found) == 1, "00 records single-stream TPOT against the decode floor"
    floor, tpot = found[0]["decode_floor"], found[0]["treated"]
    if floor["dtype"] == "float32":  # as the checkpoint stores them: its files' bytes
        from lab_utils.cpu_tuning import weight_bytes
        on_disk = weight_bytes(data["environment"]["model"])
        assert abs(floor["weight_bytes"] - on_disk) < 0.001 * on_disk, (floor, on_disk)
    assert tpot >= 0.7 * floor["floor_ms"], (tpot, floor)
    assert floor["linears_ms"] <= 1.2 * tpot, (floor["linears_ms"], tpot)
    # ATen's linear reads the same weights: no GEMM beats the floor either
    assert floor["aten_linears_ms"] >= 0.7 * floor["floor_ms"], floor
    # measured with the threads the worker computes with: the CPUs the binding gave it
    asked = data["environment"]["machine"]["thread_binding"]["VLLM_CPU_OMP_THREADS_BIND"]
    if asked != "auto":
        from vllm.utils.cpu_resource_utils import parse_id_list
        assert floor["threads"] == len(parse_id_list(asked))


def test_00_weights_and_the_floors_sum_are_on_huge_pages_where_asked(smoke_results):
    # glibc's malloc advises huge pages under GLIBC_TUNABLES=glibc.malloc.hugetlb=1
    # (lab_utils.huge_pages): the engine's processes then hold at least its weights
    # on them, as the kernel counts them (AnonHugePages); so does the floor's sum.
    from lab_utils import huge_pages
    if huge_pages.status() is not None:
        pytest.skip(f"no huge pages here: {huge_pages.status()}")
    data = results_of(smoke_results, "00_baseline")
    [found] = [f for f in data["findings"] if f["technique"] == "baseline: decode floor"]
    floor = found["decode_floor"]
    assert floor["bandwidth_source"].endswith("huge pages"), floor
    if huge_pages.HUGETLB in data["engines"][0]["command"]:
        assert floor["engine_huge_page_bytes"] >= floor["weight_bytes"], floor


def test_00_the_profiler_counts_every_step_and_each_weight_matrix_once_a_step(smoke_results):
    # vLLM's torch profiler on the profiled arm: each request of `tokens` answer
    # tokens takes one prefill step and tokens - 1 single-request decode steps, and
    # every step multiplies by each weight matrix once: q/k/v, o, gate/up and down
    # per layer and the LM head, 4 x num_hidden_layers + 1 (the model's config).
    data = results_of(smoke_results, "00_baseline")
    found = [f for f in data["findings"] if f["technique"] == "baseline: decode floor"][0]
    split = found.get("step_split") or {}
    if data["profile"] != "cpu" or "profiled" in data.get("skipped_arms", {}):
        assert "why" in split or "profiled" in data.get("skipped_arms", {}), split
        pytest.skip(f"no profiled arm here: {split.get('why') or data['skipped_arms']['profiled']}")
    requests, tokens = split["requests"], split["tokens"]
    assert tokens == smoke_parameters("00_baseline")["profile_tokens"]
    assert split["steps"] == requests * (tokens - 1)
    config = json.loads((Path(data["environment"]["model"]) / "config.json").read_text())
    assert split["gemm_calls"] == (4 * config["num_hidden_layers"] + 1) * requests * tokens
    # an eager engine with vLLM's C kernels (`[cpu_binding] c_kernels`,
    # lab_utils.cpu_kernels): two norms a layer and the final one, one activation a
    # layer, each a single C call; without them, none
    profiled = [e for e in data["engines"] if "--profiler-config" in e["command"]]
    assert len(profiled) == 1, [e["command"] for e in data["engines"]]
    c_kernels = (f"{cpu_kernels.C_KERNELS_ENV}=1" in profiled[0]["command"]
                 and "--enforce-eager" in profiled[0]["command"])
    layers = config["num_hidden_layers"]
    assert split["norm_calls"] == ((2 * layers + 1) * requests * tokens if c_kernels else 0)
    assert split["activation_calls"] == (layers * requests * tokens if c_kernels else 0)
    parts = ("matrix products", "attention", "compiled kernels", "other ops", "python in the step")
    assert sum(split[p] for p in parts) == pytest.approx(split["step_ms"])
    assert split["matrix products"] > 0 and split["python in the step"] > 0


def test_01_chunking_keeps_every_prefill_step_within_the_budget(smoke_results):
    data = results_of(smoke_results, "01_chunked_prefill")
    chunked = off = 0
    for label, arm in data["arms"].items():
        flags = engine_flags(data, arm["engine"])
        steps = arm["engine_steps"]
        if flags.get("enable_chunked_prefill"):
            chunked += 1
            assert steps["max_prefill_tokens_per_step"] <= flags["max_num_batched_tokens"], label
        else:
            off += 1  # unchunked, a long prompt is prefilled in one step
            long_tokens = data["parameters"]["long_prompt_tokens"]
            assert steps["max_prefill_tokens_per_step"] >= long_tokens, label
    assert chunked and off


def test_02_prefix_cache_hits_whole_blocks_only_when_on(smoke_results):
    data = results_of(smoke_results, "02_prefix_caching")
    system_on = [a for k, a in data["arms"].items()
                 if k.startswith("on/system_prompt") and k.endswith("/measured")]
    assert system_on and all(a["counters"]["prefix_cache_hit_rate"] >= 0.9 for a in system_on)
    for label, arm in data["arms"].items():
        block = block_size(data, arm["engine"])
        for r in records(smoke_results, data, label):
            if label.startswith("off/"):
                assert not r["cached_tokens"], f"{label}: cache off, yet cached tokens"
            else:
                assert r["cached_tokens"] % block == 0, f"{label}: {r['cached_tokens']} tokens"
        if label.startswith("off/"):
            assert arm["counters"]["prefix_cache_hits"] == 0, label
        if label.startswith("on/block_boundary") and label.endswith("/measured"):
            prefix = int(label.split("prefix=")[1].split("/")[0])
            for r in records(smoke_results, data, label):  # whole blocks of the shared prefix
                assert r["cached_tokens"] == prefix // block * block, (label, r["cached_tokens"])


def test_04_ngram_drafts_are_accepted_on_code_edits_and_outputs_stay_identical(smoke_results):
    data = results_of(smoke_results, "04_speculative_decoding")
    ngram = [a for a in data["arms"].values()
             if a.get("method") == "ngram" and a.get("workload") == "code_edit"]
    assert ngram, "no n-gram arm on code edits"
    for arm in ngram:
        c = arm["counters"]
        assert c["spec_decode_draft_tokens"] > 0 and c["spec_decode_accepted_tokens"] > 0, c
        assert c["spec_decode_accepted_tokens"] <= c["spec_decode_draft_tokens"]
    for label, arm in data["arms"].items():
        if arm.get("method") == "none":
            assert arm["counters"]["spec_decode_draft_tokens"] == 0, label
    identity = [f for f in data["findings"] if f["technique"].endswith("output identity")]
    assert identity and identity[0]["baseline"] > 0
    assert identity[0]["treated"] == identity[0]["baseline"], identity[0]["mechanism"]


def test_05_every_arm_is_measured_or_skipped_with_the_probes_reason(smoke_results):
    from lab_utils.experiments import quantization as q
    data = results_of(smoke_results, "05_quantization")
    plan, skipped = data["plan"], data.get("skipped_arms", {})
    measured = {a["arm"] for label, a in data["arms"].items() if label.endswith("/latency")}
    for name in [a["arm"] for a in plan["arms"]]:
        if name in skipped:
            assert name not in measured
        else:
            assert name in measured, f"{name} was runnable here but not measured: {data['notes']}"
    for note in plan["notes"]:  # left out of the plan: by this machine's probe, or no model
        assert "on this machine" in note or "names no model" in note, note
    assert not [n for n in data["notes"] if " failed: " in n], data["notes"]
    # An INT8 checkpoint stores a byte per linear weight instead of 2 (bf16) or
    # 4 (float32): under half the full checkpoint (embedding and norms stay full).
    mib = {a["arm"]: a["weight_memory"]["checkpoint_mib"]
           for label, a in data["arms"].items() if label.endswith("/latency")}
    int8 = [n for n in mib if q.arm(n).weights == "int8"]
    assert int8, "no INT8 arm measured"
    for n in int8:
        assert mib[n] < 0.5 * mib[q.arm(n).reference], (n, mib)
    # What a decode step reads: a full-precision arm, the embedded model's float32
    # files in the dtype it computes in (bfloat16: half their bytes); an INT8 arm
    # fewer bytes than its reference, the mechanism of the article's claim.
    read = {a["arm"]: a["weight_memory"]["step_read_mib"]
            for label, a in data["arms"].items() if label.endswith("/latency")}
    element = {"float32": 4, "bfloat16": 2, "float16": 2}
    for n in read:
        if q.arm(n).weights == "full" and data["profile"] == "cpu":
            expected = mib[n] * element[q.arm(n).flags.get("dtype", "float32")] / 4
            assert abs(read[n] - expected) < 0.01 * expected, (n, read[n], mib[n])
    for n in int8:
        assert read[n] < read[q.arm(n).reference], (n, read)


#: Bytes of one K or V element per --kv-cache-dtype, for a float32 model.
KV_ELEMENT_BYTES = {"auto": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def test_06_kv_capacity_is_what_the_dtypes_bytes_predict(smoke_results):
    data = results_of(smoke_results, "06_fp8_kv_cache")
    model = Path(data["environment"]["model"])
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elements = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim
    budget = int(data["parameters"]["kv_cache_gib"] * 2**30)
    seen = {}
    for e in data["engines"]:
        dtype = e["flags"]["kv_cache_dtype"]
        cc = e["cache_config"]
        block = int(cc["block_size"])
        blocks = budget // (elements * KV_ELEMENT_BYTES[dtype] * block)
        assert int(cc["num_gpu_blocks"]) == blocks, (dtype, cc["num_gpu_blocks"], blocks)
        assert int(cc["kv_cache_size_tokens"]) == blocks * block
        seen[dtype] = blocks * block
    isa = data["environment"]["machine"]["isa"]
    if isa["avx512f"] or isa["amx_tile"]:
        assert {"auto", "fp8"} <= set(seen)
        assert seen["fp8"] >= 4 * seen["auto"]  # floor(4y) >= 4 floor(y): 4x the tokens
    else:  # vLLM's CPU backend has no fp8 KV cache without AVX-512 or AMX
        assert "fp8" not in seen
        notes = data["plan"]["notes"]  # the plan leaves out what this machine's probe refuses
        assert any("arm 'fp8' skipped" in n and "AVX-512" in n for n in notes), notes


def served_ahead(recs: list[dict], margin_s: float = 0.02) -> int:
    """(batch request, interactive request) pairs where the batch one was sent
    first and the interactive one still got its first token at least
    `margin_s` sooner (a whole decode step, not two streams of one step)."""
    first = {id(r): r["start"] + r["ttft"] for r in recs if r["ok"]}
    batch = [r for r in recs if r["ok"] and r["tag"] == "batch"]
    inter = [r for r in recs if r["ok"] and r["tag"] != "batch"]
    return sum(1 for b in batch for i in inter
               if b["start"] < i["start"] and first[id(i)] + margin_s < first[id(b)])


def test_01_the_load_is_placed_from_the_capacity_of_the_first_arm(smoke_results):
    """The short stream runs at `short_load` of the short requests' measured
    saturated rate, the long prompts `long_spacing` solo latencies apart, and
    vLLM's queue was sampled in every arm."""
    data = results_of(smoke_results, "01_chunked_prefill")
    params, load = data["parameters"], data["load"]
    first = data["engines"][0]["label"]
    caps = {key.split(" | ", 1)[1]: cap for key, cap in data["capacity"].items()
            if key.startswith(first + " | ")}
    short = next(c for w, c in caps.items() if w.startswith("01 short"))
    long = next(c for w, c in caps.items() if w.startswith("01 long"))
    assert load["short_rate"] == pytest.approx(params["short_load"] * short["max_rate"], rel=0.01)
    gaps = [b - a for a, b in zip(load["long_at"], load["long_at"][1:])]
    assert gaps and all(g == pytest.approx(params["long_spacing"] * long["sync_e2e_s"], abs=0.02)
                        for g in gaps)
    for label, arm in data["arms"].items():
        assert arm["queue"]["samples"] > 0, label


def test_09_priority_serves_interactive_requests_ahead_of_queued_batch_ones(smoke_results):
    data = results_of(smoke_results, "09_priority_scheduling")
    flags = {label: engine_flags(data, arm["engine"]) for label, arm in data["arms"].items()}
    assert flags["priority"].get("scheduling_policy") == "priority"
    assert "scheduling_policy" not in flags["fcfs"]
    ahead = {label: served_ahead(records(smoke_results, data, label))
             for label in ("fcfs", "priority")}
    assert ahead["priority"] > 0, "no interactive request overtook a queued batch request"
    assert ahead["priority"] > ahead["fcfs"], ahead


def test_09_the_peak_is_placed_from_capacity_and_fcfs_builds_a_queue(smoke_results):
    """The interactive rate is `interactive_load` of what the FCFS engine
    served with its slots full; under FCFS vLLM's own gauge shows requests
    waiting for a slot (the contention the policies act on)."""
    data = results_of(smoke_results, "09_priority_scheduling")
    params, load = data["parameters"], data["load"]
    cap = next(c for key, c in data["capacity"].items() if "09 interactive" in key)
    assert cap["concurrency"] == params["max_num_seqs"]
    assert load["interactive_rate"] == pytest.approx(params["interactive_load"] * cap["max_rate"],
                                                     rel=0.01)
    assert data["arms"]["fcfs"]["queue"]["waiting_max"] >= 1
    assert data["arms"]["fcfs"]["queue"]["running_max"] == params["max_num_seqs"]


def test_11_each_engines_own_count_equals_the_routers_decisions(smoke_results):
    data = results_of(smoke_results, "11_model_tiering")
    assert data["parameters"]["probe_tokens"] == 0, "with a probe, escalations also count"
    routed = data["arms"]["routed"]
    decisions = {"large": 0, "small": 0}
    for r in records(smoke_results, data, "routed"):
        assert r["ok"], r["error"]
        decisions[r["route"].split(" ", 1)[0]] += 1
    served = {tier: routed["counters"][tier]["requests_success"] for tier in ("large", "small")}
    assert served == decisions, (served, decisions)   # vllm:request_success_total per engine
    assert decisions["large"] and decisions["small"], "the mix must reach both tiers"


def test_13_replicas_count_what_the_router_sent_and_cache_aware_hits_at_least_as_often(
        smoke_results):
    data = results_of(smoke_results, "13_replica_routing")
    params = data["parameters"]
    rates = {}
    for policy in params["policies"]:
        arm = data["arms"][policy]
        replicas, routed = arm["counters"]["replicas"], arm["counters"]["router"]
        assert all(r["ok"] for r in records(smoke_results, data, policy)), policy
        served = {name: c["requests_success"] for name, c in replicas.items()}
        # each engine's vllm:request_success equals the router's decisions for it
        assert served == routed, (policy, served, routed)
        assert sum(served.values()) == params["requests"], policy
        q = sum(c["prefix_cache_queries"] for c in replicas.values())
        rates[policy] = sum(c["prefix_cache_hits"] for c in replicas.values()) / q
    # round-robin spreads the requests evenly over every replica
    rr = data["arms"]["round_robin"]["counters"]["replicas"]
    share = params["requests"] / params["replicas"]
    assert all(abs(c["requests_success"] - share) <= 1 for c in rr.values()), rr
    assert rates["cache_aware"] >= rates["round_robin"], rates
    # the sweep: round-robin's hits fall as the tenants outgrow one replica's cache
    def rate(label):
        c = data["arms"][label]["counters"]["replicas"].values()
        return sum(x["prefix_cache_hits"] for x in c) / sum(x["prefix_cache_queries"] for x in c)
    fewest, most = min(params["sweep_tenants"]), max(params["sweep_tenants"])
    assert rate(f"round_robin tenants={fewest}") > rate(f"round_robin tenants={most}")


def test_12_every_row_of_the_article_has_a_verdict_or_a_reason(smoke_results):
    data = results_of(smoke_results, "12_checklist")
    rows = {(r["technique"], r["metric"].lower()): r for r in data["checklist"]}
    assert set(rows) == set(ARTICLE_TABLE), "the checklist must have the article's rows, no more"
    verdicts = {"confirmed", "partly", "not reproduced here",
                "not reproduced here (within noise)", "missing"}
    for key, r in rows.items():
        assert r["verdict"] in verdicts, (key, r["verdict"])
        assert r["reason"], f"{key}: a verdict needs its reason"
        if r["verdict"] != "missing":
            assert r["measured"] is not None and math.isfinite(r["measured"]), key
    # When every notebook that answers a row ran in this session, none is missing.
    answering = {"01_chunked_prefill", "02_prefix_caching", "04_speculative_decoding",
                 "05_quantization", "07_streaming", "11_model_tiering"}
    if answering <= set(smoke_results[1]):
        missing = [key for key, r in rows.items() if r["verdict"] == "missing"]
        assert not missing, missing


def test_12_sweeps_each_arm_from_its_measured_capacity_to_past_it(smoke_results):
    data = results_of(smoke_results, "12_checklist")
    if data["parameters"].get("rates"):
        pytest.skip("fixed rates were given")
    caps = list(data.get("capacity", {}).values())
    assert len(caps) == len(data["plan"]["arms"]) - len(data.get("skipped_arms", {}))
    assert all(cap["max_rate"] > 0 and cap["sync_rate"] > 0 for cap in caps)
    # Each arm's sweep starts with its synchronous run (the capacity probe's,
    # the sweep's requests per rate one at a time), then Poisson rates above
    # its idle rate, ending past its saturation.
    swept = {}
    for label in data["arms"]:
        if ",rate=" in label:
            arm, rate = label.rsplit(",rate=", 1)
            swept.setdefault(arm, []).append(float(rate))
    by_engine = {c["engine"]: c for c in caps}
    engines = {e["arm"]: e["label"] for e in data["engines"]}
    for arm, rates in swept.items():
        cap = by_engine[engines[arm]]
        sync = data["arms"][f"{arm},synchronous"]
        assert sync["load"] == "sequential x1", sync["load"]
        assert sync["summary"]["requests"] == data["parameters"]["requests_per_rate"], sync["summary"]
        assert len(rates) == data["parameters"]["sweep_points"] - 1, rates
        assert min(rates) > cap["sync_rate"], (arm, rates, cap)
        assert max(rates) > cap["max_rate"], (arm, rates, cap)
    if {"baseline", "combined"} <= set(swept):
        knee = [f for f in data["findings"] if f["metric"].startswith("goodput knee")]
        noted = [n for n in data["notes"] if "goodput knee" in n]
        assert knee or noted, "the knee finding is neither recorded nor noted"
