"""What an engine's weights take: bytes on disk, and vLLM's log and the
processes' memory of a running engine."""
from types import SimpleNamespace

from lab_utils.weight_memory import checkpoint_bytes, weight_memory


def test_checkpoint_bytes(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_bytes(tmp_path) == 10
    assert checkpoint_bytes(tmp_path / "missing") is None
    assert checkpoint_bytes("Qwen/Qwen2.5-7B-Instruct-AWQ") is None


def test_weight_memory_of_a_local_engine_reads_disk_log_and_kv_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 2**20)
    log = tmp_path / "vllm.log"
    log.write_text("$ vllm serve m\n(Worker pid=3) INFO Using CPUWNA16LinearKernel for "
                   "mixed-precision linear\nLoading weights took 0.23 seconds\n")
    engine = SimpleNamespace(model_path=str(tmp_path), model="m",
                             server=SimpleNamespace(log_path=log, proc=None),
                             info={"cache_config": {"num_gpu_blocks": "11", "block_size": "128"}})
    mem = weight_memory(engine)
    assert mem["model"] == str(tmp_path) and mem["checkpoint_mib"] == 1.0
    assert mem["kernels"] == ["CPUWNA16LinearKernel (mixed-precision)"]
    assert mem["loading_weights_s"] == 0.23
    assert mem["kv_cache_tokens"] == 11 * 128     # no KV line in the log: blocks x block size
    remote = weight_memory(SimpleNamespace(model_path=None, model="hub/m", server=None,
                                           info={}))
    assert remote == {"model": "hub/m", "checkpoint_mib": None}
