"""The streaming client: load shapes, request payloads, SSE framing, and
end-to-end runs against a local fake OpenAI server (no vLLM needed)."""
import asyncio
import itertools
import json
import math
import socket
import statistics
import time

import numpy as np
import pytest
from fake_openai import CHAT_FIRST_S, CHAT_GAP_S, CHAT_TOKENS, HOLD_S

from lab_utils.client import (
    Client,
    Load,
    RequestRecord,
    RequestSpec,
    Run,
)
from lab_utils.sse import pop_sse_data

MSG = [{"role": "user", "content": "hi"}]


# --------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------

def test_load_sequential():
    load = Load.sequential()
    assert (load.kind, load.concurrency) == ("sequential", 1)
    assert load.arrival_offsets(5) is None
    assert load.describe() == "sequential x1"
    assert Load() == load


def test_load_concurrent():
    load = Load.concurrent(4)
    assert (load.kind, load.concurrency) == ("concurrency", 4)
    assert load.arrival_offsets(10) is None
    assert load.describe() == "concurrency x4"


@pytest.mark.parametrize("n", [0, -1, 2.5, "3", None])
def test_load_concurrent_rejects_bad_n(n):
    with pytest.raises(ValueError, match="concurrency"):
        Load.concurrent(n)


@pytest.mark.parametrize("kw", [{"rate": 0}, {"rate": -1.0}, {"rate": math.nan},
                                {"rate": 2.0, "burstiness": 0},
                                {"rate": 2.0, "burstiness": -1.0}])
def test_load_poisson_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        Load.poisson(**kw)


def test_load_poisson_fields_and_describe():
    load = Load.poisson(4, burstiness=0.5, seed=7, max_concurrency=3)
    assert (load.kind, load.rate, load.burstiness, load.seed, load.concurrency) == \
        ("rate", 4.0, 0.5, 7, 3)
    assert load.describe() == "rate=4/s burstiness=0.5 seed=7"
    assert Load.poisson(2).concurrency == 0   # no cap


def test_poisson_offsets_seeded_and_reproducible():
    a = Load.poisson(5.0, seed=1).arrival_offsets(50)
    assert a == Load.poisson(5.0, seed=1).arrival_offsets(50)
    assert a != Load.poisson(5.0, seed=2).arrival_offsets(50)
    assert len(a) == 50
    assert a[0] == 0.0
    assert all(y >= x for x, y in itertools.pairwise(a))
    # a prefix of a longer schedule with the same seed starts the same way
    assert Load.poisson(5.0, seed=1).arrival_offsets(1) == [0.0]


def test_poisson_mean_gap_is_one_over_rate():
    offsets = np.asarray(Load.poisson(4.0, seed=3).arrival_offsets(20001))
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    # exponential gaps: coefficient of variation ~ 1
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_burstiness_below_one_is_burstier():
    n = 20001
    poisson = np.diff(Load.poisson(4.0, seed=3).arrival_offsets(n))
    bursty = np.diff(Load.poisson(4.0, burstiness=0.25, seed=3).arrival_offsets(n))
    # same mean rate, gamma shape 0.25 -> CV = 1 / sqrt(0.25) = 2
    assert bursty.mean() == pytest.approx(0.25, rel=0.06)
    cv_p, cv_b = poisson.std() / poisson.mean(), bursty.std() / bursty.mean()
    assert cv_b > 1.5 * cv_p
    assert cv_b == pytest.approx(2.0, rel=0.1)


def test_infinite_rate_sends_everything_at_once():
    assert Load.poisson(math.inf).arrival_offsets(4) == [0.0] * 4


def test_load_at():
    load = Load.at([0, 0.5, 1])
    assert load.kind == "offsets" and load.offsets == (0.0, 0.5, 1.0)
    assert load.arrival_offsets(3) == [0.0, 0.5, 1.0]
    assert load.arrival_offsets(2) == [0.0, 0.5]
    with pytest.raises(ValueError, match="3 offsets for 4 requests"):
        load.arrival_offsets(4)
    assert load.describe() == "offsets=[0.0, 0.5, 1.0]"


def test_poisson_offsets_for_zero_requests():
    assert Load.poisson(2.0).arrival_offsets(0) == []


# --------------------------------------------------------------------------
# RequestSpec
# --------------------------------------------------------------------------

def test_spec_needs_exactly_one_of_messages_or_prompt():
    with pytest.raises(ValueError, match="exactly one"):
        RequestSpec()
    with pytest.raises(ValueError, match="exactly one"):
        RequestSpec(messages=MSG, prompt="x")


@pytest.mark.parametrize("max_tokens", [0, -5, 1.5, "8", None])
def test_spec_max_tokens_must_be_positive_int(max_tokens):
    with pytest.raises(ValueError, match="max_tokens"):
        RequestSpec(prompt="x", max_tokens=max_tokens)


def test_chat_payload_exact():
    spec = RequestSpec(messages=MSG, max_tokens=16, tag="short")
    assert spec.api == "chat"
    assert spec.payload("m") == {
        "model": "m", "stream": True, "temperature": 0.0, "max_tokens": 16,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "messages": MSG}


def test_completions_payload_exact():
    spec = RequestSpec(prompt=[1, 2, 3], max_tokens=4)
    assert spec.api == "completions"
    assert spec.payload("m") == {
        "model": "m", "stream": True, "temperature": 0.0, "max_tokens": 4,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "prompt": [1, 2, 3]}


def test_payload_vllm_extensions_and_extra():
    body = RequestSpec(prompt="x", ignore_eos=True, priority=0,
                       extra={"temperature": 0.7, "top_p": 0.9}).payload("m")
    assert body["ignore_eos"] is True
    assert body["priority"] == 0          # 0 is a real priority, not "unset"
    assert body["temperature"] == 0.7     # extra overrides
    assert body["top_p"] == 0.9
    plain = RequestSpec(prompt="x").payload("m")
    assert "ignore_eos" not in plain and "priority" not in plain


# --------------------------------------------------------------------------
# SSE framing
# --------------------------------------------------------------------------

STREAM = (b'data: {"a": 1}\n\n'
          b'data: {"b": "\xc3\xa9\xf0\x9f\x98\x80"}\n\n'     # e-acute and an emoji (multibyte)
          b': keep-alive comment\n\n'
          b'data:{"c": 3}\n\n'
          b'data: [DONE]\n\n')
EXPECTED = ['{"a": 1}', '{"b": "\u00e9\U0001F600"}', '{"c": 3}', "[DONE]"]


def test_sse_several_events_in_one_chunk():
    buf = bytearray(STREAM)
    assert list(pop_sse_data(buf)) == EXPECTED
    assert buf == bytearray()


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 16])
def test_sse_events_split_across_chunks(size):
    buf, out = bytearray(), []
    for i in range(0, len(STREAM), size):
        buf += STREAM[i:i + size]
        out += list(pop_sse_data(buf))
    assert out == EXPECTED
    assert buf == bytearray()


def test_sse_split_exactly_between_the_two_newlines():
    buf = bytearray(b'data: {"a": 1}\n')
    assert list(pop_sse_data(buf)) == []
    assert buf == bytearray(b'data: {"a": 1}\n')     # incomplete event stays buffered
    buf += b'\ndata: {"b'
    assert list(pop_sse_data(buf)) == ['{"a": 1}']
    assert buf == bytearray(b'data: {"b')
    buf += b'": 2}\n\n'
    assert list(pop_sse_data(buf)) == ['{"b": 2}']


def test_sse_multiline_data_and_other_fields():
    buf = bytearray(b'event: message\nid: 7\ndata: line1\ndata: line2\n\n')
    assert list(pop_sse_data(buf)) == ["line1\nline2"]


def test_sse_cr_framing_and_one_leading_space_as_the_spec_says():
    # WHATWG: CR, LF and CRLF all end a line; only one space after "data:" goes.
    buf = bytearray(b'data:  two spaces\r\rdata:none\r\n\r\n: comment\n\n')
    assert list(pop_sse_data(buf)) == [" two spaces", "none"]


# --------------------------------------------------------------------------
# End to end against the fake server
# --------------------------------------------------------------------------



def _chat_specs(n, **kw):
    return [RequestSpec(messages=[{"role": "user", "content": f"q{i}"}], max_tokens=8,
                        tag="short", **kw) for i in range(n)]


def test_chat_stream_timing(fake):
    run = Client(fake.base_url, "chat").run(_chat_specs(1), label="arm", progress=False)
    assert isinstance(run, Run) and run.label == "arm" and run.load == "sequential x1"
    (rec,) = run.records
    assert rec.ok, rec.error
    assert (rec.status, rec.error, rec.index, rec.tag, rec.label) == (200, "", 0, "short", "arm")
    # TTFT: the role chunk, sent after 50 ms
    assert CHAT_FIRST_S - 0.002 <= rec.ttft <= CHAT_FIRST_S + 0.15
    # one ITL per later chunk, ~20 ms each
    assert len(rec.itl) == CHAT_TOKENS
    assert all(g >= 0 for g in rec.itl)
    assert CHAT_GAP_S * 0.5 <= statistics.median(rec.itl) <= CHAT_GAP_S + 0.06
    # E2E ends at the last token chunk: TTFT + the sum of the gaps
    assert rec.e2e == pytest.approx(rec.ttft + sum(rec.itl))
    assert CHAT_FIRST_S + CHAT_TOKENS * CHAT_GAP_S - 0.005 <= rec.e2e <= 1.0
    # tokens from usage; TPOT = (E2E - TTFT) / (5 - 1)
    assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == (CHAT_TOKENS, 12, 8)
    assert rec.tpot == pytest.approx((rec.e2e - rec.ttft) / (CHAT_TOKENS - 1))
    assert rec.tpot == pytest.approx(CHAT_TOKENS * CHAT_GAP_S / (CHAT_TOKENS - 1), abs=0.03)
    assert rec.chunk_tokens == [0, 1, 2, 3, 4, 5]
    assert len(rec.chunk_times) == CHAT_TOKENS + 1 and rec.chunk_times[0] == rec.ttft
    assert rec.text == "w1 w2 w3 w4 w5 " and rec.finish_reason == "length"
    assert rec.send_time == pytest.approx(time.time(), abs=30)
    summary = run.summary()
    assert summary["completed"] == 1 and summary["output_tokens"] == CHAT_TOKENS
    assert summary["ttft_ms_median"] == pytest.approx(rec.ttft * 1e3)
    assert len(run.frame()) == 1


def test_request_body_and_auth_header(fake):
    Client(fake.base_url + "/", "chat", api_key="k-123").run(
        _chat_specs(1, priority=3), progress=False)
    (req,) = fake.requests
    assert req["path"] == "/v1/chat/completions"
    assert req["authorization"] == "Bearer k-123"
    body = req["body"]
    assert body["model"] == "chat" and body["stream"] is True and body["max_tokens"] == 8
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["messages"] == [{"role": "user", "content": "q0"}]
    assert body["priority"] == 3
    fake.reset()
    Client(fake.base_url, "chat").run(_chat_specs(1), progress=False)
    assert fake.requests[0]["authorization"] is None


def test_completions_stream(fake):
    run = Client(fake.base_url, "text").run([RequestSpec(prompt="go", max_tokens=3)],
                                            progress=False)
    (rec,) = run.records
    assert fake.requests[0]["path"] == "/v1/completions"
    assert fake.requests[0]["body"]["prompt"] == "go"
    assert rec.ok and rec.text == "abc" and rec.finish_reason == "stop"
    assert (rec.output_tokens, rec.prompt_tokens, rec.cached_tokens) == (3, 4, None)
    assert len(rec.itl) == 2 and rec.chunk_tokens == [1, 2, 3]


def test_records_appended_to_jsonl_as_they_arrive(fake, tmp_path):
    path = tmp_path / "arm.jsonl"
    path.write_text('{"index": 99, "tag": "earlier run"}\n')    # append, never truncate
    seen = []
    fake.probe = lambda body: seen.append(len(path.read_text().splitlines()))
    run = Client(fake.base_url, "chat").run(_chat_specs(3), jsonl=path, progress=False)
    # when request i reached the server, the records of requests 0..i-1 were on disk
    assert seen == [1, 2, 3]
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    assert RequestRecord.from_json(json.loads(lines[0])) == RequestRecord(99, "earlier run")
    back = [RequestRecord.from_json(json.loads(line)) for line in lines[1:]]
    assert back == run.records
    assert [r.index for r in back] == [0, 1, 2]
    assert json.loads(lines[1])["tpot"] == pytest.approx(run.records[0].tpot)


def test_http_500_is_an_error_record(fake, tmp_path):
    path = tmp_path / "err.jsonl"
    run = Client(fake.base_url, "http500").run(_chat_specs(2), jsonl=path, progress=False)
    assert len(run.records) == 2
    for rec in run.records:
        assert not rec.ok and rec.status == 500
        assert rec.error.startswith("HTTP 500: ") and "engine dead" in rec.error
        assert rec.ttft is None and rec.e2e is None and rec.tpot is None
    assert len(path.read_text().splitlines()) == 2
    s = run.summary()
    assert (s["completed"], s["failed"]) == (0, 2)


def test_connection_refused_is_an_error_record():
    with socket.socket() as sock:      # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = Client(f"http://127.0.0.1:{port}", "m").run(_chat_specs(2), progress=False)
    assert [r.index for r in run.records] == [0, 1]
    for rec in run.records:
        assert not rec.ok and rec.status is None and rec.ttft is None
        assert "Connect" in rec.error, rec.error


def test_connection_cut_mid_stream_is_an_error_record(fake):
    (rec,) = Client(fake.base_url, "drop").run(_chat_specs(1), progress=False).records
    assert not rec.ok
    assert rec.error and "Payload" in rec.error, rec.error
    assert rec.ttft is not None and rec.e2e is None     # tokens came, but no complete answer
    assert rec.text == "x0x1"


def test_error_event_in_stream(fake):
    (rec,) = Client(fake.base_url, "stream_error").run(_chat_specs(1), progress=False).records
    assert not rec.ok and rec.status == 200
    assert rec.error.startswith("stream error:") and "engine overloaded" in rec.error


def test_stream_without_tokens(fake):
    (rec,) = Client(fake.base_url, "empty").run(_chat_specs(1), progress=False).records
    assert not rec.ok and rec.error == "the stream ended without a token chunk"


def test_client_timeout_is_an_error_record(fake):
    t0 = time.perf_counter()
    (rec,) = Client(fake.base_url, "slow", timeout_s=0.3).run(_chat_specs(1),
                                                              progress=False).records
    assert time.perf_counter() - t0 < 4
    assert not rec.ok and "Timeout" in rec.error


def test_concurrency_limit_is_respected(fake):
    t0 = time.perf_counter()
    run = Client(fake.base_url, "hold").run(_chat_specs(6), Load.concurrent(3), progress=False)
    wall = time.perf_counter() - t0
    assert all(r.ok for r in run.records) and len(run.records) == 6
    assert [r.index for r in run.records] == list(range(6))
    assert fake.max_in_flight == 3
    assert run.load == "concurrency x3"
    # two waves of HOLD_S, not six
    assert 2 * HOLD_S <= run.duration_s < 5 * HOLD_S
    assert run.duration_s <= wall


def test_rate_load_with_max_concurrency(fake):
    run = Client(fake.base_url, "hold").run(_chat_specs(4), Load.poisson(math.inf,
                                                                         max_concurrency=2),
                                            progress=False)
    assert all(r.ok for r in run.records)
    assert fake.max_in_flight == 2
    assert run.duration_s >= 2 * HOLD_S


def test_offsets_load_sends_on_schedule(fake):
    offsets = [0.0, 0.25, 0.5]
    run = Client(fake.base_url, "text").run([RequestSpec(prompt="x", max_tokens=3)] * 3,
                                            Load.at(offsets), progress=False)
    assert all(r.ok for r in run.records)
    starts = [r.start - run.records[0].start for r in run.records]
    for got, want in zip(starts, offsets, strict=True):
        assert want - 0.01 <= got <= want + 0.15
    assert run.duration_s >= 0.5


def test_empty_run():
    run = Client("http://127.0.0.1:9", "m").run([], progress=False)
    assert run.records == [] and run.duration_s >= 0


def test_run_inside_a_running_event_loop(fake):
    """Jupyter runs cells inside an event loop: Client.run must still block and work."""
    async def cell():
        return Client(fake.base_url, "text").run([RequestSpec(prompt="x")], progress=False)

    run = asyncio.run(cell())
    assert run.records[0].ok


def test_record_json_round_trip():
    rec = RequestRecord(3, "t", label="a", ttft=0.1, e2e=0.4, itl=[0.1, 0.2], output_tokens=3,
                        chunk_times=[0.1, 0.2, 0.4], chunk_tokens=[1, 2, 3], ok=True, status=200)
    d = rec.to_json()
    assert d["tpot"] == pytest.approx(0.15)
    assert RequestRecord.from_json(json.loads(json.dumps(d))) == rec
    assert RequestRecord.from_json({**d, "unknown_future_field": 1}) == rec
