"""The one stream timer (`lab_utils.stream_timer`) on hand-built streams:
byte splits, CRLF framing, usage-only chunks, errors, comments, hang-ups."""
import json

import pytest

from lab_utils.stream_timer import StreamTimer, sampled_logprobs


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"


def chat_chunk(text, tokens=None, finish=None, logprobs=None):
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": text, "logprob": lp} for lp in logprobs]}
    out = {"choices": [choice]}
    if tokens is not None:
        out["usage"] = {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens}
    return out


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}


def test_times_text_and_usage_of_a_chat_stream_split_anywhere():
    body = (event(chat_chunk("Hel", 1)) + event(chat_chunk("lo", 2))
            + event(chat_chunk("!", 3, "length")) + event(USAGE) + b"data: [DONE]\r\n\r\n")
    cut1 = len(event(chat_chunk("Hel", 1))) + 5   # second event split mid-"data:"
    cut2 = len(body) - 20                          # usage chunk split before its end
    t = StreamTimer(start=10.0)
    for raw, now in ((body[:cut1], 10.1), (body[cut1:cut2], 10.3), (body[cut2:], 10.4)):
        assert t.feed(raw, now) is False
    assert t.times == pytest.approx([0.1, 0.3, 0.3])   # a chunk counts when its event ends
    assert t.ttft == pytest.approx(0.1) and t.e2e == pytest.approx(0.3)
    assert t.itl == pytest.approx([0.2, 0.0])
    assert t.text == "Hello!" and t.token_counts == [1, 2, 3]
    assert (t.prompt_tokens, t.output_tokens, t.cached_tokens) == (7, 3, 4)
    assert t.finish_reason == "length" and t.done
    assert t.close() == ""


def test_without_usage_the_token_count_is_the_chunk_ordinal():
    t = StreamTimer(start=0.0)
    t.feed(event(chat_chunk("a")) + event(chat_chunk("b")), 1.0)
    assert t.token_counts == [1, 2] and t.output_tokens is None


def test_completions_text_and_logprobs():
    chunk = {"choices": [{"index": 0, "text": " the", "finish_reason": None,
                          "logprobs": {"tokens": [" the"], "token_logprobs": [-0.25]}}]}
    t = StreamTimer(start=0.0, api="completions")
    t.feed(event(chunk), 0.5)
    assert t.text == " the" and t.logprobs == [-0.25]
    chat = StreamTimer(start=0.0)
    chat.feed(event(chat_chunk("x", logprobs=[-1.5, -0.5])), 0.5)
    assert chat.logprobs == [-1.5, -0.5]
    assert sampled_logprobs(None) == []
    assert sampled_logprobs({"token_logprobs": [None, -2.0]}) == [-2.0]


def test_an_error_chunk_is_kept_and_a_stream_without_tokens_is_an_error():
    t = StreamTimer(start=0.0)
    t.feed(event({"error": {"message": "boom", "code": 500}}), 0.2)
    assert t.close().startswith("stream error:") and "boom" in t.error
    empty = StreamTimer(start=0.0)
    empty.feed(event(USAGE) + b"data: [DONE]\n\n", 0.1)
    assert empty.close() == "the stream ended without a token chunk"
    assert empty.ttft is None and empty.cached_tokens == 4


def test_comments_are_kept_and_carry_no_token():
    t = StreamTimer(start=0.0)
    t.feed(b': lab-timing {"upstream_ttft_s": 0.05}\n\n' + event(chat_chunk("a")), 0.3)
    assert t.comments == [': lab-timing {"upstream_ttft_s": 0.05}'] and t.times == [0.3]


def test_stop_drops_the_rest_of_the_read():
    seen = []

    def stop(timer):
        seen.append(len(timer.times))
        return len(timer.times) >= 2
    t = StreamTimer(start=0.0)
    raw = event(chat_chunk("a", 1)) + event(chat_chunk("b", 2)) + event(chat_chunk("c", 3))
    assert t.feed(raw, 0.4, stop) is True
    assert seen == [1, 2] and t.text == "ab"


def test_stop_is_not_asked_after_the_finish():
    t = StreamTimer(start=0.0)
    assert t.feed(event(chat_chunk("a", 1, "stop")), 0.1, lambda _: True) is False


def test_a_whole_body_is_one_chunk():
    body = {"choices": [{"message": {"content": "Paris."}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
    t = StreamTimer(start=5.0)
    t.whole_body(body, 6.5)
    assert t.ttft == t.e2e == pytest.approx(1.5)
    assert (t.text, t.token_counts, t.prompt_tokens) == ("Paris.", [2], 9)
    bad = StreamTimer(start=0.0)
    bad.whole_body({"object": "error"}, 1.0)
    assert bad.close().startswith("a body without choices")


def test_a_chunk_that_is_not_json_raises():
    with pytest.raises(json.JSONDecodeError):
        StreamTimer(start=0.0).feed(b"data: {not json\n\n", 0.1)


def test_a_relay_sees_every_json_event_and_a_lenient_timer_skips_bad_ones():
    seen = []
    t = StreamTimer(start=0.0)
    raw = (event(chat_chunk("a", 1)) + b"data: {oops\n\n" + event(USAGE)
           + b"data: [DONE]\n\n")
    t.feed(raw, 0.2, each=lambda data, chunk: seen.append(json.loads(data) == chunk),
           strict=False)
    assert seen == [True, True] and t.bad_chunks == 1 and t.done
    assert t.times == [0.2] and t.output_tokens == 3
