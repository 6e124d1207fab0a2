"""The decode floor of 00_baseline (`lab_utils.decode_floor`): arithmetic checked by
hand, the GPU floor against the datasheet figure, and why there is none where the
lab cannot know it."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

import lab_utils as lab
from lab_utils import cpu_tuning, decode_floor
from lab_utils.decode_floor import DecodeFloor


def tpot_frame(alone, batched=(100.0,)):
    return pd.DataFrame({"concurrency": [1] * len(alone) + [4] * len(batched),
                         "tpot_ms": [*alone, *batched]})


def test_the_table_and_the_finding_compare_single_stream_tpot_with_the_floor():
    # 1e9 bytes at 50 GB/s: 20 ms; the requests alone 30, 40, 50 ms (median 40: 2x)
    floor = DecodeFloor(weight_bytes=10**9, dtype="float32", bandwidth_gbs=50.0,
                        bandwidth_source="measured", threads=2, floor_ms=20.0,
                        linears_ms=25.0, linears_min_ms=24.0, aten_linears_ms=22.0,
                        linear_count=121)
    table = decode_floor.table(floor, tpot_frame([30.0, 40.0, 50.0]))
    assert table.loc["the same products alone, ATen's linear", "x floor"] == 1.1
    assert table.loc["floor: weights / read bandwidth", "ms"] == 20.0
    assert table.loc["the step's matrix products alone, vLLM's GEMM", "x floor"] == 1.25
    assert table.loc["single-stream TPOT, median", "ms"] == 40.0       # the batched 100 ms left out
    assert table.loc["single-stream TPOT, median", "x floor"] == 2.0
    assert table.loc["TPOT median beyond the matrix products", "ms"] == 15.0
    found = decode_floor.finding(floor, tpot_frame([30.0, 40.0, 50.0]))
    assert (found["baseline"], found["treated"]) == (20.0, 40.0)
    assert "2.00x the floor" in found["mechanism"] and "1.25x" in found["mechanism"]
    assert "through ATen's linear 22.0 ms = 1.10x" in found["mechanism"]
    results = lab.Results("00_baseline", "/tmp/lab-test-decode-floor")
    recorded = results.add_finding(**found)
    assert recorded["change_pct"] == 100.0 and recorded["decode_floor"]["threads"] == 2


def engine_on(profile_name, flags=None, server=object(), model_path=None):
    profile = lab.load_profile(profile_name)
    return lab.Engine(profile, dict(profile.engine, **(flags or {})), "http://x", "m",
                      model_path=model_path or profile.model, server=server)


def test_a_gpu_floor_is_the_datasheet_bandwidth_over_the_models_bytes(monkeypatch):
    # Qwen2.5-7B-Instruct: 7,615,616,512 bf16 parameters (its safetensors index), of
    # which its input embedding (not tied to the output head) 152,064 x 3,584: a step
    # reads one row of it; H100 SXM: 3.35 TB/s HBM3 (NVIDIA's datasheet)
    monkeypatch.setenv("LAB_GPU", "h100-80gb")
    floor = decode_floor.measure(engine_on("gpu"))
    read = (7_615_616_512 - 152_063 * 3_584) * 2
    assert floor.weight_bytes == read
    assert floor.floor_ms == pytest.approx(read / 3.35e12 * 1e3)                # 4.22 ms
    assert floor.linears_ms is None and "GPU" in floor.linears_why
    two = decode_floor.measure(engine_on("gpu", {"tensor_parallel_size": 2}))
    assert two.floor_ms == pytest.approx(floor.floor_ms / 2)                    # each rank reads half


def test_no_floor_where_the_lab_cannot_know_it_and_the_reason_names_the_fix(monkeypatch):
    monkeypatch.delenv("LAB_GPU", raising=False)
    unnamed = decode_floor.measure(engine_on("gpu"))
    assert unnamed.floor_ms is None and "LAB_GPU=" in unnamed.why
    remote = decode_floor.measure(engine_on("cpu", server=None))
    assert remote.floor_ms is None and "remote" in remote.why
    found = decode_floor.finding(remote, tpot_frame([30.0]))
    results = lab.Results("00_baseline", "/tmp/lab-test-decode-floor")
    assert results.add_finding(**found)["recorded"] is False
    assert "remote" in results.data["notes"][-1]


def test_the_floor_reads_the_bytes_of_the_dtype_the_engine_computes_in():
    # the embedded model's parameters held as bfloat16 are half the float32 bytes
    from lab_utils.facts import model_facts
    facts = model_facts("embedded")
    for spelling in ("bf16", "bfloat16"):
        engine = engine_on("cpu", {"dtype": spelling}, server=None)
        assert decode_floor._engine_dtype(engine) == "bfloat16"
    assert facts.weight_bytes("bfloat16") * 2 == facts.weight_bytes("float32")


def test_the_matrix_products_timer_refuses_a_quantized_dtype():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_tuning.decode_linears_ms([(4, 4)], 1, dtype="int8")


def test_the_figure_draws_each_figure_against_the_floor_and_nothing_without_one():
    from lab_utils.experiments import baseline
    floor = DecodeFloor(10**9, "float32", 50.0, "measured", 2, 20.0, 25.0, 24.0, 121)
    fig = baseline.plot_decode_floor(decode_floor.table(floor, tpot_frame([30.0, 40.0, 50.0])))
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time per decode step (ms)"
    assert [round(p.get_width(), 1) for p in ax.patches][::-1] == [20.0, 25.0, 40.0, 48.0, 15.0]
    none = dataclasses.replace(floor, floor_ms=None, why="a remote server")
    assert baseline.plot_decode_floor(decode_floor.table(none, tpot_frame([30.0]))) is None


def test_a_step_reads_the_bytes_of_the_checkpoint_it_serves_and_of_online_fp8():
    # the W8A8 checkpoint in float32 (INT8 projections, a float32 embedding tied to
    # the head): what a step reads is what its files hold, within their headers
    from lab_utils.quantize import quantized_model_dir
    w8a8 = engine_on("cpu", model_path=str(quantized_model_dir("w8a8")))
    if quantized_model_dir("w8a8").is_dir():
        on_disk = cpu_tuning.weight_bytes(quantized_model_dir("w8a8"))
        assert abs(decode_floor.step_weight_bytes(w8a8) - on_disk) < 0.01 * on_disk
    # online FP8 of the bfloat16 model: its projections one byte per weight, the rest two
    from lab_utils.facts import model_facts
    facts = model_facts("embedded")
    full = engine_on("cpu", {"dtype": "bfloat16"})
    fp8 = engine_on("cpu", {"dtype": "bfloat16", "quantization": "fp8_per_channel"})
    assert decode_floor.step_weight_bytes(full) == facts.num_parameters * 2
    assert decode_floor.step_weight_bytes(fp8) == (facts.num_parameters * 2
                                                   - facts.linear_parameters())
    # vLLM 0.32's online INT8 quantizes MoE experts only: a dense model's bytes stay
    moe_only = engine_on("cpu", {"dtype": "bfloat16", "quantization": "int8_per_channel_weight_only"})
    assert decode_floor.step_weight_bytes(moe_only) == facts.num_parameters * 2
