"""Pure logic of the speculative-decoding experiments: the arms and the plan,
the run table and its comparison with the baseline, the greedy
output-identity check and the findings (no server needed)."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from lab_utils import derived_models
from lab_utils.client import RequestRecord
from lab_utils.experiments import speculative_decoding as sd
from lab_utils.metrics import chunk_frame
from lab_utils.speculation import SPEC_KNOB as SPEC
from lab_utils.speculation import expected_tokens_per_step, ngram_config
from lab_utils.profiles import (
    check_known_options,
    engine_argv,
    load_profile,
)

# --------------------------------------------------------------------------
# Arms and flags
# --------------------------------------------------------------------------

def test_arms_differ_from_the_baseline_in_one_flag():
    assert sd.baseline_arm().flags == {}
    for arm in (sd.ngram_arm(3), sd.draft_arm("/d", 2, "6L")):
        assert list(arm.flags) == ["speculative_config"]
    assert sd.ngram_arm(3).name == "ngram k=3"
    assert sd.draft_arm("/d", 2, "6L").name == "draft 6L k=2"
    assert (sd.ngram_arm(3).method, sd.ngram_arm(3).k) == ("ngram", 3)
    assert sd.draft_arm("/d", 2, "6L").draft_path == "/d"


def test_plan_on_cpu_names_the_truncated_draft_without_building_it(cpu, nothing_built,
                                                                  monkeypatch, tmp_path):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    params = {"ngram_ks": [2, 4], "draft_models": ["truncated"], "draft_ks": [1, 2],
              "draft_layers": 5}
    p = sd.plan(cpu, params)
    assert p.names == ["baseline", "ngram k=2", "ngram k=4", "draft 5L k=1", "draft 5L k=2"]
    assert p.problems() == []
    folder = str(derived_models.truncated_model_dir(5))
    assert p.arm("draft 5L k=2").flags == {"speculative_config": {
        "model": folder, "num_speculative_tokens": 2}}
    for a in p.arms[1:]:  # every treated arm adds one flag to the baseline
        assert a.knob == "speculative_config" and p.reference_of(a).name == "baseline"
    assert sd.plan(cpu, {**params, "draft_models": []}).names == ["baseline", "ngram k=2",
                                                                  "ngram k=4"]
    assert sd.plan(cpu, {"ngram_ks": [], "draft_models": ["none"], "draft_ks": [2]}
                   ).names == ["baseline"]


def test_arm_flags_are_known_to_the_installed_vllm(cpu):
    check_known_options(sd.ngram_arm(4).flags)
    check_known_options(sd.draft_arm("/d", 2, "x").flags)
    argv = engine_argv(cpu, sd.ngram_arm(4).flags, port=8000, model="/m")
    i = argv.index("--speculative-config")
    assert json.loads(argv[i + 1]) == ngram_config(4)


def test_gpu_plan_uses_ngram_gpu_and_maps_the_drafts_vocabulary(cpu, gpu):
    """On cuda the n-gram arm asks for vLLM's "ngram_gpu" (which keeps async
    scheduling, as the baseline has it); the profile's draft, whose facts
    give another vocabulary size (Qwen2.5-0.5B 151,936, 7B 152,064), gets
    use_heterogeneous_vocab, and every arm then pins vLLM's V1 model runner.
    Each flag set is one the installed vLLM's parser accepts."""
    from lab_utils import facts
    assert facts.model_facts(gpu.models["draft"]).vocab_size == 151_936
    assert facts.model_facts(gpu.model).vocab_size == 152_064
    p = sd.plan(gpu, {"ngram_ks": [4], "draft_models": ["profile"], "draft_ks": [2]})
    assert p.problems() == []
    ngram, draft = p.arms[1].flags[SPEC], p.arms[2].flags[SPEC]
    assert ngram["method"] == "ngram_gpu" and ngram["prompt_lookup_min"] == 2
    assert draft == {"model": "Qwen/Qwen2.5-0.5B-Instruct", "num_speculative_tokens": 2,
                     "use_heterogeneous_vocab": True}
    assert p.arms[2].optional and not p.arms[1].optional
    assert {dict(a.env)["VLLM_USE_V2_MODEL_RUNNER"] for a in p.arms} == {"0"}
    assert "V1 model runner" in p.notes[0]
    for a in p.arms:
        check_known_options(a.flags)
    # the cpu plan: "ngram", no vocabulary mapping (a cut of the served model), no pin
    c = sd.plan(cpu, {"ngram_ks": [4], "draft_models": ["truncated"], "draft_ks": [2]})
    assert c.arms[1].flags[SPEC]["method"] == "ngram"
    assert "use_heterogeneous_vocab" not in c.arms[2].flags[SPEC]
    assert all(not a.env for a in c.arms) and c.notes == ()


def test_a_draft_the_profile_cannot_name_is_left_out_with_a_note(gpu):
    """The default draft_models=["truncated"] cuts the embedded model: on gpu
    its arms are left out, with the fix in the plan's note, not an error."""
    p = sd.plan(gpu, {"ngram_ks": [4], "draft_models": ["truncated"], "draft_ks": [2]})
    assert p.names == ["baseline", "ngram k=4"]
    assert "'truncated' skipped" in p.notes[0] and "use 'profile'" in p.notes[0]
    remote = load_profile("remote", base_url="http://127.0.0.1:1")
    r = sd.plan(remote, {"ngram_ks": [], "draft_models": ["profile", "self"], "draft_ks": [2]})
    assert r.names == ["baseline"] and len(r.notes) == 2


def test_explore_methods(cpu, gpu):
    assert "draft: truncated" in sd.explore_methods(cpu)
    assert "draft: profile" in sd.explore_methods(gpu)
    assert "draft: truncated" not in sd.explore_methods(gpu)
    remote = load_profile("remote", base_url="http://127.0.0.1:1")
    assert sd.explore_methods(remote) == ["ngram", "none"]


def test_workload_specs_are_greedy():
    code = sd.workload_specs("code_edit", 3, 40)
    chat = sd.workload_specs("chat", 2, 40)
    assert len(code) == 3 and len(chat) == 2
    assert all(s.temperature == 0.0 and s.max_tokens == 40 and not s.ignore_eos
               for s in code + chat)
    assert {s.tag for s in code} == {"code_edit"} and {s.tag for s in chat} == {"chat"}
    with pytest.raises(ValueError, match="unknown workload"):
        sd.workload_specs("poems", 1, 8)


# --------------------------------------------------------------------------
# Output identity
# --------------------------------------------------------------------------

def requests_frame(rows):
    return pd.DataFrame([{"ok": True, **r} for r in rows])


def test_output_identity_matches_prompts_by_workload_load_and_index():
    frame = requests_frame([
        {"arm": "baseline", "workload": "chat", "concurrency": 1, "index": 0, "text": "hi there"},
        {"arm": "baseline", "workload": "chat", "concurrency": 1, "index": 1, "text": "abc"},
        {"arm": "baseline", "workload": "code_edit", "concurrency": 1, "index": 0, "text": "x"},
        {"arm": "ngram k=4", "workload": "chat", "concurrency": 1, "index": 0, "text": "hi there"},
        {"arm": "ngram k=4", "workload": "chat", "concurrency": 1, "index": 1, "text": "abd"},
        {"arm": "ngram k=4", "workload": "code_edit", "concurrency": 8, "index": 0, "text": "x"},
    ])
    ident = sd.output_identity(frame)
    assert list(ident.identical) == [True, False]  # the c=8 row has no baseline to match
    assert ident.first_difference.tolist()[1] == 2
    assert ident.diff_text.tolist()[0] == "" and "first difference" in ident.diff_text.tolist()[1]
    summary = sd.identity_summary(ident)
    assert summary.loc[("ngram k=4", "chat", 1)].tolist() == [2, 1]


def test_output_identity_without_baseline_is_empty():
    frame = requests_frame([{"arm": "ngram", "workload": "chat", "concurrency": 1, "index": 0,
                             "text": "a"}])
    assert sd.output_identity(frame).empty
    assert sd.identity_summary(sd.output_identity(frame)).empty


# --------------------------------------------------------------------------
# Run rows and the comparison table
# --------------------------------------------------------------------------

def rec(times, tokens, index=0, label="a", ok=True):
    return RequestRecord(index=index, tag="t", label=label, chunk_times=list(times),
                         chunk_tokens=list(tokens), ok=ok)


def fake_run(tpot_s, chunk_gap_s, chunk_tokens, n=3, counters=None):
    records = []
    for i in range(n):
        times, tokens, t, total = [0.1], [1], 0.1, 1
        for _ in range(4):
            t += chunk_gap_s
            total += chunk_tokens
            times.append(t)
            tokens.append(total)
        r = rec(times, tokens, index=i)
        r.ttft, r.output_tokens = 0.1, total
        r.e2e = 0.1 + tpot_s * (total - 1)
        records.append(r)
    from lab_utils.client import Run
    return Run("x", "sequential x1", records, 1.0, counters or {})


def test_run_row_and_compare_to_baseline():
    base_run = fake_run(0.040, 0.040, 1)
    spec_run = fake_run(0.012, 0.048, 4, counters={
        "spec_decode_drafts": 12.0, "spec_decode_draft_tokens": 48.0,
        "spec_decode_accepted_tokens": 36.0, "spec_decode_acceptance_rate": 0.75,
        "spec_decode_mean_accepted_length": 4.0})
    rows = []
    for arm, run in ((sd.baseline_arm(), base_run), (sd.ngram_arm(4), spec_run)):
        chunks = chunk_frame(run.records, arm=arm.name)
        rows.append(sd.run_row(run, arm, "code_edit", 1, chunks, [0.9, 0.8, 0.7, 0.6]))
    runs = pd.DataFrame(rows)
    assert runs.loc[1, "tokens_per_chunk"] == 4.0
    assert runs.loc[1, "itl_chunk_ms_median"] == pytest.approx(48.0)
    assert runs.loc[1, "itl_token_ms_median"] == pytest.approx(12.0)
    assert runs.loc[1, "acceptance_rate"] == 0.75
    assert runs.loc[1, "per_position_acceptance"] == [0.9, 0.8, 0.7, 0.6]
    assert set(sd.RUN_COLUMNS) <= set(runs.columns)
    table = sd.compare_to_baseline(runs)
    row = table.loc[("ngram k=4", "code_edit", 1)]
    assert row.tpot_change_pct == pytest.approx(-70.0)
    assert row.step_cost_ratio == pytest.approx(1.2)
    # speed-up = tokens per step / step cost
    assert row.speedup == pytest.approx(row.tokens_per_chunk / row.step_cost_ratio)
    assert sd.pick(runs, "ngram k=4", "code_edit", 1) == pytest.approx(12.0)
    assert math.isnan(sd.pick(runs, "ngram k=4", "chat", 1))
    assert math.isnan(sd.pick(runs, None, "chat", 1))


def test_compare_without_baseline_and_combine_nothing():
    assert sd.compare_to_baseline(pd.DataFrame()).empty
    empty = sd.combine([])
    assert set(empty) == {"runs", "requests", "chunks", "records"}
    assert empty["runs"].empty and empty["records"] == []
    assert sd.output_identity(empty["requests"]).empty


def test_run_arms_asks_ctx_arm_for_each_planned_arm_after_building_its_draft(cpu, monkeypatch):
    events = []
    monkeypatch.setattr(derived_models, "truncated_model", lambda n: events.append(f"build {n}L"))
    p = sd.plan(cpu, {"ngram_ks": [4], "draft_models": ["truncated"], "draft_ks": [2],
                      "draft_layers": 3})
    # ctx.arm returns None for an arm the target cannot serve (it notes why itself)
    ctx = SimpleNamespace(plan=p, arm=lambda a: events.append(a.name))
    out = sd.run_arms(ctx)
    assert events == ["baseline", "ngram k=4", "build 3L", "draft 3L k=2"]
    assert out["runs"].empty and out["records"] == []
    sd.run_arms(ctx, ["ngram k=4"])
    assert events[-1] == "ngram k=4"


def test_explore_reuses_a_planned_arm_and_starts_others_outside_the_plan(cpu):
    p = sd.plan(cpu, {"ngram_ks": [4], "draft_models": [], "draft_ks": []})
    asked = []
    ctx = SimpleNamespace(plan=p, arm=lambda a: asked.append(("arm", a.name)),
                          any_engine=lambda env=None, **flags: asked.append(("any", flags)))
    sd.explore_engine(ctx, sd.ngram_arm(4))
    sd.explore_engine(ctx, sd.ngram_arm(2))
    assert asked == [("arm", "ngram k=4"), ("any", sd.ngram_arm(2).flags)]


def test_numpy_ints_are_valid_k():
    assert sd.ngram_arm(np.int64(3)).k == 3


def runs_table(high=8):
    """Baseline, n-gram and draft rows for code edits (c=1, c=high) and chat."""
    spec = {"spec_decode_drafts": 12.0, "spec_decode_draft_tokens": 48.0,
            "spec_decode_accepted_tokens": 36.0, "spec_decode_acceptance_rate": 0.75,
            "spec_decode_mean_accepted_length": 4.0}
    none = {"spec_decode_drafts": 0.0, "spec_decode_draft_tokens": 0.0,
            "spec_decode_accepted_tokens": 0.0}
    poor = {"spec_decode_drafts": 40.0, "spec_decode_draft_tokens": 80.0,
            "spec_decode_accepted_tokens": 2.0, "spec_decode_acceptance_rate": 0.025,
            "spec_decode_mean_accepted_length": 1.05}
    plan = [(sd.baseline_arm(), (0.040, 0.040, 1, {}), (0.040, 0.040, 1, {})),
            (sd.ngram_arm(4), (0.012, 0.048, 4, spec), (0.041, 0.041, 1, none)),
            (sd.draft_arm("/d", 2, "6L"), (0.080, 0.080, 1, poor), (0.085, 0.085, 1, poor))]
    rows = []
    for arm, code, chat in plan:
        for workload, conc, (tp, gap, per, counters) in (("code_edit", 1, code),
                                                          ("chat", 1, chat),
                                                          ("code_edit", high, code)):
            run = fake_run(tp, gap, per, counters=counters)
            pos = [0.9, 0.8, 0.7, 0.6] if counters is spec else []
            rows.append(sd.run_row(run, arm, workload, conc, chunk_frame(run.records), pos))
    return pd.DataFrame(rows)


def test_speculation_economics():
    econ = sd.speculation_economics(runs_table())
    assert "baseline" not in econ.index.get_level_values("arm")
    ng = econ.loc[("ngram k=4", "code_edit", 1)]
    assert ng.k == 4 and ng.step_cost_ratio == pytest.approx(1.2)
    assert expected_tokens_per_step(ng.break_even_acceptance, 4) == pytest.approx(1.2)
    dr = econ.loc[("draft 6L k=2", "code_edit", 1)]
    assert dr.step_cost_ratio == pytest.approx(2.0) and dr.speedup == pytest.approx(0.5)
    assert 0.5 < dr.break_even_acceptance < 1  # 2 tokens/step from k=2 needs alpha ~0.62
    assert sd.speculation_economics(pd.DataFrame()).empty


def test_findings_cover_the_issue_list():
    runs = runs_table()
    ident = sd.output_identity(requests_frame([
        {"arm": a, "workload": "chat", "concurrency": 1, "index": 0, "text": t}
        for a, t in (("baseline", "same"), ("ngram k=4", "same"), ("draft 6L k=2", "sane"))]))
    out = sd.findings(runs, ident, high_concurrency=8, article_claim="TPOT -50-100%")
    techniques = [f["technique"] for f in out]
    assert techniques == ["speculative decoding: n-gram, code edits",
                          "speculative decoding: n-gram, chat",
                          "speculative decoding: n-gram under load",
                          "speculative decoding: n-gram acceptance",
                          "speculative decoding: draft model",
                          "speculative decoding: draft model, chat",
                          "speculative decoding: output identity"]
    first = out[0]
    assert (first["baseline"], first["treated"]) == (pytest.approx(40.0), pytest.approx(12.0))
    assert "36 of 48 draft tokens (75%)" in first["mechanism"]
    assert "no drafts proposed" in out[1]["mechanism"]
    assert "8 in flight" in out[2]["metric"]
    assert math.isnan(out[3]["baseline"]) and out[3]["treated"] == pytest.approx(75.0)
    assert out[3]["mechanism"].endswith("90%, 80%, 70%, 60%")
    assert (out[-1]["baseline"], out[-1]["treated"]) == (2.0, 1.0)
    assert "draft 6L k=2: 0/1" in out[-1]["mechanism"]
    assert out[0]["checklist"] == sd.CHECKLIST_ROW and "best case" in out[0]["reason"]
    assert "CPU" not in out[0]["reason"] and "135M" not in out[0]["reason"]  # device-true
    assert sum("checklist" in f for f in out) == 1
    for f in out:  # without per-request rows there are no samples to bootstrap
        assert {"technique", "metric", "baseline", "treated", "article_claim",
                "mechanism"} <= set(f) and "samples" not in f


def test_findings_carry_tpot_samples_and_results_accept_them(tmp_path):
    from lab_utils.results import Results
    runs = runs_table()
    requests = pd.DataFrame([
        {"arm": arm, "workload": "code_edit", "concurrency": 1, "ok": True, "tpot_ms": v}
        for arm, vals in (("baseline", [40, 42, 39]), ("ngram k=4", [12, 11, 13]))
        for v in vals])
    assert sd.tpot_samples(requests, "ngram k=4", "code_edit", 1) == [12.0, 11.0, 13.0]
    assert sd.tpot_samples(requests, "ngram k=4", "chat", 1) == []
    assert sd.tpot_samples(None, "x", "chat", 1) == []
    out = sd.findings(runs, pd.DataFrame(), high_concurrency=8, article_claim="c",
                      requests=requests)
    assert out[0]["samples"] == ([40.0, 42.0, 39.0], [12.0, 11.0, 13.0])
    assert all("samples" not in f for f in out[1:])
    res = Results("nb", tmp_path)
    recorded = res.add_finding(**out[0])
    assert recorded["checklist"] == sd.CHECKLIST_ROW and recorded["significant"] is True
    assert recorded["change_ci95"][1] < -50


def test_findings_skip_what_was_not_measured():
    runs = runs_table()
    only_base = runs[runs.arm == "baseline"]
    assert sd.findings(only_base, pd.DataFrame(), high_concurrency=8, article_claim="x") == []
    no_load = sd.findings(runs, pd.DataFrame(), high_concurrency=0, article_claim="x")
    assert not any("under load" in f["technique"] for f in no_load)


def test_load_warning_names_busy_runs():
    runs = pd.DataFrame([{"arm": "baseline", "workload": "chat", "concurrency": 1,
                          "host_load_1m": 9.5},
                         {"arm": "ngram k=4", "workload": "chat", "concurrency": 1,
                          "host_load_1m": 1.2}])
    msg = sd.load_warning(runs, cores=2)
    assert "1 of 2 runs" in msg and "baseline/chat/1 (9.5)" in msg and "ngram" not in msg
    assert sd.load_warning(runs, cores=8) == ""
    assert sd.load_warning(pd.DataFrame(), cores=2) == ""


def test_findings_on_a_hand_made_run_table():
    cols = ["arm", "method", "workload", "concurrency", "tpot_ms_median", "drafts",
            "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
            "tokens_per_chunk", "per_position_acceptance"]
    runs = pd.DataFrame([
        ("baseline", "none", "code_edit", 1, 30.0, 0, 0, 0, None, None, 1.0, []),
        ("baseline", "none", "chat", 1, 20.0, 0, 0, 0, None, None, 1.0, []),
        ("ngram k=2", "ngram", "code_edit", 1, 10.0, 10, 20, 18, 0.9, 2.8, 2.5, [0.95, 0.85]),
        ("ngram k=2", "ngram", "chat", 1, 22.0, 5, 10, 1, 0.1, 1.2, 1.1, [0.2, 0.0]),
    ], columns=cols)
    identity = pd.DataFrame({"arm": ["ngram k=2"] * 4, "identical": [True, True, True, False]})
    out = sd.findings(runs, identity, high_concurrency=0, article_claim="claim")
    by = {f["technique"]: f for f in out}
    assert list(by) == ["speculative decoding: n-gram, code edits",
                        "speculative decoding: n-gram, chat",
                        "speculative decoding: n-gram acceptance",
                        "speculative decoding: output identity"]
    code = by["speculative decoding: n-gram, code edits"]
    assert (code["baseline"], code["treated"]) == (30.0, 10.0)
    assert code["metric"] == "TPOT median (ms), code edits, 1 at a time, baseline -> ngram k=2"
    assert "accepted 18 of 20 draft tokens (90%) in 10 drafts" in code["mechanism"]
    assert code["checklist"] == "speculative decoding:tpot"
    chat = by["speculative decoding: n-gram, chat"]
    assert (chat["baseline"], chat["treated"]) == (20.0, 22.0)
    acc = by["speculative decoding: n-gram acceptance"]
    assert (acc["baseline"], acc["treated"]) == (pytest.approx(10.0), pytest.approx(90.0))
    assert acc["mechanism"].endswith("per draft position: 95%, 85%")
    same = by["speculative decoding: output identity"]
    assert (same["baseline"], same["treated"]) == (4.0, 3.0)
    assert same["mechanism"].endswith("ngram k=2: 3/4")
