"""Experiments of 12_checklist: the plan's baseline and combined arms from a
checklist table, and the combined configuration's findings (no vLLM needed)."""
import pandas as pd
import pytest

from lab_utils.capacity import Capacity

from lab_utils.experiments import checklist as combo
from lab_utils.paths import NOTEBOOKS_DIR
from lab_utils.profiles import load_profile
from lab_utils.results import Results


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


def _results_of_01(folder, profile, budgets):
    """The results file 01 writes in the findings folder: its plan (as
    `lab.setup` records it) for these budgets."""
    import json

    from lab_utils.experiments import chunked_prefill
    plan = chunked_prefill.plan(profile, {"budgets": budgets}).to_dict()
    (folder / "01_chunked_prefill.json").write_text(json.dumps({"plan": plan}))


def test_combined_arm_chunks_the_long_prompts_at_01s_budget(tmp_path):
    """Chunked prefill in the combined arm runs at the smallest budget 01
    measured (its checklist finding's arm), below the long documents the
    mixed workload serves, instead of the baseline's max_model_len (4,096 on
    cpu), at which no prompt of this workload would be split."""
    cpu = load_profile("cpu")
    table = verdicts(**{"chunked prefill": "confirmed", "speculative decoding": "confirmed"})
    _results_of_01(tmp_path, cpu, [512, 128, 1024])
    plan = combo.plan(cpu, {"findings_dir": str(tmp_path)}, table)
    combined = plan.arm("combined")
    assert combined.flags["enable_chunked_prefill"] is True
    assert combined.flags["max_num_batched_tokens"] == 128
    assert combined.knob == ("enable_chunked_prefill", "max_num_batched_tokens",
                             "speculative_config")
    assert plan.problems() == []
    assert combo.chosen_techniques(plan) == ["chunked prefill", "speculative decoding"]
    # without 01's results: the smallest of 01's default budgets (its parameters cell)
    from lab_utils.notebook import parameter_defaults
    default = min(parameter_defaults("01_chunked_prefill.ipynb")["budgets"])
    assert combo.plan(cpu, {"findings_dir": str(tmp_path / "none")}, table).arm(
        "combined").flags["max_num_batched_tokens"] == default
    # the long documents are longer than either budget (the embedded model's tokenizer)
    from lab_utils.model import embedded_model_dir
    if (embedded_model_dir() / "tokenizer.json").is_file():
        from lab_utils.workloads import local_tokenizer
        tok = local_tokenizer(str(embedded_model_dir()))
        docs = [s for s in combo.mixed_workload(60, seed=1) if s.tag == "long_doc"]
        assert docs and min(len(tok.encode(d.messages[-1]["content"])) for d in docs) > max(
            default, 128) * 2


def test_combined_arm_on_cuda_uses_ngram_gpu_and_passes_the_checker(tmp_path):
    """On cuda the n-gram arm of the combination is "ngram_gpu" (vLLM keeps
    async scheduling on, as in the baseline); with 01's budgets at or above
    vLLM's default max_num_seqs on an H100 (1,024) the checker finds nothing."""
    from lab_utils import facts, plan as checker
    gpu = load_profile("gpu")
    _results_of_01(tmp_path, gpu, [2048, 8192])
    table = verdicts(**{"chunked prefill": "confirmed", "speculative decoding": "partly",
                        "prefix caching": "confirmed"})
    plan = combo.plan(gpu, {"findings_dir": str(tmp_path)}, table)
    flags = plan.arm("combined").flags
    assert flags["speculative_config"]["method"] == "ngram_gpu"
    assert flags["max_num_batched_tokens"] == 2048 < gpu.engine["max_model_len"]
    assert checker.check_plan(plan, gpu, facts.device("h100-80gb")).problems == []


def test_plan_without_a_helpful_technique_runs_the_baseline_alone():
    plan = combo.plan(load_profile("cpu"), {}, verdicts(**{"prefix caching": "missing"}))
    assert plan.names == ["baseline"] and "'combined' left out" in plan.notes[0]
    assert combo.chosen_techniques(plan) == []


def test_findings_source_is_findings_dir_or_this_runs_results(tmp_path):
    assert combo.findings_source({"results_dir": "../runs/x/results", "findings_dir": ""}) == \
        (NOTEBOOKS_DIR / "../runs/x/results").resolve()
    assert combo.findings_source({"results_dir": "r", "findings_dir": str(tmp_path)}) == tmp_path


def test_findings_compare_the_knees_hand_made():
    # baseline: all 4 requests met at 0.5 req/s, 2 of 4 at 1.0 -> crosses 0.9 at
    # 0.5 + 0.1/0.5 x 0.5 = 0.6; combined: all met at 1.0, 1 of 4 at 2.0 -> 1.0 + 0.1/0.75 = 1.133
    met = {("baseline", 0.5): [1, 1, 1, 1], ("baseline", 1.0): [1, 1, 0, 0],
           ("combined", 1.0): [1, 1, 1, 1], ("combined", 2.0): [1, 0, 0, 0]}
    sweep = pd.DataFrame([{"arm": a, "rate": r, "slo_met_fraction": sum(v) / len(v),
                           "goodput": r * sum(v) / len(v), "prefix_cache_hit_rate": 0.5,
                           "spec_acceptance": None} for (a, r), v in met.items()])
    requests = pd.DataFrame([{"arm": a, "rate": r, "slo_met": bool(x)}
                             for (a, r), v in met.items() for x in v])
    caps = {a: Capacity(sync_e2e_s=e2e, max_rate=mx, concurrency=8, requests=16, seconds=9)
            for a, e2e, mx in (("baseline", 2.0, 0.8), ("combined", 0.5, 1.6))}
    knee, throughput, sync = combo.findings(sweep, ["prefix caching"], requests, caps)
    assert knee["baseline"] == pytest.approx(0.6) and knee["treated"] == pytest.approx(1 + 0.4 / 3)
    assert knee["knee_ratio"] == pytest.approx((1 + 0.4 / 3) / 0.6)
    lo, hi = knee["knee_ratio_ci95"]
    assert lo <= knee["knee_ratio"] <= hi
    assert knee["knee_passed"] == {"baseline": True, "combined": True}
    assert knee["mechanism"].startswith("combined = ['prefix caching']; prefix-cache hit rate 50%")
    assert (throughput["baseline"], throughput["treated"]) == (0.8, 1.6)
    assert (sync["baseline"], sync["treated"]) == (2000.0, 500.0)
    assert all(f["technique"] == "combined configuration"
               and f["article_claim"] == "the checklist's techniques combine"
               for f in (knee, throughput, sync))
    # One arm alone: nothing to compare.
    assert combo.findings(sweep[sweep.arm == "baseline"], []) == []


def test_a_knee_no_request_defines_is_noted_with_that_reason_not_as_an_arm_missing(tmp_path):
    # As on a 2-core Zen 4 guest (make run, 2026-12-03): the baseline's TPOT was above
    # 50 ms at every rate, so no request met the SLO and it has no knee; both arms ran.
    met = {("baseline", 0.188): [0, 0, 0, 0], ("baseline", 0.5): [0, 0, 0, 0],
           ("combined", 0.157): [1, 1, 0, 0], ("combined", 0.5): [1, 0, 0, 0]}
    sweep = pd.DataFrame([{"arm": a, "rate": r, "slo_met_fraction": sum(v) / len(v),
                           "goodput": r * sum(v) / len(v), "prefix_cache_hit_rate": 0.9,
                           "spec_acceptance": 0.5} for (a, r), v in met.items()])
    requests = pd.DataFrame([{"arm": a, "rate": r, "slo_met": bool(x)}
                             for (a, r), v in met.items() for x in v])
    knee = combo.findings(sweep, ["prefix caching"], requests)[0]
    # the text says so, where it printed "knee ratio nanx (95% CI nan-nan)" (make run, 521fa8c)
    assert "nan" not in knee["mechanism"]
    assert knee["mechanism"].endswith("; knee ratio undefined (an arm has no knee)")
    assert knee["why_missing"] == ("none of the baseline arm's requests at its lightest rate "
                                   "(0.188 req/s) met the SLO (TTFT <= 2 s, TPOT <= 50 ms): "
                                   "no knee to compare")
    results = Results("12_checklist", tmp_path, profile="cpu")
    assert results.add_finding(**knee)["recorded"] is False
    assert results.data["findings"] == []
    assert results.data["notes"][-1].endswith("no baseline value (" + knee["why_missing"] + ")")
    # Without a reason, the note says an arm did not run.
    results.add_finding("t", "m", float("nan"), 1.0, "c", "m")
    assert results.data["notes"][-1].endswith("(an arm did not run here)")


def test_a_kneeless_arm_sent_one_at_a_time_is_named_so():
    # The sweep's first point is the synchronous run (load "synchronous"):
    # the reason names it, not a Poisson rate.
    met = {("baseline", 0.3, "synchronous"): [0, 0, 0, 0], ("baseline", 0.6, "poisson"): [0, 0, 0, 0],
           ("combined", 0.4, "synchronous"): [1, 1, 1, 1], ("combined", 0.8, "poisson"): [1, 0, 0, 0]}
    sweep = pd.DataFrame([{"arm": a, "rate": r, "load": load, "slo_met_fraction": sum(v) / len(v),
                           "goodput": r * sum(v) / len(v), "prefix_cache_hit_rate": 0.9,
                           "spec_acceptance": 0.5} for (a, r, load), v in met.items()])
    requests = pd.DataFrame([{"arm": a, "rate": r, "slo_met": bool(x)}
                             for (a, r, _), v in met.items() for x in v])
    knee = combo.findings(sweep, ["prefix caching"], requests)[0]
    assert knee["why_missing"].startswith("none of the baseline arm's requests sent one at a "
                                          "time (0.3 req/s) met the SLO")


def test_knees_say_when_the_sweep_never_passed_the_knee():
    sweep = pd.DataFrame({"arm": ["a", "a"], "rate": [1.0, 2.0], "slo_met_fraction": [1.0, 1.0]})
    k = combo.knees(sweep)
    assert k.loc["a", "knee_rate"] == 2.0 and not k.loc["a", "passed_the_knee"]


def test_the_summary_marks_each_arms_one_at_a_time_point():
    import matplotlib
    matplotlib.use("Agg")
    table = pd.DataFrame({"technique": ["prefix caching"], "metric": ["TTFT"],
                          "claimed": ["40-60%"], "measured": [50.0], "verdict": ["confirmed"]})
    sweep = pd.DataFrame({"arm": ["baseline"] * 3, "rate": [0.4, 0.6, 0.8],
                          "load": ["synchronous", "poisson", "poisson"],
                          "goodput": [0.4, 0.5, 0.3], "slo_met_fraction": [1.0, 0.8, 0.4],
                          "ttft_ms_p99": [900.0, 1500.0, 4000.0], "tpot_ms_p99": [40.0, 45, 60]})
    fig = combo.summary_figure(table, sweep)
    goodput = next(ax for ax in fig.axes if ax.get_ylabel().startswith("goodput"))
    marked = [line for line in goodput.get_lines() if line.get_marker() == "s"]
    assert [list(line.get_xdata()) for line in marked] == [[0.4]]
    assert marked[0].get_label() == "baseline: one at a time"
    claims = next(ax for ax in fig.axes if ax.get_title().startswith("The article's checklist"))
    assert [t.get_text() for t in claims.get_legend().get_texts()][0] == "article's claim"


def test_a_sweep_with_no_rate_says_what_to_choose():
    # Explore's rate list starts empty; pressing Run without a rate used to end
    # in pandas' "No objects to concatenate".
    with pytest.raises(ValueError, match="choose at least one request rate"):
        combo.goodput_sweep(None, "baseline", [], 8)
