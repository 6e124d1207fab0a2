"""Run a fix on a module of vLLM's right after Python first imports it.

The lab's engine launcher (`lab_utils.vllm_cli`) changes a few things inside
vLLM's processes (`compile_cache`, `cpu_kernels`); each waits for the module it
changes instead of importing it early: a process that never imports it (an
API server that loads no model) is spared the import.
`isa_shim/sitecustomize.py` has a hook of its own, kept apart: it runs in
every Python process of an engine and may import nothing of `lab_utils`.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once, right after `name` is first imported."""

    def __init__(self, name: str, then: Callable[[Any], Any]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        then = self.then

        def exec_module(module: Any) -> None:
            run(module)
            then(module)

        spec.loader.exec_module = exec_module   # this module's own loader instance
        return spec


def after_import(name: str, then: Callable[[Any], Any]) -> None:
    """`then(module)` at once if `name` is imported already, else right after
    its first import (once per `name` and `then`)."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name and f.then is then
                 for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))
