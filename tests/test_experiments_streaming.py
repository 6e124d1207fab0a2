"""Experiments of 07_streaming: the four arms timed against a fake upstream
and the app, the framing demo, the plan and the findings (no vLLM needed)."""
import math

import pandas as pd
import pytest
from aiohttp import web
from fake_openai import CHAT_FIRST_S, CHAT_GAP_S, CHAT_TOKENS, FakeOpenAI

from lab_utils.app import AppServer
from lab_utils.experiments import streaming as st

def test_framing_demo_shows_the_article_snippet_dispatches_nothing():
    demo = st.framing_demo(["Hel", "lo"])
    assert demo.loc["article snippet", "events_dispatched"] == 0
    assert demo.loc["lab_utils.app /chat", "events_dispatched"] == 3   # 2 tokens + [DONE]


# --------------------------------------------------------------------------
# The arms against a fake upstream
# --------------------------------------------------------------------------

class JsonToo(FakeOpenAI):
    """The fake's chat stream, plus its non-streamed form."""

    async def _chat(self, request, body):
        if body.get("stream"):
            return await super()._chat(request, body)
        import asyncio
        await asyncio.sleep(CHAT_FIRST_S + CHAT_TOKENS * CHAT_GAP_S)
        return web.json_response({
            "choices": [{"index": 0, "message": {"role": "assistant",
                                                 "content": "w1 w2 w3 w4 w5 "}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": CHAT_TOKENS}})


class FakeEngine:
    api_key = None
    model = "chat"
    label = "fake"

    def __init__(self, url):
        self.base_url = url


@pytest.fixture(scope="module")
def upstream():
    fake = JsonToo().start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def app(upstream, tmp_path_factory):
    with AppServer(upstream.base_url, "chat",
                   log_path=tmp_path_factory.mktemp("app") / "app.log") as server:
        yield server


def test_compare_arms_measures_every_arm(upstream, app):
    result = st.compare_arms(FakeEngine(upstream.base_url), app, n_prompts=2, max_tokens=5,
                             progress=False, reading_wpm=600)
    frame = result.frame
    assert frame.ok.all(), frame.error.tolist()
    assert list(frame.groupby("arm").size()) == [2, 2, 2, 2]
    assert set(frame.arm) == {"direct/no-stream", "direct/stream", "app/no-stream", "app/stream"}
    streamed, whole = frame[frame.stream], frame[~frame.stream]
    # Streamed: the first content comes one gap after the role chunk (TTFT),
    # long before the end; non-streamed: everything at once.
    assert (streamed.first_content_ms > streamed.ttft_ms).all()
    assert (streamed.e2e_ms - streamed.first_content_ms > 3 * CHAT_GAP_S * 1e3 * 0.8).all()
    assert (whole.first_content_ms == whole.e2e_ms).all()
    assert (whole.ttft_ms == whole.e2e_ms).all()
    assert (frame.words == CHAT_TOKENS).all()
    assert (whole.max_unstalled_wpm == math.inf).all()
    # The app reports its own view of the upstream request.
    via_app = frame[frame.target == "app"]
    assert via_app.app_upstream_e2e_ms.notna().all()
    assert (via_app.app_upstream_e2e_ms <= via_app.e2e_ms).all()
    assert frame[frame.target == "direct"].app_upstream_e2e_ms.isna().all()
    # Records feed lab.plots / Results.
    recs = result.records("app/stream")
    assert len(recs) == 2 and all(r.ok and r.output_tokens == CHAT_TOKENS for r in recs)
    table = st.arm_table(frame)
    assert table.loc["direct/stream", "requests"] == 2
    claim = st.claim_check(frame)
    assert claim["perceived_change_pct"] < -30
    by_length = st.reduction_by_length(result.timed)
    assert set(by_length.arm) == {"direct/stream", "app/stream"}


def test_app_overhead_is_small_and_positive(upstream, app):
    frame = st.app_overhead(FakeEngine(upstream.base_url), app, n=6, max_tokens=5,
                            progress=False)
    assert len(frame) == 12 and frame.ok.all()
    via_app = frame[frame.target == "app"]
    assert (via_app.overhead_ttft_ms > 0).all()
    assert (via_app.overhead_ttft_ms < 100).all()
    summary = st.overhead_summary(frame)
    assert {"median", "p90", "p99"} <= set(summary.columns)


# --------------------------------------------------------------------------
# The plan and the findings
# --------------------------------------------------------------------------

def test_plan_is_the_one_baseline_engine():
    from lab_utils.profiles import load_profile
    plan = st.plan(load_profile("cpu"), {})
    assert plan.names == ["baseline"] and plan.problems() == []
    assert not plan.baseline.flags and plan.baseline.role is None


def _claim_frame():
    """Three requests per streamed/non-streamed arm direct to vLLM, plus rows
    findings must leave out: the app's, and a failed request."""
    rows = []
    def add(target, stream, first, e2e, server_e2e, server_ttft, ok=True):
        rows.append({"target": target, "stream": stream, "ok": ok, "first_content_ms": first,
                     "e2e_ms": e2e, "server_e2e_ms": server_e2e, "server_ttft_ms": server_ttft})
    for first, server_e2e, ttft in ((1000, 990, 80), (1200, 1195, 90), (1400, 1390, 100)):
        add("direct", False, first, first, server_e2e, ttft)       # delivery 10, 5, 10 ms
    for first, e2e, server_e2e, ttft in ((100, 1010, 1009, 85), (120, 1190, 1188, 95),
                                         (300, 1500, 1490, 105)):
        add("direct", True, first, e2e, server_e2e, ttft)          # delivery 1, 2, 10 ms
    add("app", True, 5, 5, 5, 5)
    add("direct", True, 1, 1, 1, 1, ok=False)
    return pd.DataFrame(rows)


def _overhead_frame():
    """Three requests through the app, 2, 3 and 4 ms over its upstream TTFT."""
    return pd.DataFrame({"target": ["app"] * 3 + ["direct"], "ok": True,
                         "ttft_ms": [100.0, 104.0, 110.0, 99.0],
                         "upstream_ttft_ms": [98.0, 101.0, 106.0, math.nan],
                         "overhead_ttft_ms": [2.0, 3.0, 4.0, math.nan],
                         "overhead_e2e_ms": [2.0, 3.0, 4.0, math.nan],
                         "app_before_upstream_ms": [0.5, 0.5, 0.5, math.nan]})


def test_findings_give_both_halves_of_the_claim_and_the_apps_costs(tmp_path):
    from lab_utils.results import Results
    claim = st.claim_check(_claim_frame(), "direct")
    overhead = st.overhead_summary(_overhead_frame())
    cut = {"max_tokens": 256, "generated_tokens": 9, "running_zero_after_ms": 61.4,
           "vllm_requests_finished": 0}
    found = st.findings(claim, overhead, cut, max_tokens=32)
    perceived, real, delivery, app, disconnect = found
    assert (perceived["baseline"], perceived["treated"]) == (1200, 120)
    assert perceived["checklist"] == "streaming:ttft"
    assert perceived["metric"] == ("first visible text, median (ms), 32-token answers, "
                                   "no-stream -> stream")
    assert "vLLM's own TTFT 90 ms (no-stream) vs 95 ms (stream)" in perceived["mechanism"]
    assert (real["baseline"], real["treated"]) == (1200, 1190)
    assert (delivery["baseline"], delivery["treated"]) == (10, 2)
    assert {f["article_claim"] for f in found[:3]} == {st.CLAIM}
    assert (app["baseline"], app["treated"]) == (101, 104)
    assert "app overhead on TTFT p50 3.0 ms, p99 4.0 ms" in app["mechanism"]
    assert (disconnect["baseline"], disconnect["treated"]) == (256, 9)
    assert "within 61 ms of the hang-up" in disconnect["mechanism"]
    assert "vllm:request_success +0" in disconnect["mechanism"]
    table = Results("07_streaming", tmp_path).add_findings(found)
    assert len(table) == 5
    assert table.change_pct.iloc[0] == pytest.approx(-90.0)


def test_reduction_note_names_the_length_the_cut_needs():
    by = pd.DataFrame({"tokens": [1, 2, 3, 4], "perceived_change_pct": [-10, -85, -70, -90]})
    assert st.reduction_note(by) == ("perceived -80% needs answers of >= 4 tokens "
                                     "(median over streamed requests)")
