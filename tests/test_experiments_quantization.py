"""Pure logic of the 05 notebook: the arm catalogue, the claim verdicts, the
comparisons and findings, and the quantized-checkpoint builder's packing and
files (no server needed)."""
import json
import math

import pandas as pd
import pytest
import torch

from lab_utils import quantize as qz
from lab_utils.experiments import quantization as q
from lab_utils.profiles import ConfigError, load_profile

# ---------------------------------------------------------------- arms


def test_every_quantized_arm_has_a_reference_differing_in_the_weights_only():
    for a in q.ARMS.values():
        if not a.quantized:
            continue
        ref = q.ARMS[a.reference]
        assert not ref.quantized
        # the same dtype: the only knob is the checkpoint (or the online method)
        assert a.flags.get("dtype") == ref.flags.get("dtype"), a.name
        extra = set(a.flags) - set(ref.flags)
        assert extra <= {"quantization"}, a.name
        assert a.role or a.flags.get("quantization"), a.name


def test_with_references_puts_references_first_once():
    assert q.with_references(["int4_w4a16_bf16"]) == ["full_bf16", "int4_w4a16_bf16"]
    assert q.with_references(["int8_w8a8", "int8_w8a8_bf16", "awq_bf16"]) == [
        "full", "int8_w8a8", "full_bf16", "int8_w8a8_bf16", "awq_bf16"]
    assert q.with_references(["full", "full_bf16"]) == ["full", "full_bf16"]
    assert q.with_references(["full_bf16"]) == ["full_bf16"]
    with pytest.raises(ConfigError, match="unknown arm"):
        q.with_references(["int3"])


def test_cpu_roles_are_quantize_recipes_the_profile_names():
    cpu = load_profile("cpu")
    for a in q.ARMS.values():
        if a.role and a.name != "fp8_bf16":
            ref = q.role_reference(cpu, a.role)
            assert ref.startswith("quantized:") and ref.split(":", 1)[1] in qz.RECIPES, a.name
    assert q.role_reference(cpu, "fp8") is None
    assert q.role_reference(cpu, None) == "embedded"
    # the profile's role is the checkpoint the recipe builds, in the plan's command line
    from lab_utils.plan import build_engine
    e = build_engine(cpu, q.arm("int8_w8a8"), None)
    assert str(qz.quantized_model_dir("w8a8")) in e.command


def test_gpu_profile_names_real_checkpoints_for_the_shared_roles():
    gpu = load_profile("gpu")
    for role in ("awq", "gptq_int4", "gptq_int8", "fp8"):
        assert "/" in q.role_reference(gpu, role)
    table = q.arm_table(gpu, q.default_arms(gpu) + ["int8_w8a8"])
    assert table.loc["awq_bf16", "available"] and table.loc["fp8_bf16", "available"]
    assert not table.loc["int8_w8a8", "available"]     # no such role in gpu.toml (yet)
    assert table.loc["awq_bf16", "reference"] == "full_bf16"


def test_quantized_arms_are_optional_and_compared_with_their_reference():
    gpu = load_profile("gpu")
    p = q.plan(gpu, {})
    assert p.names == ["full_bf16", "awq_bf16", "gptq_int4_bf16", "gptq_int8_bf16", "fp8_bf16"]
    assert [a.optional for a in p.arms] == [False, True, True, True, True]
    assert p.arm("awq_bf16").reference == "full_bf16" and p.baseline.knob is None
    assert p.problems() == []
    # float32 asked for after bfloat16: the two dtypes compared the other way round
    cpu = load_profile("cpu")
    back = q.plan(cpu, {"arms": ["full_bf16", "full"]}, caps=_all_ok())
    assert back.names == ["full_bf16", "full"] and back.arm("full").reference == "full_bf16"


def _all_ok():
    from lab_utils import capabilities
    return capabilities.Capabilities({c: {"status": "ok"} for c in capabilities.CANDIDATES})


def test_remote_plan_measures_the_served_model_alone():
    """The remote profile names no quantized arm (a server with fixed flags):
    arm_table of nothing is empty (it raised KeyError), the plan is "full"."""
    remote = load_profile("remote", base_url="http://127.0.0.1:1")
    assert q.arm_table(remote, []).empty
    p = q.plan(remote, {})
    assert p.names == ["full"] and "measured alone" in p.notes[0]
    support = q.support_table(remote, p.names)
    assert support.loc["full", "on this device"].startswith("not probed on remote")


def test_support_off_the_cpu_is_the_facts_not_this_machines_probe(monkeypatch):
    """On cuda no CPU probe result is shown (the cache is never read): each
    arm says "not probed", beside the facts data's format and weights."""
    from lab_utils import capabilities
    monkeypatch.setattr(capabilities, "load_cache", lambda *a: pytest.fail("read the CPU cache"))
    gpu = load_profile("gpu")
    t = q.support_table(gpu, ["full_bf16", "awq_bf16", "int8_w8a8"])
    assert all(v.startswith("not probed on cuda") for v in t["on this device"])
    assert t.loc["awq_bf16", "checkpoint_format"] == "awq, 4-bit int"
    # bf16 Qwen2.5-7B: the checkpoint index's 15,231,233,024 bytes
    assert t.loc["full_bf16", "weights_gib_estimate"] == round(15_231_233_024 / 2**30, 2)
    assert pd.isna(t.loc["int8_w8a8", "model"])  # no such role on gpu: no estimate
    assert "not measured" in t.attrs["machine"] and "H100" in t.attrs["machine"]
    ckpt = q.prepare_checkpoints(gpu, ["awq_bf16", "fp8_bf16"])
    assert ckpt.loc["awq", "method"] == "awq" and ckpt.loc["awq", "bits"] == 4
    assert "not measured" in ckpt.loc["fp8", "source"]


def test_plan_skips_role_arms_on_remote():
    remote = load_profile("remote", base_url="http://127.0.0.1:1")
    table = q.arm_table(remote, ["int8_w8a8"])
    assert table.loc["full", "available"]
    assert not table.loc["int8_w8a8", "available"]


def test_claim_verdicts():
    assert "holds" in q.claim_verdict("int8", 0.5, step_speedup=2.1)
    assert "does not hold" in q.claim_verdict("int8", 0.5, step_speedup=1.2)
    assert "within" in q.claim_verdict("int4", 4.0, step_speedup=3.0)
    assert "above" in q.claim_verdict("int4", 9.0, step_speedup=3.0)
    v = q.claim_verdict("int8", 2.0, compute_speedup=1.3, step_speedup=8.0, tpot_speedup=0.8)
    assert v.startswith("decode compute speed-up 1.30x (wall clock: step 8.00x, TPOT 0.80x)")
    assert "does not hold" in v and "claimed loss < 1%: above" in v
    assert q.claim_verdict("int4", 2.0, step_speedup=1.0).startswith(
        "median decode step speed-up 1.00x")
    assert "claimed loss 3-5%" in q.claim_verdict("int4", 2.0, step_speedup=1.0)
    assert q.claim_verdict(None, 0.0, step_speedup=1.0) == "no claim"
    assert "2.50x fewer weight bytes per step" in q.claim_verdict("int8", 0.5, step_speedup=1.2,
                                                                  read_speedup=2.5)


# ---------------------------------------------------------------- quality


# ---------------------------------------------------------------- logs, tables

def _frames():
    lat = pd.DataFrame([{"arm": a, "ok": True, "ttft_ms": t, "tpot_ms": p}
                        for a, t, p in [("full", 200, 60), ("full", 220, 62),
                                        ("int8_w8a8", 150, 30), ("int8_w8a8", 170, 31)]])
    mem = pd.DataFrame([{"arm": "full", "checkpoint_mib": 513.0, "worker_rss_mib": 3000.0,
                         "kv_cache_tokens": 46592, "step_read_mib": 513.0},
                        {"arm": "int8_w8a8", "checkpoint_mib": 210.0, "worker_rss_mib": 2700.0,
                         "kv_cache_tokens": 46592, "step_read_mib": 205.2}])
    ppl = pd.DataFrame([{"arm": "full", "window": 0, "tokens": 10, "nll_sum": 20.0},
                        {"arm": "int8_w8a8", "window": 0, "tokens": 10, "nll_sum": 20.5}])
    answers = pd.DataFrame([{"arm": a, "id": i, "answer": t, "correct": c}
                            for a, i, t, c in [("full", "k1", "Paris", True),
                                               ("full", "k2", "Rome", True),
                                               ("int8_w8a8", "k1", "Paris", True),
                                               ("int8_w8a8", "k2", "Milan", False)]])
    itl = pd.DataFrame({"arm": ["full"] * 3 + ["int8_w8a8"] * 3, "itl_ms": [60, 61, 90, 30, 31, 80]})
    compute = pd.DataFrame([{"arm": "full", "prefill_cpu_ms": 200.0, "decode_cpu_ms": 30.0,
                             "cpu_share": 0.5},
                            {"arm": "int8_w8a8", "prefill_cpu_ms": 100.0, "decode_cpu_ms": 20.0,
                             "cpu_share": 0.8}])
    return {"latency": lat, "itl": itl, "memory": mem, "perplexity": ppl, "answers": answers,
            "compute": compute}


def test_summarize_and_compare():
    s = q.summarize(_frames())
    assert list(s.index) == ["full", "int8_w8a8"]
    assert s.loc["full", "tpot_ms_median"] == 61 and s.loc["int8_w8a8", "ttft_ms_median"] == 160
    assert s.loc["full", "perplexity"] == pytest.approx(math.exp(2.0))
    assert s.loc["int8_w8a8", "accuracy"] == 0.5
    assert s.loc["int8_w8a8", "identical_vs_full"] == 0.5
    c = q.compare(s)
    assert list(c.index) == ["int8_w8a8"]
    row = c.loc["int8_w8a8"]
    assert row.reference == "full" and row.claim == "int8"
    assert row.tpot_speedup == pytest.approx(61 / 30.5)
    assert row.itl_ms == 31 and row.step_speedup == pytest.approx(61 / 31)
    assert row.decode_cpu_speedup == pytest.approx(1.5) and row.prefill_cpu_speedup == 2.0
    assert row.ppl_change_pct == pytest.approx((math.exp(2.05) / math.exp(2.0) - 1) * 100)
    assert row.checkpoint_mib == 210 and row.identical_answers == 0.5
    assert row.read_speedup == pytest.approx(2.5)   # 513 / 205.2 MiB read per step


def test_findings(tmp_path):
    from lab_utils.results import Results
    frames = _frames()
    frames["memory"]["quantization"] = ["None", "compressed-tensors"]
    frames["memory"]["kernels"] = ["", "CPUInt8ScaledMMLinearKernel"]
    res = Results("05_test", tmp_path)
    table = res.add_findings(q.findings(q.compare(q.summarize(frames)), frames["memory"]))
    assert len(table) == 7
    assert set(table.metric) >= {"TPOT median (ms)", "perplexity of the fixed text",
                                 "decode compute: worker CPU ms per output token"}
    assert "CPUInt8ScaledMMLinearKernel" in table.mechanism.iloc[0]
    assert "per decode step 513 -> 205 MiB: a step bound by memory reads would be 2.50x faster" \
        in table.mechanism.iloc[0]
    saved = json.loads((tmp_path / "05_test.json").read_text())
    assert saved["findings"][0]["change_pct"] == pytest.approx((30.5 - 61) / 61 * 100)
    # The INT8 arm answers the checklist's quantization row, once per metric.
    tags = [f.get("checklist") for f in saved["findings"] if f.get("checklist")]
    assert tags == ["quantization:tpot", "quantization:ttft"]
    assert "W8A8" in saved["findings"][0]["reason"]
    assert "change_ci95" not in saved["findings"][0]  # no per-request samples given
    # the reference's worker computed half the time (0.5): that arm was held up
    compute = table[table.metric == "decode compute: worker CPU ms per output token"]
    assert "50% -> 80% (below 80%: other work" in compute.mechanism.iloc[0]


def test_the_share_note_says_what_the_shares_show():
    assert "other work" in q.share_note(0.95, 0.79)
    assert "had its cores" in q.share_note(0.95, 0.8)
    assert "had its cores" in q.share_note(1.0, math.nan)
    assert q.share_note(math.nan, None) == ""


def test_findings_with_latency_samples(tmp_path):
    from lab_utils.results import Results
    frames = _frames()
    res = Results("05_test", tmp_path)
    res.add_findings(q.findings(q.compare(q.summarize(frames)), frames["memory"],
                                latency=frames["latency"]))
    by_metric = {f["metric"]: f for f in res.data["findings"]}
    tpot, ttft = by_metric["TPOT median (ms)"], by_metric["TTFT median (ms)"]
    # every resample of 2 vs 2 requests is at least 48% faster: TPOT 60-62 -> 30-31 ms
    assert tpot["n_samples"] == [2, 2] and tpot["change_ci95"][1] < -45
    assert tpot["significant"] is True
    assert ttft["change_ci95"][0] <= ttft["change_pct"] <= ttft["change_ci95"][1]
    # the other metrics have no per-request samples
    assert "change_ci95" not in by_metric["perplexity of the fixed text"]


# ---------------------------------------------------------------- the builder


@pytest.mark.parametrize("bits, dim", [(4, 0), (4, 1), (8, 0), (8, 1)])
def test_pack_roundtrip(bits, dim):
    g = torch.Generator().manual_seed(bits + dim)
    v = torch.randint(0, 1 << bits, (16, 32), generator=g, dtype=torch.int32)
    packed = qz.pack_int32(v, bits, dim)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == v.shape[dim] * bits // 32
    assert torch.equal(qz.unpack_int32(packed, bits, dim), v)
    awq = qz.pack_int32(v, bits, dim, order=qz.AWQ_PACK_ORDER) if bits == 4 else packed
    if bits == 4:
        assert torch.equal(qz.unpack_int32(awq, bits, dim, order=qz.AWQ_PACK_ORDER), v)


def test_pack_puts_value_i_at_bits_4i_gptq_order():
    v = torch.arange(8, dtype=torch.int32).reshape(8, 1)        # 0..7 down the input dim
    assert qz.pack_int32(v, 4, 0).item() == 0x76543210
    row = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    # AWQ stores columns 0,2,4,6,1,3,5,7 in nibbles 0..7
    assert qz.pack_int32(row, 4, 1, order=qz.AWQ_PACK_ORDER).item() == 0x75316420
    with pytest.raises(qz.QuantizeError, match="range"):
        qz.pack_int32(torch.tensor([[16] * 8]), 4, 1)


def _vllm_awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's reading of AWQ qweight/qzeros ([K, N/8] -> [K, N]), as in
    `_convert_awq_to_standard_format` (quantization/auto_awq.py)."""
    reverse = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    k, n = packed.shape
    return ((packed.unsqueeze(-1) >> shifts) & 0xF)[:, :, reverse].reshape(k, n * 8)


@pytest.fixture(scope="module")
def weight():
    return torch.randn(96, 192, generator=torch.Generator().manual_seed(0))


def test_gptq_tensors_match_what_vllm_unpacks(weight):
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types
    for name, wtype, offset in (("gptq_w4", scalar_types.uint4b8, 8),
                                ("gptq_w8", scalar_types.uint8b128, 128)):
        r = qz.RECIPES[name]
        t = qz.gptq_tensors(weight, r)
        ints, scale, _ = qz.rtn_quantize(weight, qz.weight_args(r))
        assert t["qweight"].shape == (192 * r.bits // 32, 96)
        assert t["scales"].shape == (192 // r.group_size, 96) and t["scales"].dtype == torch.float16
        unpacked = unpack_quantized_values_into_int32(t["qweight"], wtype, 0)
        assert torch.equal(unpacked, (ints.to(torch.int32) + offset).t())
        deq = (unpacked.t().float() - offset) * scale.repeat_interleave(r.group_size, 1)
        assert (deq - weight).abs().max() <= scale.max() * 0.51 + 1e-6


def test_awq_tensors_match_what_vllm_unpacks(weight):
    r = qz.RECIPES["awq_w4"]
    t = qz.awq_tensors(weight, r)
    ints, _, zp = qz.rtn_quantize(weight, qz.weight_args(r))
    assert t["qweight"].shape == (192, 96 // 8) and t["qzeros"].shape == (192 // 64, 96 // 8)
    assert torch.equal(_vllm_awq_unpack(t["qweight"]), (ints.to(torch.int32) + 8).t())
    assert torch.equal(_vllm_awq_unpack(t["qzeros"]), (zp.to(torch.int32) + 8).t())


@pytest.mark.parametrize("name, max_rel_err", [("w8a8", 0.02), ("w8a16", 0.02),
                                               ("w4a16", 0.2), ("awq_w4", 0.2)])
def test_rtn_error_is_small(weight, name, max_rel_err):
    r = qz.RECIPES[name]
    ints, scale, zp = qz.rtn_quantize(weight, qz.weight_args(r))
    deq = qz.dequantize(ints, scale, zp, r.group_size)
    assert ((deq - weight).norm() / weight.norm()).item() < max_rel_err


def test_compressed_tensors_layout_and_config(weight):
    w8 = qz.compressed_tensors_tensors(weight, qz.RECIPES["w8a8"])
    assert w8["weight"].dtype == torch.int8 and w8["weight_scale"].shape == (96, 1)
    w4 = qz.compressed_tensors_tensors(weight, qz.RECIPES["w4a16"])
    assert set(w4) == {"weight_packed", "weight_scale", "weight_shape"}
    assert w4["weight_packed"].shape == (96, 192 // 8)
    assert w4["weight_scale"].dtype == torch.bfloat16
    cfg = qz.quantization_config(qz.RECIPES["w8a8"])
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    group = cfg["config_groups"]["group_0"]
    assert group["input_activations"]["dynamic"] and group["weights"]["strategy"] == "channel"
    assert qz.quantization_config(qz.RECIPES["gptq_w4"])["sym"] is True
    assert qz.quantization_config(qz.RECIPES["awq_w4"])["zero_point"] is True


def test_build_is_reproducible_and_marked(tmp_path, monkeypatch):
    """A tiny Llama-shaped source folder: build twice, same bytes, marker valid."""
    import safetensors.torch
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(1)
    state = {"model.embed_tokens.weight": torch.randn(50, 64, generator=g),
             "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
             "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128, generator=g),
             "model.layers.0.input_layernorm.weight": torch.ones(64),
             "model.norm.weight": torch.ones(64)}
    safetensors.torch.save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    (src / "tokenizer.json").write_text("{}")
    for name in ("w8a8", "gptq_w4"):
        out = qz.build(name, source=src, progress=False)
        assert out == qz.quantized_model_dir(name) and out.is_relative_to(tmp_path / "cache")
        assert qz.is_ready(name, out, src)
        info = qz.build_info(out)
        assert info["quantized_tensors"] == 2 and "round-to-nearest" in info["method"]
        first = info["weights_sha256"]
        qz.build(name, source=src, progress=False)
        assert qz.build_info(out)["weights_sha256"] == first          # deterministic
        assert (out / "tokenizer.json").exists() and not out.with_name(out.name + ".partial").exists()
        config = json.loads((out / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] in ("compressed-tensors", "gptq")
        assert config["dtype"] == qz.RECIPES[name].engine_dtype
        loaded = safetensors.torch.load_file(str(out / "model.safetensors"))
        assert loaded["model.embed_tokens.weight"].dtype == getattr(torch, config["dtype"])
    assert not qz.is_ready("w8a8", qz.quantized_model_dir("w8a8"), tmp_path)  # other source
    (qz.quantized_model_dir("w8a8") / "model.safetensors").write_bytes(b"truncated")
    assert not qz.is_ready("w8a8")
    with pytest.raises(qz.QuantizeError, match="unknown recipe"):
        qz.recipe("int3")


def test_quality_breakdown_on_a_tiny_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    windows = [[int(i) for i in torch.randint(0, 100, (20,))] for _ in range(2)]
    table = qz.quality_breakdown(tmp_path, windows)
    assert list(table.index) == list(qz.BREAKDOWN_CASES)
    assert table.change_pct.iloc[0] == 0
    assert (table.perplexity > 1).all() and table.perplexity.notna().all()
    # rounding changes the output (a little for INT8 weights, more for 4-bit)
    assert table.loc["INT8 weights only (per channel)", "change_pct"] != 0


def test_findings_without_cpu_clock_or_local_checkpoints(tmp_path):
    """GPU/remote-like data: hub ids (no checkpoint bytes), no worker CPU time."""
    from lab_utils.results import Results
    frames = _frames()
    frames["memory"]["checkpoint_mib"] = [None, None]
    frames["memory"]["worker_rss_mib"] = [None, None]
    frames.pop("compute")
    c = q.compare(q.summarize(frames))
    assert math.isnan(c.loc["int8_w8a8", "decode_cpu_speedup"])
    results = Results("05_gpu", tmp_path)
    table = results.add_findings(q.findings(c, frames["memory"]))
    # No checkpoint bytes for hub ids: that finding has no values and is noted, not recorded.
    assert len(table) == 4 and "checkpoint ? MiB" in table.mechanism.iloc[0]
    assert not table.metric.str.startswith("checkpoint size").any()
    assert any(n.startswith("not recorded: quantization") and "checkpoint size" in n
               for n in results.data["notes"])
    assert table.verdict.iloc[0].startswith("median decode step speed-up")


def test_hub_checkpoints_take_vllms_logged_sizes_and_weights(tmp_path):
    """A GPU run of hub checkpoints: no local files, so checkpoint size is
    vLLM's logged "Checkpoint size" (GiB -> MiB), and the weights' device
    memory ("Model loading took X GiB") is a finding of its own; the
    checklist's reason names the device and the kernel vLLM logged."""
    from lab_utils.results import Results
    from lab_utils.vllm_logs import parse_server_log
    log = ("Checkpoint size: 14.19 GiB\nModel loading took 14.25 GiB memory and 3.1 seconds\n")
    assert parse_server_log(log)["model_loading_gib"] == 14.25  # the parser the run uses
    frames = _frames()
    frames["memory"]["checkpoint_mib"] = [None, None]
    frames["memory"]["checkpoint_gib"] = [14.19, 8.11]
    frames["memory"]["model_loading_gib"] = [14.25, 8.2]
    frames["memory"]["kernels"] = ["", "CutlassFP8ScaledMMLinearKernel"]
    frames.pop("compute")
    s = q.summarize(frames)
    assert s.loc["full", "checkpoint_mib"] == pytest.approx(14.19 * 1024)
    c = q.compare(s)
    assert c.loc["int8_w8a8", "model_loading_gib_ref"] == 14.25
    results = Results("05_gpu", tmp_path)
    table = results.add_findings(q.findings(c, frames["memory"], device="cuda"))
    loaded = table[table.metric == "weight memory vLLM loaded (GiB)"].iloc[0]
    assert (loaded.baseline, loaded.treated) == (14.25, 8.2)
    reason = results.data["findings"][0]["reason"]
    assert "on cuda" in reason and "CutlassFP8ScaledMMLinearKernel" in reason
