"""Pure logic of the prefix-caching experiments: the plan, the full-block
rule, exact token-id prompts, hit rates, TTFT tables and the findings (no
server needed)."""
import itertools
import math
from pathlib import Path

import pandas as pd
import pytest

from lab_utils import workloads
from lab_utils.experiments import prefix_caching as pc
from lab_utils.model import embedded_model_dir
from lab_utils.profiles import load_profile

_names = itertools.count()


from stand_ins import word_tokenizer  # noqa: E402


def test_the_plan_is_off_then_on_differing_in_one_flag():
    plan = pc.plan(load_profile("cpu"), {}).check()
    assert [(a.name, dict(a.flags), a.knob) for a in plan.arms] == [
        ("off", {"enable_prefix_caching": False}, None),
        ("on", {"enable_prefix_caching": True}, "enable_prefix_caching")]
    assert plan.reference_of("on").name == "off"


@pytest.mark.parametrize("seqs, n", [
    ([], 0),
    ([[1, 2, 3]], 3),
    ([[1, 2, 3], [1, 2, 4]], 2),
    ([[1, 2, 3], [1, 2]], 2),
    ([[5, 1], [6, 1]], 0),
    ([[1, 2, 3, 9], [1, 2, 3, 8], [1, 7, 3, 9]], 1),
])
def test_common_prefix_len(seqs, n):
    assert pc.common_prefix_len(seqs) == n


@pytest.mark.parametrize("shared, cached", [
    (0, 0), (64, 0), (127, 0), (128, 128), (129, 128), (255, 128), (256, 256), (520, 512),
    (2048, 2048),
])
def test_expected_cached_tokens_full_blocks_only(shared, cached):
    assert pc.expected_cached_tokens(shared, shared + 64, 128) == cached


def test_expected_cached_tokens_never_the_last_token():
    # The whole 256-token prompt is cached, but its last token must be recomputed:
    # the hit stops one block short.
    assert pc.expected_cached_tokens(256, 256, 128) == 128
    assert pc.expected_cached_tokens(257, 257, 128) == 256
    assert pc.expected_cached_tokens(50, 40, 16) == 32
    with pytest.raises(ValueError):
        pc.expected_cached_tokens(10, 20, 0)


@pytest.mark.parametrize("prefix", [0, 5, 64, 127, 128, 129])
def test_exact_prefix_specs_share_exactly_the_prefix(prefix):
    tok = word_tokenizer()
    specs = pc.exact_prefix_specs(tok, 4, prefix, 12, seed=3, max_tokens=2)
    assert len(specs) == 4
    ids = [s.prompt for s in specs]
    assert all(isinstance(i, list) and len(i) == prefix + 12 for i in ids)
    assert pc.common_prefix_len(ids) == prefix           # not one token more
    assert len({i[prefix] for i in ids}) == 4            # suffixes differ at once
    assert all(s.ignore_eos and s.max_tokens == 2 and s.api == "completions" for s in specs)
    again = pc.exact_prefix_specs(tok, 4, prefix, 12, seed=3, max_tokens=2)
    assert [s.prompt for s in again] == ids              # deterministic: both arms alike


def test_system_prompt_specs():
    specs = pc.system_prompt_specs(5, max_tokens=3)
    systems = {s.messages[0]["content"] for s in specs}
    assert systems == {workloads.system_prompts()["long"]}
    assert len({s.messages[1]["content"] for s in specs}) == 5
    assert all(s.api == "chat" and s.max_tokens == 3 for s in specs)
    with pytest.raises(ValueError, match="distinct questions"):
        pc.system_prompt_specs(1000)


def _frame():
    rows = []
    for arm, hits, ttft in (("off", 0, 600.0), ("on", 512, 80.0)):
        for phase, n in (("warm-up", 1), ("measured", 4)):
            run = f"{arm}/a/{phase}"
            q = 0 if arm == "off" else 530 * n
            h = 0 if (arm == "off" or phase == "warm-up") else hits * n
            for i in range(n):
                rows.append({"arm": arm, "experiment": "system_prompt", "prefix_len": 512,
                             "phase": phase, "run": run, "run_queries": q, "run_hits": h,
                             "ok": True, "prompt_tokens": 530,
                             "cached_tokens": 0 if phase == "warm-up" else hits,
                             "ttft_ms": (900.0 if phase == "warm-up" else ttft + i)})
    return pd.DataFrame(rows)


def test_findings_of_an_emulated_off_arm_on_a_server_without_token_details():
    """A remote server's off arm, emulated: vLLM looks up (queries) but a fresh
    cache_salt per request cannot hit; without --enable-prompt-tokens-details
    the server reports no cached tokens per request, and the text says so."""
    f = _frame()
    off = (f.arm == "off") & (f.phase == "measured")
    f.loc[off, "run_queries"] = 4 * 530
    f["cached_tokens"] = None
    b = f.assign(experiment="prefix_length", run=f.run + "b")
    c = f.assign(experiment="block_boundary", run=f.run + "c", block_size=16,
                 shared_tokens=512, predicted_cached=512)
    median, _, longest = pc.findings({"system_prompt": f, "prefix_length": b,
                                      "block_boundary": c})
    assert median["mechanism"] == (
        "vllm:prefix_cache_hits/queries = 96.6% on the 'on' arm (off: 0 hits of 2120 queried "
        "tokens); cached tokens per request not reported (the server runs without "
        "--enable-prompt-tokens-details)")
    assert "not reported" in longest["mechanism"]


def test_hit_rate_and_hit_rates():
    f = _frame()
    assert pc.hit_rate(f[f.arm == "off"]) is None          # no lookups, no rate
    on = f[f.arm == "on"]
    assert pc.hit_rate(on[on.phase == "measured"]) == pytest.approx(512 / 530)
    assert pc.hit_rate(on) == pytest.approx(4 * 512 / (5 * 530))
    table = pc.hit_rates([f])
    assert table.loc[("on", "system_prompt"), "hits"] == 4 * 512
    assert table.loc[("on", "system_prompt"), "hit_rate"] == pytest.approx(512 / 530)
    assert math.isnan(table.loc[("off", "system_prompt"), "hit_rate"])  # shown as NaN


def test_ttft_table_leaves_out_warmup():
    t = pc.ttft_table(_frame())
    assert list(t.index) == ["off", "on"]
    assert t.loc["off", "requests"] == 4
    assert t.loc["off", "ttft_ms_median"] == pytest.approx(601.5)
    assert t.loc["on", "cached_tokens"] == 512
    assert t.loc["on", "ttft_ms_p99"] <= 83.0                 # the 900 ms warm-up is out
    change = pc.arm_change(t, "ttft_ms_median")
    assert change["change_pct"] == pytest.approx((81.5 - 601.5) / 601.5 * 100)


def test_arm_change_missing_arm_is_nan():
    t = pc.ttft_table(_frame()[lambda d: d.arm == "on"])
    c = pc.arm_change(t, "ttft_ms_median")
    assert math.isnan(c["off"]) and math.isnan(c["change_pct"])


def test_gain_vs_hits():
    g = pc.gain_vs_hits(_frame())
    assert g.loc[512, "saved_ms"] == pytest.approx(520.0)
    assert g.loc[512, "cached_tokens_on"] == 512


MODEL_DIR = embedded_model_dir()


@pytest.mark.skipif(not (Path(MODEL_DIR) / "tokenizer.json").is_file(),
                    reason=f"no converted model at {MODEL_DIR}")
@pytest.mark.parametrize("prefix", [127, 128, 255])
def test_real_tokenizer_exact_prefix(prefix):
    tok = workloads.local_tokenizer(str(MODEL_DIR))
    ids = [s.prompt for s in pc.exact_prefix_specs(tok, 3, prefix, 64, seed=7)]
    assert pc.common_prefix_len(ids) == prefix
    assert pc.expected_cached_tokens(prefix, prefix + 64, 128) == prefix // 128 * 128


def test_tables_of_skipped_arms_are_empty():
    # The remote profile may skip both arms: the analysis must not crash.
    empty = pd.DataFrame(columns=pc.SHOW)
    frames = {"system_prompt": empty, "prefix_length": empty, "block_boundary": empty}
    assert pc.ttft_table(empty).empty
    assert pc.hit_rates(frames.values()).empty
    assert pc.hit_rate(empty) is None
    assert pc.block_table(empty).empty and pc.gain_vs_hits(empty).empty
    h = pc.headline(frames)
    assert math.isnan(h["a_median"]["change_pct"]) and h["longest_prefix"] == 0
    assert pc.plot_block_hits(empty, 128) is None
    assert pc.plot_gains_track_hits(frames.values()) is None


def test_headline_and_block_table():
    f = _frame()
    b = f.assign(experiment="prefix_length", run=f.run + "b")
    c = f.assign(experiment="block_boundary", run=f.run + "c", block_size=128,
                 shared_tokens=512, predicted_cached=512)
    h = pc.headline({"system_prompt": f, "prefix_length": b, "block_boundary": c})
    assert h["a_median"]["off"] == pytest.approx(601.5) and h["a_cached"] == 512
    assert h["a_hit_rate"] == pytest.approx(512 / 530) == h["b_hit_rate"]
    assert h["longest_prefix"] == 512 and h["b_prompt"] == 530
    t = pc.block_table(c)
    assert t.loc[512, "full_blocks"] == 4 and t.loc[512, "cached_on"] == 512
    assert t.loc[512, "cached_off"] == 0 and t.loc[512, "predicted_cached"] == 512


def test_findings_of_hand_made_frames(tmp_path):
    from lab_utils.results import Results
    f = _frame()  # measured TTFT off 600..603 ms, on 80..83 ms; 512 of 530 tokens hit
    b = f.assign(experiment="prefix_length", run=f.run + "b")
    c = f.assign(experiment="block_boundary", run=f.run + "c", block_size=128,
                 shared_tokens=512, predicted_cached=512)
    frames = {"system_prompt": f, "prefix_length": b, "block_boundary": c}
    median, p99, longest = pc.findings(frames)
    assert (median["baseline"], median["treated"]) == (601.5, 81.5)
    assert p99["baseline"] == pytest.approx(602.97) and p99["treated"] == pytest.approx(82.97)
    assert median["metric"] == "TTFT median (ms), off -> on" and p99["stat"] == "p99"
    assert median["checklist"] == "prefix caching:ttft" and p99["checklist"] is None
    assert median["samples"] == ([600.0, 601.0, 602.0, 603.0], [80.0, 81.0, 82.0, 83.0])
    assert median["mechanism"] == ("vllm:prefix_cache_hits/queries = 96.6% on the 'on' arm "
                                   "(off: no lookups); 512 of 530 prompt tokens cached per "
                                   "request")
    assert longest["technique"] == "prefix caching: long shared prefix"
    assert longest["metric"] == "TTFT median (ms), 512-token shared prefix, off -> on"
    assert (longest["baseline"], longest["treated"]) == (601.5, 81.5)
    assert longest["mechanism"].startswith("vllm:prefix_cache_hits/queries = 96.6%; 512 of 530")
    table = Results("02_prefix_caching", tmp_path).add_findings([median, p99, longest])
    assert table.change_pct[0] == pytest.approx((81.5 - 601.5) / 601.5 * 100)
    assert pc.block_rule_note(c) == "block rule: 512 shared -> 512 cached"


def test_on_a_default_remote_server_off_is_emulated_and_never_hits(tmp_path, remote):
    """A server with prefix caching on (tests/fake_vllm.py counts hits per
    cache_salt as vLLM does): the off arm is emulated with a salt per request,
    and its counters show no hit while the on arm's show some."""
    from lab_utils.notebook import setup
    ctx = setup("02_prefix_caching", {"profile": "remote", "base_url": remote.base_url,
                                      "results_dir": str(tmp_path)}, plan=pc.plan)
    assert ctx.results.data["remote_arms"]["off"]["runs"] == "emulated"
    assert ctx.results.data["remote_arms"]["on"]["runs"] == "as the server runs"
    frames = pc.run_arms(ctx, system_requests=3, prefix_lengths=(0, 64), prefix_repeats=2,
                         block_prefixes=(16, 17), block_repeats=2, max_tokens=2,
                         progress=False)
    assert "skipped_arms" not in ctx.results.data
    arms = ctx.results.data["arms"]
    hits = {"off": 0.0, "on": 0.0}
    for label, a in arms.items():
        hits[label.split("/")[0]] += a["counters"]["prefix_cache_hits"]
    assert set(hits) == {"off", "on"}, sorted(arms)
    assert hits["off"] == 0 and hits["on"] > 0, hits
    assert not frames["system_prompt"].empty


def test_an_unreachable_remote_server_fails_at_setup_naming_the_fix(tmp_path):
    from lab_utils.errors import ServerError
    from lab_utils.notebook import setup
    with pytest.raises(ServerError, match="cannot reach the remote server.*LAB_REMOTE_URL"):
        setup("02_prefix_caching", {"profile": "remote", "base_url": "http://127.0.0.1:9",
                                    "results_dir": str(tmp_path)}, plan=pc.plan)
