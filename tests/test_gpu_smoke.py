"""benchmarks/gpu_smoke.py: the distinct engine configurations of the gpu
plan, against the plan checker's engines deduplicated by hand, and its
pass/fail reporting against a fake server (no GPU here, so no real start)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from lab_utils import facts
from lab_utils import plan as checker
from lab_utils.errors import ServerError
from lab_utils.profiles import load_profile
from lab_utils.server import Engine, EnginePool

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_smoke.py"
H100 = facts.device("h100-80gb")


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def params(tmp_path):
    """12_checklist reads its combined arm from findings: none here."""
    return {"findings_dir": str(tmp_path)}


def short(command: str, tokens: int = 2048) -> str:
    """A checker command at a short context: its --max-model-len replaced."""
    return re.sub(r"--max-model-len \d+", f"--max-model-len {tokens}", command)


def test_the_gpu_plans_distinct_configurations(smoke, params):
    """By hand, on the gpu profile with its parameter tables: the profile's
    flags alone (00, 07, 08, 10: 1), 01's off and three budgets (4), 02's
    cache off / on, which 03 shares (2), 04's baseline, n-gram and draft arms,
    all on vLLM's V1 model runner so none is the profile's own (3), 05's bf16
    baseline and four checkpoints (5), 06's two KV dtypes (2), 09's two
    policies (2), 11's two tiers with their shares (2), 12's baseline (1): 22."""
    gpu = load_profile("gpu")
    all_but_13 = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12"]
    configs, _ = smoke.configurations(gpu, H100, all_but_13, params)
    assert len(configs) == 22
    commands = [c.command for c in configs]
    assert len(set(commands)) == 22
    checks = checker.check_all(gpu, H100, params=params)
    assert {c.notebook for c in checks if c.plan is None} == set()
    expected = {short(e.command) for c in checks for e in c.engines}
    all_configs, _ = smoke.configurations(gpu, H100, None, params)
    assert {c.command for c in all_configs} == expected
    for c in all_configs:
        assert c.command.count("--max-model-len 2048") == 1, c.command
    used = [a for c in all_configs for a in c.arms]
    assert len(used) == sum(len(c.engines) for c in checks)     # every arm in one configuration
    [shared] = [c for c in all_configs if "03_prompt_length_and_warmup: cache on" in c.arms]
    assert shared.arms == ["02_prefix_caching: on", "03_prompt_length_and_warmup: cache on"]


def test_dry_run_prints_every_configuration_and_the_plan_problems(smoke, params, capsys,
                                                                  monkeypatch, tmp_path):
    import json
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = smoke.main(["--dry-run", "-p", "findings_dir", json.dumps(params["findings_dir"])])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    # The 22 above and 13's two replicas, each on its own GPU.
    assert "24 distinct engine configurations of profile 'gpu'" in out
    assert out.count("vllm serve ") == 24 and "PASS" not in out and "FAIL" not in out
    assert "PLAN PROBLEM" not in out
    assert "24 configurations: not started (--dry-run); 0 plan problems" in out
    code = smoke.main(["--dry-run", "--only", "00", "--max-model-len", "1024"])
    out = capsys.readouterr().out
    assert code == 0 and "--max-model-len 1024" in out and "0 plan problems" in out
    assert list(tmp_path.iterdir()) == []       # a dry run leaves no empty log folder


def test_one_request_decides_pass_or_fail(smoke, fake, monkeypatch, tmp_path):
    config = smoke.Configuration(None, {}, {}, "vllm serve m")
    engine = Engine(load_profile("remote", base_url=fake.base_url), {}, fake.base_url, "chat")
    monkeypatch.setattr(EnginePool, "get", lambda self, role=None, env=None, **f: engine)
    passed, what = smoke.smoke(load_profile("gpu"), config, tmp_path)
    assert passed and "answered" in what and len(fake.requests) == 1

    def refuse(self, role=None, env=None, **flags):
        raise ServerError("vLLM exited during start-up; log tail:\n"
                          "ValueError: max_num_batched_tokens (512) must be greater than or "
                          "equal to max_num_seqs (1024).")
    monkeypatch.setattr(EnginePool, "get", refuse)
    passed, what = smoke.smoke(load_profile("gpu"), config, tmp_path)
    assert not passed and "max_num_batched_tokens (512)" in what
