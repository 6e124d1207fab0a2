"""`make test`'s two streams (tests/streams.py): every notebook runs in exactly
one, the second stream's notebooks plan no engine the first could have lent
them, and the driver shows both streams' lines and fails when either fails."""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import streams

from lab_utils.paths import NOTEBOOKS_DIR
from lab_utils.profiles import load_profile
from lab_utils.engine_lease import config_key
from lab_utils.runall import planned_keys, run_params


def test_every_notebook_runs_in_exactly_one_stream():
    on_disk = sorted(p.name for p in NOTEBOOKS_DIR.glob("[0-9]*.ipynb"))
    assert set(streams.SECOND) <= {n.removesuffix(".ipynb") for n in on_disk}, \
        "a name in streams.SECOND is not a notebook"
    listed = [p.rsplit("/", 1)[-1] for paths in streams.streams().values()
              for p in paths if p.endswith(".ipynb")]
    assert sorted(listed) == on_disk
    assert "tests" in streams.streams()["tests"]
    assert (NOTEBOOKS_DIR.parent / streams.ALONE).is_file(), "the test run alone was renamed"
    assert streams.FINDINGS in streams.streams()["notebooks"]


def test_every_test_file_runs_in_exactly_one_stream():
    plan = streams.streams()
    tests_dir = NOTEBOOKS_DIR.parent / "tests"
    for moved in streams.FIRST:
        assert (NOTEBOOKS_DIR.parent / moved).is_file(), f"{moved} was renamed"
        assert moved in plan["notebooks"] and f"--ignore={moved}" in plan["tests"]
    ignored = {a.removeprefix("--ignore=") for a in plan["tests"] if a.startswith("--ignore=")}
    assert ignored == {*streams.FIRST, streams.ALONE}
    assert {str(p.relative_to(NOTEBOOKS_DIR.parent)) for p in tests_dir.glob("test_*.py")} \
        >= ignored


def test_the_second_streams_notebooks_plan_no_engine_the_first_stream_starts(tmp_path):
    cpu = load_profile("cpu")
    paths = sorted(NOTEBOOKS_DIR.glob("[0-9]*.ipynb"))
    demand = dict(planned_keys(paths, cpu, {p.stem: run_params(cpu, p, smoke=True,
                                                               results_dir=str(tmp_path))
                                            for p in paths}))
    first = {k for name, keys in demand.items() if name not in streams.SECOND for k in keys}
    for name in streams.SECOND:
        assert demand[name], f"{name}: no plan derived, so nothing can be checked"
        shared = set(demand[name]) & first
        assert not shared, (f"{name} plans an engine a notebook of the other stream starts "
                            f"too (it would be started twice): {sorted(shared)}")


@pytest.mark.parametrize("codes, status", [
    ([0, 0], 0), ([1, 0], 1), ([0, 2], 2), ([5, 0], 0), ([0, 5], 0), ([5, 5], 5),
    ([5, 1], 1), ([130, 1], 130),
])
def test_exit_status(codes, status):
    assert streams.exit_status(codes) == status


def test_the_driver_shows_both_streams_and_fails_when_one_fails(tmp_path, capfd):
    (tmp_path / "test_good.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "test_bad.py").write_text("def test_no():\n    assert 1 == 2\n")
    plan = {"one": [str(tmp_path / "test_good.py")], "two": [str(tmp_path / "test_bad.py")]}
    (tmp_path / "test_last.py").write_text("def test_last():\n    assert True\n")
    status = streams.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
                          plan=plan, then={"last": [str(tmp_path / "test_last.py")]})
    out = capfd.readouterr().out
    assert status == 1
    assert "[one] 1 passed" in out and "[two] 1 failed" in out, out
    assert "stream two: exit status 1" in out and "stream one: exit status 0" in out
    assert "[last] 1 passed" in out, "the phase after the streams did not run"


def test_the_run_ends_with_each_failing_streams_first_failure_not_its_later_ones(tmp_path,
                                                                               capfd):
    """nbval's own report of a notebook whose engine did not start, then a
    cell that used what the failed one never defined: the last lines name the
    first (its exception and the root cause in the log tail), as a plain
    test's `E` lines. CI shows only the end of the output."""
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_code_cell(
                    "class ServerError(RuntimeError):\n    pass\n"
                    "raise ServerError('vLLM exited with code 1 while starting.\\n"
                    "command: vllm serve m\\nlog: /tmp/m.log\\n--- last lines ---\\n"
                    "(EngineCore pid=7) ERROR 12-05 10:00:00 [core.py:9] "
                    "ValueError: no room for the KV cache')"),
                nbformat.v4.new_code_cell("runs")]
    nbformat.write(nb, tmp_path / "broken.ipynb")
    (tmp_path / "test_bad.py").write_text("def test_no():\n    assert 1 == 2\n")
    plan = {"nb": [str(tmp_path / "broken.ipynb")], "py": [str(tmp_path / "test_bad.py")]}
    status = streams.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "--nbval-lax", "--nbval-current-env"], plan=plan, then={})
    out = capfd.readouterr().out
    assert status == 1
    tail = out[out.index("stream nb: exit status"):]
    nb_digest = tail[tail.index("first failure in stream nb:"):tail.index("first failure in stream py:")]
    assert "broken.ipynb::Cell 1" in nb_digest, tail
    assert "ServerError: vLLM exited with code 1 while starting." in nb_digest, tail
    assert "root cause in its log: ValueError: no room for the KV cache" in nb_digest, tail
    assert "NameError" not in nb_digest, tail
    py_digest = tail[tail.index("first failure in stream py:"):]
    assert "test_no" in py_digest and "assert 1 == 2" in py_digest, tail


def test_cpu_shares(monkeypatch):
    monkeypatch.delenv("LAB_TEST_PIN", raising=False)
    assert streams.cpu_shares(2, [1, 0]) == [[0], [1]]
    assert streams.cpu_shares(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert streams.cpu_shares(2, [5]) is None        # one CPU: both streams share it
    assert streams.cpu_shares(1, [0, 1]) is None     # a phase of one (the browser test)
    monkeypatch.setenv("LAB_TEST_PIN", "0")
    assert streams.cpu_shares(2, [0, 1]) is None


@pytest.fixture
def every_cpu():
    """This process on every CPU it may use (within `make test` it runs pinned to
    its stream's share), and back on its own afterwards."""
    own = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    if len(os.sched_getaffinity(0)) < 2:
        os.sched_setaffinity(0, own)
        pytest.skip("pinning needs 2 CPUs")
    yield
    os.sched_setaffinity(0, own)


def test_each_stream_runs_on_its_own_cpus_and_the_one_after_on_the_first_freed(
        tmp_path, monkeypatch, every_cpu):
    """`last` starts while `two` still runs, on the CPUs `one` left: `two` ends
    only once `last` has written its CPUs (waiting for every stream first would
    never end: the test times out)."""
    monkeypatch.delenv("LAB_TEST_PIN", raising=False)
    probe = ("import json, os, time\ndef test_cpus():\n"
             "    open({out!r}, 'w').write(json.dumps(sorted(os.sched_getaffinity(0))))\n")
    waits = ("    deadline = time.monotonic() + 60\n"
             "    while not os.path.exists({marker!r}):\n"
             "        assert time.monotonic() < deadline, 'last did not start beside two'\n"
             "        time.sleep(0.1)\n")
    paths = {}
    for name in ("one", "two", "last"):
        paths[name] = tmp_path / f"test_{name}.py"
        body = probe.format(out=str(tmp_path / f"{name}.json"))
        if name == "two":
            body += waits.format(marker=str(tmp_path / "last.json"))
        paths[name].write_text(body)
    status = streams.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
                          plan={"one": [str(paths["one"])], "two": [str(paths["two"])]},
                          then={"last": [str(paths["last"])]})
    assert status == 0
    seen = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in paths}
    mine = sorted(os.sched_getaffinity(0))
    assert seen["one"] and seen["two"] and not set(seen["one"]) & set(seen["two"]), seen
    assert sorted(seen["one"] + seen["two"]) == mine and seen["last"] == seen["one"], seen


def test_unpinned_the_one_after_runs_after_every_stream_on_all_cpus(tmp_path, monkeypatch,
                                                                    every_cpu):
    monkeypatch.setenv("LAB_TEST_PIN", "0")
    probe = ("import json, os\ndef test_cpus():\n"
             "    assert os.path.exists({before!r}), 'started before the streams ended'\n"
             "    open({out!r}, 'w').write(json.dumps(sorted(os.sched_getaffinity(0))))\n")
    slow = ("import time\ndef test_slow():\n    time.sleep(2)\n"
            "    open({out!r}, 'w').write('done')\n")
    (tmp_path / "test_one.py").write_text(slow.format(out=str(tmp_path / "one.done")))
    (tmp_path / "test_last.py").write_text(probe.format(before=str(tmp_path / "one.done"),
                                                        out=str(tmp_path / "last.json")))
    (tmp_path / "test_two.py").write_text("def test_ok():\n    assert True\n")
    status = streams.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
                          plan={"one": [str(tmp_path / "test_one.py")],
                                "two": [str(tmp_path / "test_two.py")]},
                          then={"last": [str(tmp_path / "test_last.py")]})
    assert status == 0
    assert json.loads((tmp_path / "last.json").read_text()) == sorted(os.sched_getaffinity(0))


def test_a_run_keeps_no_engine_idle_for_a_notebook_that_starts_its_own(tmp_path):
    """03 times first requests after a start: its arms are `fresh`, so its plan
    asks the broker for nothing, though 02 starts the very same two
    configurations (which the broker would otherwise keep idle through 03)."""
    from lab_utils.experiments import prompt_length_and_warmup as pw
    from lab_utils.plan import check_notebook
    cpu = load_profile("cpu")
    paths = [NOTEBOOKS_DIR / f"{n}.ipynb" for n in ("02_prefix_caching",
                                                    "03_prompt_length_and_warmup")]
    params = {p.stem: run_params(cpu, p, smoke=True, results_dir=str(tmp_path)) for p in paths}
    demand = dict(planned_keys(paths, cpu, params))
    assert all(a.fresh for a in pw.plan(cpu, params[paths[1].stem]).arms)
    assert demand["03_prompt_length_and_warmup"] == [] and len(demand["02_prefix_caching"]) == 2
    own = check_notebook(paths[1], cpu, None, dict(params[paths[1].stem]))
    # the same engines, but for how the lab's launcher starts them: 03's as `vllm
    # serve` does where the profile forks the engine core (its starts are measured)
    import re

    from lab_utils.cpu_tuning import FORK_CORE_ENV

    def engine(key: str) -> str:
        return re.sub(rf"{FORK_CORE_ENV}=[01] ", "", key)
    assert {engine(config_key(e.command)) for e in own.engines} == \
        {engine(k) for k in demand["02_prefix_caching"]}
