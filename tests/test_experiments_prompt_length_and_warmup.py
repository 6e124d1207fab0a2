"""Pure logic of the 03 notebook's experiments: prompts, quality checks, KV
blocks, the start-up timeline and the summaries (no server needed)."""
from types import SimpleNamespace

import pandas as pd
import pytest

from lab_utils import system_prompts
from lab_utils.experiments import prompt_length_and_warmup as pw

# The latest start's last line before it serves (the whole start-up log is
# parsed in tests/test_vllm_logs.py).
LOG = """$ vllm serve M --port 2
(APIServer pid=5478) INFO 11-30 13:59:11 [entry.py:140] Starting vLLM server on http://127.0.0.1:2
"""


def test_system_prompt_text():
    sp = system_prompts()
    assert pw.system_prompt_text("long") == sp["long"]
    assert pw.system_prompt_text("short") == sp["short"]
    assert pw.system_prompt_text("none") is None
    with pytest.raises(ValueError, match="unknown system prompt"):
        pw.system_prompt_text("medium")


def test_interleaved_specs_alternate_prompts_over_the_same_questions():
    specs = pw.interleaved_specs(["long", "short"], 3, max_tokens=7)
    assert [s.tag for s in specs] == ["long", "short"] * 3
    assert all(s.max_tokens == 7 and s.temperature == 0.0 for s in specs)
    for a, b in zip(specs[::2], specs[1::2]):
        assert a.messages[-1] == b.messages[-1]           # same question
        assert a.messages[0]["content"] == system_prompts()["long"]
        assert b.messages[0]["content"] == system_prompts()["short"]
    assert specs[0].messages[-1] != specs[2].messages[-1]  # different questions
    none = pw.interleaved_specs(["none"], 1)
    assert [m["role"] for m in none[0].messages] == ["user"]
    with pytest.raises(ValueError):
        pw.interleaved_specs(["long"], 0)


@pytest.mark.parametrize("answer, expect, ok", [
    ("You can return it within 30 days.", ["30"], True),
    ("Our 2-Year Warranty covers it.", ["2-year", "two years"], True),
    ("Please see a DOCTOR.", ["doctor"], True),
    ("I cannot help with that.", ["lawyer", "attorney"], False),
    ("", ["x"], False),
    (None, ["x"], False),
])
def test_check_passed(answer, expect, ok):
    assert pw.check_passed(answer, expect) is ok


@pytest.mark.parametrize("tokens, block, blocks", [
    (10, 128, 0), (127, 128, 0), (128, 128, 1), (539, 128, 4), (175, 128, 1),
    (None, 128, None), (100, None, None), (100, 0, None)])
def test_prefix_blocks(tokens, block, blocks):
    assert pw.prefix_blocks(tokens, block) == blocks


class _Engine:
    def __init__(self, info=None, flags=None):
        self.info, self.flags = info or {}, flags or {}


def test_side_by_side():
    frame = pd.DataFrame([
        {"check": 1, "question": "q1", "system_prompt": "long", "answer": "a", "passed": True},
        {"check": 1, "question": "q1", "system_prompt": "short", "answer": "b", "passed": False},
        {"check": 2, "question": "q2", "system_prompt": "long", "answer": "c", "passed": False},
        {"check": 2, "question": "q2", "system_prompt": "short", "answer": "d", "passed": True},
    ])
    wide = pw.side_by_side(frame)
    assert list(wide.columns) == ["check", "question", "long: pass", "long: answer",
                                  "short: pass", "short: answer"]
    assert wide["long: pass"].tolist() == ["PASS", "fail"]
    assert wide["short: answer"].tolist() == ["b", "d"]


def test_summary_by_medians_and_tails_per_group():
    frame = pd.DataFrame({"g": ["a"] * 4 + ["b"] * 2, "ok": [True] * 5 + [False],
                          "ttft_ms": [1, 2, 3, 100, 10, 999], "e2e_ms": [5] * 6,
                          "prompt_tokens": [539] * 4 + [175] * 2,
                          "cached_tokens": [512] * 4 + [128] * 2})
    s = pw.summary_by(frame, ["g"])
    assert s.loc["a", "requests"] == 4 and s.loc["b", "requests"] == 1  # failed one dropped
    assert s.loc["a", "ttft_ms_median"] == 2.5
    assert s.loc["a", "ttft_ms_p90"] == pytest.approx(70.9)
    assert s.loc["b", "cached_tokens_median"] == 128


def test_where_first_request_time_goes_splits_client_ttft():
    req = pd.DataFrame({"arm": ["no warm-up"] * 3, "request": ["first", "later", "later"],
                        "ttft_ms": [300.0, 120.0, 140.0], "server_ttft_ms": [280.0, 110.0, 110.0],
                        "server_queue_ms": [1.0, 0.5, 0.5], "server_prefill_ms": [250.0, 100.0, 100.0],
                        "cached_tokens": [0, 0, 0]})
    out = pw.where_first_request_time_goes(req).loc["no warm-up"]
    assert out.loc["first", "http_and_stream_ms"] == 20.0
    assert out.loc["first", "frontend_ms"] == 29.0
    assert out.loc["later", "frontend_ms"] == 9.5
    assert out.loc["later", "http_and_stream_ms"] == 20.0  # median of 10 and 30
    assert out.loc["later", "client_ttft_ms"] == 130.0
    assert out.loc["later", "requests"] == 2
    assert pw.where_first_request_time_goes(pd.DataFrame()).empty


def test_ttft_by_order_pivots_positions_against_starts():
    req = pd.DataFrame({"start": [1, 1, 2, 2], "arm": ["a", "a", "b", "b"],
                        "order": [1, 2, 1, 2], "ttft_ms": [100.0, 50.0, 80.0, 60.0]})
    table = pw.ttft_by_order(req)
    assert table.loc[1, (1, "a")] == 100.0 and table.loc[2, (2, "b")] == 60.0
    assert pw.ttft_by_order(pd.DataFrame()).empty


class _Server:
    def __init__(self, log_path, startup_s=31.5):
        self.log_path, self.startup_s = log_path, startup_s


def test_startup_timeline_ends_with_the_health_check(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(LOG)
    engine = _Engine({"launched_at": "2024-11-30T13:58:40", "ready_at": "2024-11-30T13:59:12"})
    engine.server = _Server(log)
    timeline = pw.startup_timeline(engine)
    assert timeline.event.iloc[-1] == "healthy (GET /health answers 200)"
    assert timeline.since_launch_s.iloc[-1] == 32
    assert timeline.reported_s.iloc[-1] == 31.5
    assert timeline.set_index("event").loc["HTTP server listening", "since_launch_s"] == 31


def test_remote_or_missing_engines_give_empty_frames_and_a_note(tmp_path):
    from lab_utils.results import Results
    results = Results("t", tmp_path)
    remote = _Engine()
    remote.server = None
    frame = pw.first_requests(remote, 3, start=1, arm="no warm-up", results=results)
    assert frame.empty and "ttft_ms" in frame.columns
    assert "not a cold one" in results.data["notes"][0]
    assert pw.first_requests(None, 3, start=2, arm="x").empty
    assert pw.quality_checks(None).empty
    assert pw.warm_up(None, ["p"]).empty
    assert pw.startup_timeline(None).empty


def test_the_plan_is_cache_off_then_on():
    from lab_utils.profiles import load_profile
    plan = pw.plan(load_profile("cpu"), {"fresh_starts": 6}).check()
    off, on = plan.arms            # fresh starts restart the same arm: no more engines
    assert (off.name, dict(off.flags)) == (pw.CACHE_OFF, {"enable_prefix_caching": False})
    assert (on.name, dict(on.flags), on.knob) == (pw.CACHE_ON, {"enable_prefix_caching": True},
                                                  "enable_prefix_caching")


def _prompt_arm(state, ttft, e2e, prompt, cached, hits, queries):
    """Two questions, each with the long and the short prompt (values per prompt)."""
    rows = [{"prefix_caching": state, "system_prompt": name, "ttft_ms": ttft[name] + d,
             "e2e_ms": e2e[name] + d, "prompt_tokens": prompt[name], "cached_tokens": cached[name]}
            for d in (0.0, 10.0) for name in ("long", "short")]
    frame = pd.DataFrame(rows)
    frame.attrs["counters"] = {"prefix_cache_hits": hits, "prefix_cache_queries": queries}
    return frame


def _warmup_frames():
    starts = pd.DataFrame({
        "start": [0, 0, 1, 1, 1, 2, 2],
        "arm": ["no warm-up, cache off"] * 2 + ["no warm-up"] * 3 + ["warm-up routine"] * 2,
        "request": ["first", "later", "first", "later", "later", "first", "later"],
        "ttft_ms": [300.0, 100.0, 200.0, 90.0, 110.0, 95.0, 90.0],
        "server_ttft_ms": [280.0, 80.0, 170.0, 75.0, 75.0, 80.0, 75.0],
        "server_prefill_ms": [260.0, 70.0, 150.0, 65.0, 65.0, 70.0, 65.0],
        "cached_tokens": [0, 0, 0, 0, 0, 0, 0]})
    warm = pd.DataFrame({"kv_blocks": [0, 0, 0]})
    warm.attrs.update(block_size=128, counters={"prefix_cache_hits": 0.0})
    return starts, [warm], pd.DataFrame({"kv_blocks": [4, 1]})


def test_findings_of_hand_made_frames(tmp_path):
    from lab_utils.results import Results
    off = _prompt_arm("off", {"long": 600.0, "short": 200.0}, {"long": 1000.0, "short": 600.0},
                      {"long": 540, "short": 176}, {"long": 0, "short": 0}, 0.0, 0.0)
    on = _prompt_arm("on", {"long": 60.0, "short": 80.0}, {"long": 440.0, "short": 440.0},
                     {"long": 540, "short": 176}, {"long": 512, "short": 128}, 2560.0, 2864.0)
    quality = pd.DataFrame({"system_prompt": ["long", "short"] * 3,
                            "passed": [True, True, False, True, False, False]})
    starts, warmups, prefill_real = _warmup_frames()
    found = pw.findings(off, on, quality, starts, warmups, prefill_real)
    assert [f["technique"] for f in found] == [
        "shorter input (prefix cache off)", "shorter input (prefix cache off)",
        "shorter input (prefix cache on)", "shorter input (prefix cache on)",
        "shorter input: quality", "warm-up: cold start", "warm-up routine"]
    # medians of x and x + 10
    assert [(f["baseline"], f["treated"]) for f in found[:4]] == [
        (605.0, 205.0), (1005.0, 605.0), (65.0, 85.0), (445.0, 445.0)]
    assert found[0]["metric"] == "TTFT median (ms), 512- -> 148-token system prompt"
    assert found[1]["metric"] == "total latency median (ms), 512- -> 148-token system prompt"
    assert found[2]["mechanism"] == ("computed prompt tokens per request 28 -> 48; "
                                     "vllm:prefix_cache_hits 2560 of 2864 queried tokens")
    assert (found[4]["baseline"], found[4]["treated"]) == (1, 2)
    assert found[4]["metric"] == "quality checks passed (of 3), long -> short prompt"
    # cold: the starts without warm-up (0 and 1); first 300, 200 -> median 250; later 90..110
    cold = found[5]
    assert (cold["baseline"], cold["treated"]) == (250.0, 100.0)
    assert cold["mechanism"] == ("2 fresh starts; server-side prefill 205 -> 65 ms, frontend "
                                 "(template, tokenizer) 20 -> 10 ms")
    routine = found[6]
    assert (routine["baseline"], routine["treated"]) == (200.0, 95.0)
    assert routine["mechanism"].endswith("fill 0 whole 128-token KV blocks (prefix-cache hits "
                                         "0); the full system prompts fill [4, 1] (long, short)")
    table = Results("03_prompt_length_and_warmup", tmp_path).add_findings(found)
    assert table.change_pct[0] == pytest.approx(-400 / 605 * 100)


def test_findings_leave_out_what_did_not_run():
    empty = pd.DataFrame(columns=pw._PROMPT_COLUMNS)
    starts, warmups, prefill_real = _warmup_frames()
    found = pw.findings(empty, empty, pd.DataFrame(), starts[starts.start == 0], [],
                        pd.DataFrame())
    assert [f["technique"] for f in found] == ["warm-up: cold start"]
    assert pw.findings(empty, empty, pd.DataFrame(), pd.DataFrame(), [], pd.DataFrame()) == []


def test_on_a_remote_server_both_arms_run_and_cold_starts_are_skipped(tmp_path, remote):
    from lab_utils.notebook import setup
    ctx = setup("03_prompt_length_and_warmup", {"profile": "remote", "results_dir": str(tmp_path),
                                                "base_url": remote.base_url}, plan=pw.plan)
    results = ctx.results
    off = pw.prompt_length_arm(ctx, "cache off", 2, max_tokens=2, results=results,
                               progress=False)
    on = pw.prompt_length_arm(ctx, "cache on", 2, max_tokens=2, results=results, progress=False)
    # the emulated off arm is labelled off (its requests cannot hit), the other on
    assert set(off.prefix_caching) == {"off"} and set(on.prefix_caching) == {"on"}
    assert off.attrs["counters"]["prefix_cache_hits"] == 0
    requests, timelines, warmups = pw.cold_start_experiment(ctx, "cache on", 2, 1, ["p"],
                                                            results=results)
    assert requests.empty and timelines == [] and warmups == []
    assert "skipped_arms" not in results.data
    assert any("cold-start experiment skipped" in n for n in results.data["notes"])


def test_cold_starts_restart_the_same_arm_and_alternate_the_routine(monkeypatch):
    asked, closed = [], []
    engine = _Engine()
    engine.server = _Server("unused.log")
    from lab_utils.arms import Arm, Plan
    from lab_utils.profiles import ConfigError, load_profile
    ctx = SimpleNamespace(arm=lambda name: asked.append(name) or engine, name="03",
                          engines=SimpleNamespace(close=lambda: closed.append(1)),
                          plan=pw.plan(load_profile("cpu"), {}))
    monkeypatch.setattr(pw, "startup_timeline", lambda e: pd.DataFrame({"event": ["up"]}))
    monkeypatch.setattr(pw, "warm_up", lambda e, prefixes, **kw: pd.DataFrame({"kv_blocks": [0]}))
    monkeypatch.setattr(pw, "first_requests", lambda e, n, *, start, arm, results: pd.DataFrame(
        {"start": [start], "arm": [arm]}))
    requests, timelines, warmups = pw.cold_start_experiment(ctx, "cache on", 3, 1, ["p"])
    assert asked == ["cache on"] * 3 and len(closed) == 3     # a new process each time
    assert requests.arm.tolist() == ["no warm-up", "warm-up routine", "no warm-up"]
    assert len(timelines) == 3 and [w.start.iloc[0] for w in warmups] == [2]
    assert "launched_at" in engine.info and "ready_at" in engine.info
    ctx.plan = Plan("03", (Arm(pw.CACHE_ON, {"enable_prefix_caching": True}),))
    with pytest.raises(ConfigError, match="not declared fresh"):  # a broker could lend it
        pw.fresh_engine(ctx, pw.CACHE_ON)
    assert len(asked) == 3
