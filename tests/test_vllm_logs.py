"""Reading vLLM's server logs: the latest start of a log file, its start-up
milestones and what it logged once serving, what it says about the weights
and kernels, and the root cause of a failure."""
import datetime as dt
import math

import pytest

from lab_utils.vllm_logs import (
    STARTUP_EVENTS,
    latest_start,
    log_after_startup,
    parse_server_log,
    root_cause,
    startup_events,
    startup_phases,
)

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


def test_startup_phases_split_a_start_at_vllms_milestones():
    # by hand from LOG's latest start, launched at 13:58:40.7 (stamps are whole seconds)
    got = startup_phases(LOG, dt.datetime(2024, 11, 30, 13, 58, 40, 700000))
    assert got == {"API server imports": 9.0,           # 13:58:40 -> 13:58:49
                   "engine core process start": 6.0,    # -> 13:58:55
                   "worker process start": 6.0,         # -> 13:59:01
                   "weights": pytest.approx(0.91),      # vLLM's own figure
                   "KV cache and init": pytest.approx(5.87),
                   "API server ready": 2.0}             # 13:59:09 -> 13:59:11
    # a start still under way has only the phases it reached
    partial = LOG.split("(Worker pid=5502)")[0]
    assert list(startup_phases(partial)) == ["API server imports", "engine core process start"]


def test_startup_events_of_an_empty_log():
    ev = startup_events("$ cmd\nnothing yet")
    assert ev.empty and "since_launch_s" in ev.columns


def test_log_after_startup_drops_polls_and_scrapes():
    lines = log_after_startup(LOG)
    assert lines == ['INFO:     127.0.0.1:45298 - "POST /v1/chat/completions HTTP/1.1" 200 OK']
    assert log_after_startup("$ cmd\nstill starting") == []


# A quantized start (W8A8 on vllm-cpu 0.32) after an older one.
QUANT_LOG = """$ vllm serve OLD
(Worker pid=1) INFO [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. Checkpoint size: 0.50 GiB. Available RAM: 1 GiB.
$ VLLM_CPU_KVCACHE_SPACE=2 vllm serve /m/w8a8 --port 2
(EngineCore pid=2) INFO 11-30 14:27:10 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m/w8a8', dtype=torch.float32, max_seq_len=4096, quantization=compressed-tensors, quantization_config=None, enforce_eager=True
[W1130 14:27:26 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation
\x1b[0;36m(Worker pid=3)\x1b[0;0m INFO 11-30 14:27:26 [__init__.py:846] Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8
(Worker pid=3) INFO 11-30 14:27:26 [__init__.py:923] Using CPUWNA16LinearKernel for mixed-precision linear
(Worker pid=3) INFO 11-30 14:27:26 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. Checkpoint size: 0.21 GiB. Available RAM: 19.35 GiB.
(Worker pid=3) INFO 11-30 14:27:27 [default_loader.py:501] Loading weights took 0.23 seconds
(EngineCore pid=2) INFO 11-30 14:27:29 [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, Maximum concurrency for 4,096 tokens per request: 11.38x
"""


def test_parse_server_log_reads_the_latest_start():
    info = parse_server_log(QUANT_LOG)
    assert info["checkpoint_gib"] == pytest.approx(0.21)
    assert info["loading_weights_s"] == pytest.approx(0.23)
    assert info["kv_cache_tokens"] == 46592
    assert info["quantization"] == "compressed-tensors" and info["dtype"] == "float32"
    assert info["kernels"] == ["CPUInt8ScaledMMLinearKernel (CompressedTensorsW8A8Int8)",
                               "CPUWNA16LinearKernel (mixed-precision)"]
    assert "model_loading_gib" not in info
    gpu = parse_server_log("Model loading took 5.32 GiB memory and 3.1 seconds\nquantization=None")
    assert gpu["model_loading_gib"] == pytest.approx(5.32) and gpu["quantization"] == "None"


def test_root_cause_skips_the_generic_wrapper():
    log = ("(APIServer pid=1) WARNING 11-30 [system_utils.py:255] Found ulimit of 20000 ... "
           "This can cause fd limit errors like `OSError: [Errno 24] Too many open files`.\n"
           "(EngineCore pid=1) ERROR [core.py:1] RuntimeError: Engine core initialization "
           "failed. See root "
           "cause above. Failed core proc(s): {}\n"
           "(Worker pid=2) ERROR 11-30 [multiproc_executor.py:953] ValueError: Marlin does not "
           "support weight_bits = uint8b128.\n"
           "(Worker pid=2) ERROR NotImplementedError: later\n")
    assert root_cause(log) == "ValueError: Marlin does not support weight_bits = uint8b128."
    assert root_cause("all fine\n") == ""
    assert root_cause('    raise NotImplementedError("x")\nNotImplementedError: "cpu_gemm_wna16" '
                        "not implemented for 'Float'\n").startswith("NotImplementedError: ")
