"""Experiments of 07_streaming: the perceived-latency measures (pure), and the
four arms timed against a fake upstream and the app (no vLLM needed)."""
import math

import pandas as pd
import pytest
from aiohttp import web
from fake_openai import CHAT_FIRST_S, CHAT_GAP_S, CHAT_TOKENS, FakeOpenAI

from lab_utils.app import AppServer
from lab_utils.experiments import streaming as st

# --------------------------------------------------------------------------
# Pure measures
# --------------------------------------------------------------------------

def test_first_content_skips_role_and_blank_chunks():
    assert st.first_content_time([0.1, 0.2, 0.3], ["", " ", "Hi"]) == 0.3
    assert st.first_content_time([0.1], [""]) is None


@pytest.mark.parametrize("pieces, expected", [
    (["The sky", " is blue", ". It", " is"], 3),          # ". " settles at the 3rd piece
    (["The sky is blue", ".", " Yes"], 3),                # "." at a chunk's end waits
    (["Pi is 3", ".", "14 and more"], None),              # "3.14" is not a sentence end
    (["1. ", "Paris is big", "! And"], 3),                # "1." has too few words
    (["Only three words."], 1),                           # the answer's end settles it
    (["no end at all"], None),
    (["东京是日本的首都。", "它很大"], None),               # one CJK "word" < 3 words
])
def test_first_sentence_time(pieces, expected):
    times = [float(i + 1) for i in range(len(pieces))]
    assert st.first_sentence_time(times, pieces) == expected


def test_word_arrival_times_count_complete_words_only():
    times = [1.0, 2.0, 3.0, 4.0]
    assert st.word_arrival_times(times, ["Hel", "lo wor", "ld", "!"]) == [2.0, 4.0]
    assert st.word_arrival_times([1.0, 2.0], ["a b ", "c"]) == [1.0, 1.0, 2.0]
    assert st.word_arrival_times([5.0], ["one two three"]) == [5.0] * 3   # a non-streamed body
    assert st.word_arrival_times([], []) == []


def test_max_unstalled_wpm():
    assert st.max_unstalled_wpm([0.0, 1.0, 2.0]) == pytest.approx(60.0)
    # A slow start limits the reader even if the rest is fast.
    assert st.max_unstalled_wpm([0.0, 2.0, 2.1, 2.2]) == pytest.approx(30.0)
    assert st.max_unstalled_wpm([3.0, 3.0, 3.0]) == math.inf
    assert st.max_unstalled_wpm([1.0]) == math.inf


def test_reader_waits_only_when_the_stream_is_behind():
    fast = [0.0, 0.1, 0.2, 0.3]                      # 600 words/min
    assert st.reader_times(fast, 60) == [0.0, 1.0, 2.0, 3.0]
    assert st.reading_schedule(fast, 60) == {"start_s": 0.0, "stall_s": 0.0, "done_s": 4.0}
    slow = [0.0, 2.0, 4.0]                           # 30 words/min, reader at 60
    assert st.reader_times(slow, 60) == [0.0, 2.0, 4.0]
    sched = st.reading_schedule(slow, 60)
    assert sched["stall_s"] == pytest.approx(2.0) and sched["done_s"] == pytest.approx(5.0)
    body = [3.0, 3.0]                                # non-streamed: all at once, late
    assert st.reading_schedule(body, 60) == {"start_s": 3.0, "stall_s": 0.0, "done_s": 5.0}
    with pytest.raises(ValueError):
        st.reader_times(fast, 0)


def test_perceived_reduction_by_length_and_threshold():
    # First content at 0.2 s, then one token each 0.1 s (several per chunk too).
    by = st.perceived_reduction_by_length([0.2, 0.3, 0.5], [1, 2, 4], 0.2)
    assert list(by.tokens) == [1, 2, 3, 4]
    assert list(by.non_stream_wait_ms.round(3)) == [200.0, 300.0, 500.0, 500.0]
    assert by.perceived_change_pct.iloc[0] == 0.0
    assert by.perceived_change_pct.iloc[-1] == pytest.approx(-60.0)
    assert st.tokens_for_reduction(by, -50.0) == 3
    assert st.tokens_for_reduction(by, -80.0) is None


def test_tokens_for_reduction_needs_it_to_stay_reached():
    by = pd.DataFrame({"tokens": [1, 2, 3, 4], "perceived_change_pct": [-10, -85, -70, -90]})
    assert st.tokens_for_reduction(by, -80) == 4


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


def test_timed_request_reports_http_errors(upstream):
    import aiohttp

    from lab_utils.client import run_sync

    async def go():
        async with aiohttp.ClientSession() as session:
            return await st.timed_request(session, upstream.base_url + "/v1/chat/completions",
                                          {"model": "http500", "messages": [], "stream": True})
    t = run_sync(go())
    assert not t.ok and t.status == 500 and "engine dead" in t.error
