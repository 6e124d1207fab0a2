"""Reading vLLM's server logs: the latest start of a log file, its start-up
milestones and what it logged once serving."""
import datetime as dt
import math

import pytest

from lab_utils.vllm_logs import STARTUP_EVENTS, latest_start, log_after_startup, startup_events

# Lines as vLLM 0.32's CPU build writes them (ANSI colours included), after a
# first start whose lines must be ignored.
LOG = """$ vllm serve OLD --port 1
\x1b[0;36m(APIServer pid=1)\x1b[0;0m \x1b[32mINFO\x1b[0m \x1b[90m11-30 10:00:00\x1b[0m [api_utils.py:286] non-default args: {}
(EngineCore pid=2) INFO 11-30 10:00:09 [core.py:402] init engine (profile, create kv cache, warmup model) took 9.99 s
$ VLLM_CPU_KVCACHE_SPACE=2 vllm serve MODEL --port 2
Triton is installed, but doesn't include CPU backend. Disabling Triton.
\x1b[0;36m(APIServer pid=5478)\x1b[0;0m \x1b[32mINFO\x1b[0m \x1b[90m11-30 13:58:49\x1b[0m \x1b[90m[api_utils.py:286]\x1b[0m non-default args: {'model_tag': 'M'}
(EngineCore pid=5490) INFO 11-30 13:58:55 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='M'
(Worker pid=5502) INFO 11-30 13:59:01 [cpu_model_runner.py:68] Starting to load model M...
(Worker pid=5502) INFO 11-30 13:59:02 [default_loader.py:501] Loading weights took 0.91 seconds
(EngineCore pid=5490) INFO 11-30 13:59:04 [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, Maximum concurrency for 4,096 tokens per request: 11.38x
(EngineCore pid=5490) INFO 11-30 13:59:09 [core.py:402] init engine (profile, create kv cache, warmup model) took 5.87 s
(APIServer pid=5478) INFO 11-30 13:59:11 [hf.py:648] Detected the chat template content format to be 'string'.
(APIServer pid=5478) INFO 11-30 13:59:11 [entry.py:140] Starting vLLM server on http://127.0.0.1:2
INFO:     Started server process [5478]
INFO:     Application startup complete.
INFO:     127.0.0.1:52356 - "GET /health HTTP/1.1" 200 OK
INFO:     127.0.0.1:52372 - "GET /metrics HTTP/1.1" 200 OK
INFO:     127.0.0.1:45298 - "POST /v1/chat/completions HTTP/1.1" 200 OK
"""


def test_latest_start_keeps_only_the_last_start_without_colours():
    text = latest_start(LOG)
    assert text.startswith("$ VLLM_CPU_KVCACHE_SPACE=2")
    assert "OLD" not in text and "\x1b" not in text
    assert latest_start("no marker\nline") == "no marker\nline"


def test_startup_events_since_launch():
    launched = dt.datetime(2024, 11, 30, 13, 58, 40, 700000)
    ev = startup_events(LOG, launched).set_index("event")
    assert list(ev.index) == [e for e, _, _ in STARTUP_EVENTS]
    assert ev.loc["API server process logging", "since_launch_s"] == 9
    assert ev.loc["HTTP server listening", "since_launch_s"] == 31
    assert ev.loc["weights loaded", "reported_s"] == pytest.approx(0.91)
    assert ev.loc["engine ready (profile, KV cache, warm-up)", "reported_s"] == pytest.approx(5.87)
    assert math.isnan(ev.loc["KV cache allocated", "reported_s"])


def test_startup_events_without_launch_time_count_from_the_first_line():
    ev = startup_events(LOG).set_index("event")
    assert ev.loc["API server process logging", "since_launch_s"] == 0
    assert ev.loc["engine core process up", "since_launch_s"] == 6


def test_startup_events_of_an_empty_log():
    ev = startup_events("$ cmd\nnothing yet")
    assert ev.empty and "since_launch_s" in ev.columns


def test_log_after_startup_drops_polls_and_scrapes():
    lines = log_after_startup(LOG)
    assert lines == ['INFO:     127.0.0.1:45298 - "POST /v1/chat/completions HTTP/1.1" 200 OK']
    assert log_after_startup("$ cmd\nstill starting") == []
