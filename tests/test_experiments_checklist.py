"""Experiments of 12_checklist: the plan's baseline and combined arms from a
checklist table, and the combined configuration's findings (no vLLM needed)."""
import math

import pandas as pd

from lab_utils.experiments import checklist as combo
from lab_utils.paths import NOTEBOOKS_DIR
from lab_utils.profiles import load_profile


def verdicts(**by_row: str) -> pd.DataFrame:
    """A checklist table with only what `combined_flags` reads."""
    return pd.DataFrame({"technique": list(by_row), "verdict": list(by_row.values())})


def test_plan_turns_on_what_helped_as_one_declared_combination():
    cpu = load_profile("cpu")
    table = verdicts(**{"prefix caching": "confirmed", "chunked prefill": "not reproduced here",
                        "speculative decoding": "partly"})
    plan = combo.plan(cpu, {}, table)
    assert plan.names == ["baseline", "combined"] and plan.problems() == []
    assert dict(plan.baseline.flags) == {"enable_prefix_caching": False,
                                         "enable_chunked_prefill": False,
                                         "max_num_batched_tokens": 4096}  # cpu max_model_len
    combined = plan.arm("combined")
    assert combined.knob == ("enable_prefix_caching", "speculative_config")
    assert combined.flags["enable_prefix_caching"] is True
    assert combined.flags["enable_chunked_prefill"] is False
    assert combined.flags["speculative_config"]["method"] == "ngram"
    assert combo.chosen_techniques(plan) == ["prefix caching", "speculative decoding"]


def test_plan_without_a_helpful_technique_runs_the_baseline_alone():
    plan = combo.plan(load_profile("cpu"), {}, verdicts(**{"prefix caching": "missing"}))
    assert plan.names == ["baseline"] and "'combined' left out" in plan.notes[0]
    assert combo.chosen_techniques(plan) == []


def test_findings_source_is_findings_dir_or_this_runs_results(tmp_path):
    assert combo.findings_source({"results_dir": "../runs/x/results", "findings_dir": ""}) == \
        (NOTEBOOKS_DIR / "../runs/x/results").resolve()
    assert combo.findings_source({"results_dir": "r", "findings_dir": str(tmp_path)}) == tmp_path


def test_findings_compare_the_top_rate_hand_made():
    sweep = pd.DataFrame({
        "arm": ["baseline", "baseline", "combined", "combined"], "rate": [0.25, 1.0, 0.25, 1.0],
        "ttft_ms_p99": [900.0, 4000.0, 300.0, 1000.0], "tpot_ms_p99": [40.0, 60.0, 35.0, 45.0],
        "goodput": [0.25, 0.5, 0.25, 0.9], "prefix_cache_hit_rate": [0.0, 0.0, 0.5, 0.75],
        "spec_acceptance": [None, None, None, math.nan]})
    found = combo.findings(sweep, ["prefix caching"])
    assert [(f["metric"], f["baseline"], f["treated"]) for f in found] == [
        ("ttft_ms_p99 at 1.0 req/s, mixed workload", 4000.0, 1000.0),
        ("tpot_ms_p99 at 1.0 req/s, mixed workload", 60.0, 45.0),
        ("goodput at 1.0 req/s, mixed workload", 0.5, 0.9)]
    assert all(f["technique"] == "combined configuration"
               and f["article_claim"] == "the checklist's techniques combine" for f in found)
    assert found[0]["mechanism"].startswith("combined = ['prefix caching']; prefix-cache hit "
                                            "rate 75%, spec acceptance ")
    assert combo.findings(sweep[sweep.arm == "baseline"], []) == []
    assert combo.findings(None, []) == []


def test_one_technique_is_a_combination_of_one():
    plan = combo.plan(load_profile("cpu"), {}, verdicts(**{"chunked prefill": "partly"}))
    assert plan.arm("combined").knob == ("enable_chunked_prefill",) and plan.problems() == []
