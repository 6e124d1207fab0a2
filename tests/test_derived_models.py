"""Layer-truncated copies of a model: names, config, weights, idempotence, and
that the result computes exactly what the first N layers of the source do."""
import copy
import json

import pytest
import torch

from lab_utils import derived_models as dm


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 4-layer Llama saved like the embedded model (tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("src") / "Tiny-Model"
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text("{}")
    return folder, model


@pytest.mark.parametrize("name, new", [
    ("model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    ("model.layers.2.input_layernorm.weight", None),
    ("model.layers.29.mlp.down_proj.weight", None),
])
def test_rename_tensor_keeps_the_first_layers(name, new):
    assert dm.rename_tensor(name, [0, 1]) == new


def test_rename_tensor_renumbers_a_subset():
    assert dm.rename_tensor("model.layers.7.mlp.w", [3, 7]) == "model.layers.1.mlp.w"


@pytest.mark.parametrize("n", [0, -1, 5, 2.0, True])
def test_kept_layers_rejects_bad_counts(n):
    with pytest.raises(ValueError):
        dm.kept_layers(n, 4)


def test_truncated_config_cuts_per_layer_lists():
    cfg = {"num_hidden_layers": 4, "layer_types": ["a", "b", "c", "d"],
           "architectures": ["LlamaForCausalLM"], "hidden_size": 8}
    out = dm.truncated_config(cfg, 2)
    assert out["num_hidden_layers"] == 2 and out["layer_types"] == ["a", "b"]
    assert out["architectures"] == ["LlamaForCausalLM"] and out["hidden_size"] == 8
    assert cfg["num_hidden_layers"] == 4  # the source dict is untouched


def test_truncated_model_computes_the_first_layers(tiny_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    src, full = tiny_model
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    out = dm.truncated_model(2, source=src)
    assert out == tmp_path / "models" / "Tiny-Model-2L"
    assert dm.is_ready(out, 2) and not dm.is_ready(out, 3)
    marker = json.loads((out / dm.MARKER).read_text())
    assert marker["num_layers"] == 2 and marker["source_layers"] == 4
    assert (out / "tokenizer.json").is_file()
    assert not list(out.parent.glob("*.partial*"))
    cut = AutoModelForCausalLM.from_pretrained(out).eval()
    assert cut.config.num_hidden_layers == 2
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    ref = copy.deepcopy(full)
    ref.model.layers = ref.model.layers[:2]  # what the cut should compute
    ref.config.num_hidden_layers = 2
    with torch.no_grad():
        expected = ref(ids).logits
        got = cut(ids).logits
    torch.testing.assert_close(got, expected)


def test_truncated_model_is_built_once(tiny_model, tmp_path, monkeypatch):
    src, _ = tiny_model
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    first = dm.truncated_model(1, source=src)
    stamp = (first / dm.WEIGHTS).stat().st_mtime_ns
    calls = []
    monkeypatch.setattr(dm, "build_truncated", lambda *a: calls.append(a))
    assert dm.truncated_model(1, source=src) == first
    assert calls == [] and (first / dm.WEIGHTS).stat().st_mtime_ns == stamp


def test_a_broken_folder_is_rebuilt(tiny_model, tmp_path, monkeypatch):
    src, _ = tiny_model
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    out = dm.truncated_model_dir(3, src)
    out.mkdir(parents=True)
    (out / dm.WEIGHTS).write_bytes(b"half")  # an interrupted copy without a marker
    assert not dm.is_ready(out, 3)
    assert dm.truncated_model(3, source=src) == out
    assert dm.is_ready(out, 3)


def test_too_many_layers_leaves_nothing_behind(tiny_model, tmp_path, monkeypatch):
    src, _ = tiny_model
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="only 4 layers"):
        dm.truncated_model(9, source=src)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
