"""A compiled engine loads what an earlier start compiled (`lab_utils.compile_cache`):
vLLM's AOT file loads on the CPU, every config shares one Inductor cache, and
both caches live under the lab's cache folder."""
from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lab_utils as lab
from lab_utils import compile_cache
from lab_utils.compile_cache import COMPILE_CACHE_ENV

ROOT = Path(__file__).resolve().parents[1]


def test_local_engines_keep_their_compile_caches_under_the_labs_cache(cpu, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    for var in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    env = cpu.server_env()
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torchinductor")
    assert env[COMPILE_CACHE_ENV] == "1" and env["VLLM_USE_AOT_COMPILE"] == "0"
    # a user's own choice of folder wins
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/somewhere/else")
    assert "VLLM_CACHE_ROOT" not in cpu.server_env()
    # a GPU engine keeps vLLM's own folders: vLLM's own backend compiles there,
    # and a GPU plan's commands are for people to copy
    gpu = dataclasses.replace(cpu, device="cuda", cpu_binding={})
    assert not {"VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", COMPILE_CACHE_ENV} & set(
        gpu.server_env())


def test_the_folder_torch_writes_into_the_environment_is_torchs_default():
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    assert compile_cache.torch_default_inductor_dir() == default_cache_dir()


@pytest.mark.parametrize("own", ["", "/somewhere/inductor"])
def test_after_import_vllm_engines_still_compile_into_the_labs_cache(tmp_path, own):
    """`import vllm` sets TORCHINDUCTOR_CACHE_DIR to torch's default in
    os.environ (Inductor's `cache_dir()`): a process that imported it, e.g. a
    kernel or make test's pytest, must not take that for a user's choice. A
    user's own folder still wins."""
    code = ("import os, vllm, lab_utils as lab\n"
            "assert 'TORCHINDUCTOR_CACHE_DIR' in os.environ, 'vllm no longer sets it'\n"
            "print('dir=' + lab.load_profile('cpu').server_env().get('TORCHINDUCTOR_CACHE_DIR', ''))")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(LAB_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT),
               **({"TORCHINDUCTOR_CACHE_DIR": own} if own else {}))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "dir=" + ("" if own else
                                                           str(tmp_path / "torchinductor"))


def test_vllm_still_finalizes_what_it_loads_and_the_fix_gives_torchs_wrapper_the_method():
    # The fix exists because vLLM's loader calls this on torch's wrapper; if a
    # vLLM release stops doing so, this test says the fix can go.
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as B
    from vllm.compilation import decorators
    source = inspect.getsource(decorators)
    assert "compiled_fn.finalize_loading(" in source
    # vLLM's own backend's function has the method; torch's wrapper of Inductor's had not
    from vllm.compilation.caching import VllmSerializableFunction
    assert hasattr(VllmSerializableFunction, "finalize_loading")
    saved = B.__dict__.get("finalize_loading")
    try:
        if saved is not None:
            del B.finalize_loading
        wrapped = B.__new__(B)
        wrapped.compiled_fn = lambda *a: a          # what Inductor's loader returns: a function
        with pytest.raises(AttributeError, match="finalize_loading"):
            wrapped.finalize_loading(None)          # the failure vLLM 0.32 logs at every start
        assert compile_cache.fix_aot_load() is True
        assert compile_cache.fix_aot_load() is False   # once
        assert wrapped.finalize_loading(None) is None
    finally:
        if saved is not None:
            B.finalize_loading = saved


def test_every_config_loads_and_compiles_with_the_shared_inductor_cache(tmp_path, monkeypatch):
    from vllm.compilation import decorators
    seen = []

    def loader(model, path):
        # what the real loader and the compile after it read
        seen.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return None

    monkeypatch.setattr(decorators, "_try_load_aot_compiled_fn", loader)
    monkeypatch.setattr(compile_cache, "_ORIGINAL", {})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
    assert compile_cache.share_inductor_cache() is True
    assert compile_cache.share_inductor_cache() is False       # once per process
    # vLLM sets the config's own folder right before it tries to load (decorators.py)
    for config in ("aaa", "bbb"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / config / "inductor_cache")
        assert decorators._try_load_aot_compiled_fn(None, str(tmp_path / config / "model")) is None
    assert seen == [str(tmp_path / "shared")] * 2
    # and vLLM still sets its own folder where this hooks in
    source = inspect.getsource(decorators)
    assert source.index('os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache') < source.index(
        "loaded_fn = _try_load_aot_compiled_fn(self, aot_compilation_path)")


def test_the_launcher_patches_vllms_loader_only_once_a_process_imports_it(tmp_path):
    # An API server never imports vLLM's compile decorators (~2 s); the worker that
    # loads the model does, and finds the loader patched then. Run as
    # `lab_utils.vllm_cli` runs in `serve` and in each process it spawns.
    code = (
        "import sys, runpy\n"
        "sys.argv = ['vllm_cli']\n"
        "runpy.run_module('lab_utils.vllm_cli', run_name='__mp_main__')\n"
        "print('before', 'vllm.compilation.decorators' in sys.modules)\n"
        "from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as B\n"
        "print('finalize', 'finalize_loading' in B.__dict__)\n"
        "from vllm.compilation import decorators\n"
        "print('patched', decorators._try_load_aot_compiled_fn.__module__)\n")
    env = {**os.environ, COMPILE_CACHE_ENV: "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["before False", "finalize True",
                                          "patched lab_utils.compile_cache"], out.stdout
    # without the variable (e.g. `vllm_cli bench serve`) nothing is patched
    env.pop(COMPILE_CACHE_ENV)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert "patched vllm.compilation.decorators" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.engine
def test_a_compiled_engine_loads_what_its_first_start_compiled(cpu, tmp_path):
    # A 2-layer cut of the embedded model keeps the compile short. A fresh vLLM
    # cache: the first start compiles and saves, the second loads the file
    # (vLLM's own log line), answers alike, and says nothing of a load failure.
    # Inductor's cache stays the lab's, shared with every other engine.
    # The lab's engines compile without the AOT file (compile_cache.NO_AOT); a user
    # may turn it on, and this is what then loads.
    p = dataclasses.replace(cpu, models={**cpu.models, "small": "embedded-2L"})
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm"), "VLLM_USE_AOT_COMPILE": "1"}
    flags = dict(enforce_eager=False, max_model_len=512, kv_cache_memory_bytes=64 * 2**20)
    spec = lab.RequestSpec(prompt="The capital of France is", max_tokens=8, ignore_eos=True)
    texts, logs = [], []
    for start in ("first", "second"):
        with lab.EnginePool(p, log_dir=tmp_path / start) as pool:
            pool.shared = False
            engine = pool.get("small", env=env, **flags)
            run = lab.measure(engine, [spec], lab.Load.sequential(), label=start, progress=False)
            assert run.records[0].ok, run.records[0].error
            texts.append(run.records[0].text)
            logs.append(engine.server.log_path.read_text(errors="replace"))
    assert "saved AOT compiled function" in logs[0]
    assert "Directly load AOT compilation" in logs[1], [
        x for x in logs[1].splitlines() if "AOT" in x or "ompil" in x]
    assert "due to a load failure" not in logs[1]
    assert texts[0] == texts[1]
    # the config's own Inductor folder stayed empty: the shared one served both
    folders = list((tmp_path / "vllm").rglob("inductor_cache"))
    assert folders and all(not any(f.iterdir()) for f in folders)
