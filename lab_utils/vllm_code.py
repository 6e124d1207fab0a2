"""Show the installed vLLM's own source where a notebook explains a mechanism,
so that the text quoted is the code that runs here (read as text: vLLM is not
imported, and another vLLM version shows its own lines or says it differs)."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def vllm_source(relpath: str, marker: str, lines: int = 12) -> str:
    """`lines` numbered lines of the installed vLLM's `relpath` (relative to the
    `vllm` package) from the first line containing `marker`, under a header
    naming the version and file; a note when vLLM or the line is not there."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return f"(vLLM is not installed in this environment: cannot show vllm/{relpath})"
    path = Path(list(spec.submodule_search_locations)[0]) / relpath
    try:
        text = path.read_text().splitlines()
    except OSError:
        return f"(no file vllm/{relpath} in the installed vLLM: the installed version differs)"
    at = next((i for i, line in enumerate(text) if marker in line), None)
    if at is None:
        return f"(no line containing {marker!r} in vllm/{relpath}: the installed version differs)"
    from .profiles import ConfigError, vllm_version
    try:
        version = f" {vllm_version()}"
    except ConfigError:
        version = ""
    body = "\n".join(f"{at + 1 + k:5d}  {line}" for k, line in enumerate(text[at:at + lines]))
    return f"# vllm{version}: vllm/{relpath}\n{body}"


__all__ = ["vllm_source"]
