"""An eager CPU engine's RMSNorm and SiLU-and-mul run in vLLM's C kernels
(`lab_utils.cpu_kernels`, the profile's `[cpu_binding] c_kernels`): the kernels
compute what vLLM's PyTorch ops compute, vLLM's own IR dispatch picks them once
installed (and not where Inductor compiles), and torch's profiler sees them run.
Each check runs in a process of its own: installing changes vLLM's classes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lab_utils import cpu_kernels, cpu_tuning
from lab_utils.cpu_tuning import describe_env
from lab_utils.profiles import load_profile

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != cpu_kernels.C_KERNELS_ENV}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if line.startswith("|")]


SAME = r"""
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
import vllm.kernels  # noqa: F401  the IR implementations
from vllm.ir.op import IrOp
from vllm.model_executor.layers.activation import SiluAndMul
from lab_utils.cpu_kernels import c_silu_and_mul
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    x = torch.randn(5, 576, dtype=dtype)
    res = torch.randn(5, 576, dtype=dtype)
    w = torch.rand(576, dtype=dtype) + 0.5
    ref = IrOp.registry["rms_norm"].impls["native"].impl_fn(x, w, 1e-5)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-5)
    print("|rms_norm", dtype, torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol))
    ref_out, ref_res = IrOp.registry["fused_add_rms_norm"].impls["native"].impl_fn(x, res, w, 1e-5)
    xc, rc = x.clone(), res.clone()
    torch.ops._C.fused_add_rms_norm(xc, rc, w, 1e-5)   # in place: normed, residual
    print("|fused_add_rms_norm", dtype,
          torch.allclose(xc.float(), ref_out.float(), atol=tol, rtol=tol)
          and torch.allclose(rc.float(), ref_res.float(), atol=tol, rtol=tol))
    g = torch.randn(5, 2 * 1536, dtype=dtype)
    print("|silu_and_mul", dtype, torch.allclose(c_silu_and_mul(None, g).float(),
                                                 SiluAndMul.forward_native(g).float(),
                                                 atol=tol, rtol=tol))
"""


def test_the_c_kernels_compute_what_vllms_pytorch_ops_compute():
    # vLLM's native IR implementations and SiluAndMul.forward_native are the
    # reference: the PyTorch ops an eager CPU engine runs without the lab's change
    lines = _run(SAME)
    assert len(lines) == 6, lines
    assert all(line.endswith("True") for line in lines), lines


DISPATCH = r"""
import types, torch
from vllm.config import CompilationConfig
from vllm.platforms import current_platform
from lab_utils import cpu_kernels

def config(mode, backend="inductor"):
    return types.SimpleNamespace(compilation_config=CompilationConfig(mode=mode, backend=backend))

def ran(priority):
    # which kernels torch's profiler sees when vLLM's IR op runs under `priority`
    from vllm import ir
    from vllm.ir.op import IrOp
    x, res, w = torch.randn(3, 576), torch.randn(3, 576), torch.rand(576) + 0.5
    with IrOp.registry["fused_add_rms_norm"].set_priority(priority.fused_add_rms_norm), \
         IrOp.registry["rms_norm"].set_priority(priority.rms_norm), \
         torch.profiler.profile() as prof:
        ir.ops.rms_norm(x, w, 1e-5)
        ir.ops.fused_add_rms_norm(x, res, w, 1e-5)
    return sorted({e.key for e in prof.key_averages()
                   if e.key.startswith("_C::") or e.key in ("aten::rsqrt",)})

eager = config(0)
print("|before", current_platform.get_default_ir_op_priority(eager).rms_norm)
current_platform.import_ir_kernels()   # vllm_c registered, as vLLM does at start
# what vLLM does with a priority that names vllm_c, on the CPU, uninstalled
from vllm.config.kernel import IrOpPriorityConfig
print("|asked, uninstalled", ran(IrOpPriorityConfig.with_default(["vllm_c", "native"])))
cpu_kernels.install()
cpu_kernels.install()   # idempotent
for name, cfg in (("eager", eager), ("dynamo+eager backend", config(2, "eager")),
                  ("inductor", config(3))):
    p = current_platform.get_default_ir_op_priority(cfg)
    print("|" + name, p.rms_norm, p.fused_add_rms_norm, ran(p))
from vllm.model_executor.layers.activation import SiluAndMul
with torch.profiler.profile() as prof:
    SiluAndMul.forward_cpu(None, torch.randn(2, 64))
print("|silu", sorted(e.key for e in prof.key_averages() if e.key.startswith("_C::")))
"""


def test_installed_vllms_dispatch_runs_the_c_kernels_in_eager_engines_only():
    lines = _run(DISPATCH)
    assert lines[0] == "|before ['native']"
    # vLLM declares vllm_c unsupported on the CPU and skips it silently: a user's own
    # --kernel-config naming it would still run the PyTorch ops
    assert lines[1] == "|asked, uninstalled ['aten::rsqrt']"
    c_ops = "['_C::fused_add_rms_norm', '_C::rms_norm']"
    assert lines[2] == f"|eager ['vllm_c', 'native'] ['vllm_c', 'native'] {c_ops}", lines
    # Dynamo's trace run by torch's eager backend keeps vLLM's custom ops on, as eager
    assert lines[3] == (f"|dynamo+eager backend ['vllm_c', 'native'] ['vllm_c', 'native'] "
                        f"{c_ops}"), lines
    # where Inductor compiles, it fuses the PyTorch ops itself: left to vLLM
    assert lines[4] == "|inductor ['native'] ['native'] ['aten::rsqrt']", lines
    assert lines[5] == "|silu ['_C::silu_and_mul']", lines


def test_the_profile_asks_for_the_c_kernels_and_the_binding_carries_them():
    cpu = load_profile("cpu")
    assert cpu.cpu_binding.get("c_kernels") is True
    env = cpu.server_env()
    assert env[cpu_kernels.C_KERNELS_ENV] == "1"
    assert "+c-kernels" in describe_env(env).split()
    assert cpu_kernels.C_KERNELS_ENV not in cpu_tuning.binding_env("all")
