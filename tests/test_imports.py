"""The import graph of lab_utils: no cycles (imports inside functions
count too: a lazy import only hides a cycle), and experiment modules import
the shared package, never each other."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lab_utils

PACKAGE = Path(lab_utils.__file__).parent
EXPERIMENTS = "lab_utils.experiments"


def module_names() -> dict[str, Path]:
    """Every module of lab_utils by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("lab_utils", *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The lab_utils modules `name` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from . import plots` imports the module lab_utils.plots;
            # `from .server import Engine` imports lab_utils.server.
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import lab_utils.x.y` -> deepest known
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (first module repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_relative_and_lazy_imports():
    graph = import_graph()
    assert "lab_utils.results" in graph["lab_utils.experiments.baseline"]   # from ..results
    assert "lab_utils.arms" in graph["lab_utils.experiments.speculative_decoding"]  # from .. import arms
    assert "lab_utils.plots" in graph["lab_utils.figures"]                  # from .. import plots
    assert "lab_utils.smoke" in graph["lab_utils.notebook"]                 # inside a function
    assert "lab_utils.machine" in graph["lab_utils.server"]                 # inside a method
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_lab_utils_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_experiment_modules_import_only_the_shared_package():
    graph = import_graph()
    crossing = sorted(f"{name} -> {target}" for name, targets in graph.items()
                      if name.startswith(EXPERIMENTS + ".")
                      for target in targets if target.startswith(EXPERIMENTS + "."))
    assert not crossing, "experiment modules importing each other: " + ", ".join(crossing)


def test_the_setup_compiled_what_every_engine_process_imports():
    """`make setup` installs with pip's --no-compile and compiles site-packages
    itself, on every core: each of an engine's three processes must find the
    bytecode of vLLM, torch and transformers cached (PYTHONDONTWRITEBYTECODE may
    keep Python from writing it later, and compiling costs every start)."""
    import importlib.util
    import sys
    if not (Path(sys.prefix) / ".lab-installed").exists():
        pytest.skip("not the venv `make setup` built")
    files = []
    for package, module in (("vllm", "v1/engine/core.py"), ("vllm", "__init__.py"),
                            ("torch", "__init__.py"), ("torch", "_dynamo/utils.py"),
                            ("transformers", "__init__.py")):
        spec = importlib.util.find_spec(package)   # a top-level package: found, not imported
        assert spec is not None and spec.submodule_search_locations, package
        files.append(Path(spec.submodule_search_locations[0]) / module)
    missing = [str(f) for f in files
               if not Path(importlib.util.cache_from_source(str(f))).is_file()]
    assert not missing, f"no cached bytecode for {missing}: run `make setup` again"
