"""One timed chat request, streamed and not, against the fake OpenAI server."""
import aiohttp
import pytest
from aiohttp import web
from fake_openai import CHAT_TOKENS, FakeOpenAI

from lab_utils.client import run_sync
from lab_utils.timed_chat import chat_session, request_body, timed_request


class JsonToo(FakeOpenAI):
    """The fake's chat stream, plus a non-streamed body with a Server-Timing header."""

    async def _chat(self, request, body):
        if body.get("stream"):
            return await super()._chat(request, body)
        return web.json_response(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c"}}],
             "usage": {"prompt_tokens": 12, "completion_tokens": 3,
                       "prompt_tokens_details": {"cached_tokens": 8}}},
            headers={"Server-Timing": "upstream;dur=12.5"})


@pytest.fixture(scope="module")
def upstream():
    fake = JsonToo().start()
    yield fake
    fake.stop()


def _timed(upstream, body):
    async def go():
        async with chat_session() as session:
            return await timed_request(session, upstream.base_url + "/v1/chat/completions",
                                       body, arm="a", index=3)
    return run_sync(go())


def test_request_body_streams_with_usage_per_chunk():
    body = request_body("m", [{"role": "user", "content": "hi"}], 7, True)
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 7
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "stream_options" not in request_body("m", [], 7, False)


def test_a_streamed_request_keeps_every_piece_with_its_arrival(upstream):
    t = _timed(upstream, request_body("chat", [{"role": "user", "content": "hi"}], 5, True))
    assert t.ok and t.status == 200 and (t.arm, t.index) == ("a", 3)
    assert t.text == "".join(f"w{i} " for i in range(1, CHAT_TOKENS + 1))
    assert t.times == sorted(t.times) and t.ttft_s == t.times[0] and t.e2e_s == t.times[-1]
    assert t.headers_s <= t.ttft_s
    record = t.record("a")
    assert record.ok and record.text == t.text and len(record.itl) == len(t.times) - 1


def test_a_whole_body_arrives_at_once(upstream):
    t = _timed(upstream, request_body("chat", [{"role": "user", "content": "hi"}], 3, False))
    assert t.ok and t.ttft_s == t.e2e_s and t.times == [t.e2e_s] and t.pieces == ["a b c"]
    assert (t.output_tokens, t.prompt_tokens, t.cached_tokens) == (3, 12, 8)
    assert t.app_timing == {"upstream_s": pytest.approx(0.0125)}
    assert t.record("a").itl == []


def test_http_errors_are_reported_not_raised(upstream):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await timed_request(session, upstream.base_url + "/v1/chat/completions",
                                       {"model": "http500", "messages": [], "stream": True})
    t = run_sync(go())
    assert not t.ok and t.status == 500 and "engine dead" in t.error
