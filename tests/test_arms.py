"""lab_utils.arms: plans as data, checked without starting anything, and the
notebook context that starts only what the plan declares."""
from __future__ import annotations

import pytest

from lab_utils.arms import Arm, Plan, engine_key, knobs_between, run
from lab_utils.profiles import ConfigError, load_profile
from lab_utils.server import EnginePool, flags_label


def test_one_knob_arms_pass_and_the_plan_keeps_its_order():
    plan = Plan("nb", (Arm("off", {"enable_prefix_caching": False}),
                       Arm("on", {"enable_prefix_caching": True}, knob="enable_prefix_caching")))
    assert plan.problems() == []
    assert plan.baseline.name == "off" and plan.names == ["off", "on"]
    assert plan.reference_of("on").name == "off" and plan.reference_of("off") is None


def test_an_arm_that_changes_two_knobs_is_caught():
    plan = Plan("nb", (Arm("base"),
                       Arm("spec", {"speculative_config": {"method": "ngram"},
                                    "async_scheduling": False}, knob="speculative_config")))
    [problem] = plan.problems()
    assert "async_scheduling" in problem and "speculative_config" in problem


def test_a_knob_named_but_not_changed_is_caught():
    plan = Plan("nb", (Arm("a", {"max_num_seqs": 4}),
                       Arm("b", {"max_num_seqs": 4}, env={"X": "1"}, knob="max_num_seqs")))
    [problem] = plan.problems()
    assert "env:X" in problem


def test_role_env_and_declared_flag_groups_count_as_knobs():
    base = Arm("full", {"dtype": "bfloat16"})
    gptq = Arm("gptq", {"dtype": "bfloat16", "quantization": "gptq"}, role="gptq_int4",
               knob=("model_role", "quantization"))
    split = Arm("split", {"dtype": "bfloat16"}, env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
                knob="env:VLLM_CPU_OMP_THREADS_BIND")
    assert knobs_between(gptq, base) == {"model_role", "quantization"}
    assert Plan("nb", (base, gptq, split)).problems() == []


def test_duplicates_unknown_references_and_a_baseline_knob_are_caught():
    problems = Plan("nb", (Arm("a", knob="dtype"), Arm("b", reference="zz", knob="dtype"),
                           Arm("c"), Arm("c", {"dtype": "x"}, knob="dtype")),
                    together=(("a", "q"),)).problems()
    text = "\n".join(problems)
    assert "baseline arm 'a' names a knob" in text
    assert "reference 'zz'" in text
    assert "used twice" in text and "same engine" in text   # a and c: both the profile's flags
    assert "unknown arm 'q'" in text
    with pytest.raises(ConfigError, match="inconsistent"):
        Plan("nb", (Arm("a", knob="dtype"),)).check()


def test_engine_key_is_the_pools_label():
    # The pool keys engines by the same text, and a remote pool names the key
    # it needs in LAB_REMOTE_ARMS: the plan's key must be that text.
    assert engine_key() == "baseline" == flags_label({})
    a = Arm("x", {"max_num_seqs": 2, "speculative_config": {"k": 1}}, role="small",
            env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    remote = load_profile("remote", base_url="http://127.0.0.1:9")
    pool = EnginePool(remote)
    from lab_utils.server import ArmUnavailable
    with pytest.raises(ArmUnavailable) as err:
        pool.get(a.role, env=a.env, **a.flags)
    # the message's assignment, as a shell reads it, maps exactly the plan's key
    import json
    import shlex
    assignment = shlex.split(str(err.value).split("map it: ", 1)[1])[0]
    assert json.loads(assignment.split("=", 1)[1]) == {a.key: "http://HOST:PORT"}


def test_keep_follows_together():
    assert Plan("nb", (Arm("a"),)).keep == 1
    assert Plan("nb", (Arm("a"), Arm("b", role="small", knob="model_role")),
                together=(("a", "b"),)).keep == 2


class _Ctx:
    """What `run` needs of a NotebookContext: its plan and `arm`."""

    def __init__(self, plan, serve):
        self.plan, self.serve, self.asked = plan, serve, []

    def arm(self, a):
        self.asked.append(a.name)
        return f"engine:{a.name}" if a.name in self.serve else None


def test_run_measures_served_arms_in_order_and_skips_the_rest():
    plan = Plan("nb", (Arm("a"), Arm("b", {"dtype": "x"}, knob="dtype"),
                       Arm("c", {"dtype": "y"}, knob="dtype")))
    ctx = _Ctx(plan, serve={"a", "c"})
    got = run(ctx, ["c", "b", "a"], lambda arm, engine: (arm.name, engine))
    assert ctx.asked == ["c", "b", "a"]
    assert list(got) == ["c", "a"] and got["c"] == ("c", "engine:c")
    with pytest.raises(ConfigError, match="declares no arm 'd'"):
        run(ctx, ["d"], lambda arm, engine: None)


def test_context_refuses_an_engine_outside_the_plan_and_notes_skipped_arms(tmp_path, remote):
    from lab_utils.notebook import NotebookContext
    from lab_utils.results import Results
    plan = Plan("nb", (Arm("base"), Arm("fp8", {"kv_cache_dtype": "fp8"},
                                         knob="kv_cache_dtype")))
    results = Results("nb", tmp_path, "remote")
    ctx = NotebookContext("nb", remote, EnginePool(remote), results, {}, plan)
    with pytest.raises(ConfigError, match="does not declare"):
        ctx.engine(max_num_seqs=3)
    assert ctx.arm("fp8") is None       # the server runs kv_cache_dtype auto, and says so
    assert "kv_cache_dtype='auto'" in results.data["skipped_arms"]["fp8"]
    assert any("arm 'fp8' skipped" in n for n in results.data["notes"])
    assert ctx.arm("base") is not None


def test_arms_that_must_run_together_skip_the_notebook_naming_the_missing_one(tmp_path, remote):
    from lab_utils.errors import NotebookSkipped
    from lab_utils.notebook import NotebookContext
    from lab_utils.results import Results
    plan = Plan("nb", (Arm("base"), Arm("fp8", {"kv_cache_dtype": "fp8"},
                                         knob="kv_cache_dtype")), together=(("base", "fp8"),))
    ctx = NotebookContext("nb", remote, EnginePool(remote), Results("nb", tmp_path, "remote"),
                          {}, plan)
    with pytest.raises(NotebookSkipped, match=r"both arms; \['fp8'\] cannot run.*auto"):
        ctx.arms_together(plan.names, "nb needs both arms")
    assert list(ctx.arms_together(["base"], "nb needs base")) == ["base"]


def test_a_fresh_arm_is_never_asked_of_the_runs_broker(tmp_path, remote):
    """A `fresh` arm's engine starts in the notebook's own pool (shared off
    for that start only); any other arm may be lent by the run's broker."""
    from lab_utils.notebook import NotebookContext
    from lab_utils.results import Results
    seen = []

    class Pool(EnginePool):
        def get(self, *a, **k):
            seen.append(self.shared)
            return super().get(*a, **k)

    plan = Plan("nb", (Arm("base"), Arm("cold", {"max_num_seqs": 4}, knob="max_num_seqs",
                                         fresh=True)))
    ctx = NotebookContext("nb", remote, Pool(remote), Results("nb", tmp_path, "remote"), {}, plan)
    for name in ("base", "cold", "base"):
        ctx.arm(name)
    assert seen == [True, False, True]
    assert "a new engine of its own each time" in plan.describe().splitlines()[2]
