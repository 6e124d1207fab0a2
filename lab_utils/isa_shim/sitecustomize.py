"""Makes a Python process see this CPU without AVX-512 and AMX, for engines
the lab starts with `LAB_CPU_ISA=avx2` (`lab_utils.cpu_tuning.isa_env`).

vLLM's CPU backend decides by `torch.cpu._is_avx512_supported()` and its kin
which kernel library it loads (`vllm._C_AVX2` on an AVX2-only CPU, without a
4-bit GEMM) and which paths it allows (FP8 KV cache: "requires x86 with
AVX-512 or AMX"). This module, found first on the engine's PYTHONPATH, wraps
the loader of `torch.cpu` so that those functions answer False once torch is
imported: nothing is imported here, and without `LAB_CPU_ISA=avx2` it does
nothing. torch's own kernels follow ATEN_CPU_CAPABILITY and oneDNN's
ONEDNN_MAX_CPU_ISA, which `isa_env` sets beside it.
"""
import os
import sys

_HIDDEN = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
           "_is_avx512_fp16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")


def _install() -> None:
    import importlib.abc
    import importlib.machinery

    class _Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "torch.cpu":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            inner = spec.loader.exec_module

            def exec_module(module, inner=inner):
                inner(module)
                for fn in _HIDDEN:
                    if hasattr(module, fn):
                        setattr(module, fn, lambda: False)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hide())


if os.environ.get("LAB_CPU_ISA", "").lower() == "avx2":
    _install()
