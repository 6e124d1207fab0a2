"""runall's notebook execution without an engine: a one-cell notebook run the
way `make run` runs the lab's notebooks."""
from __future__ import annotations

import json

import nbformat

from lab_utils.runall import run_all

#: The kernel checks its own connection: ipykernel holds the CurveZMQ secret key
#: the kernel manager provisioned (None when the traffic is plain TCP).
CHECK = ("from ipykernel.kernelapp import IPKernelApp\n"
         "assert IPKernelApp.instance().curve_secretkey, 'kernel traffic is not encrypted'")


def test_kernels_run_encrypted_without_the_tcp_warning(tmp_path, capfd):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CHECK)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, notebooks / "00_kernel.ipynb")
    assert run_all(runs_dir=tmp_path / "runs", notebooks_dir=notebooks) == 0
    status = json.loads((tmp_path / "runs" / "latest" / "status.json").read_text())
    assert status["notebooks"][0]["status"] == "ok", status["notebooks"][0].get("error")
    # ipykernel's IPKernelApp.init_sockets logs this for a tcp kernel without Curve keys
    assert "without encryption" not in capfd.readouterr().err


#: The kernel still busy in a request's handler after its reply went out (as
#: when a garbage collection or a finalizer runs there on a loaded machine):
#: papermill's last request is `kernel_info`, and it shuts the kernel down as
#: soon as the reply arrives.
SLOW_TAIL = ("import time\n"
             "kernel = get_ipython().kernel\n"
             "reply = kernel.kernel_info_request\n"
             "async def reply_then_linger(stream, ident, parent):\n"
             "    await reply(stream, ident, parent)\n"
             "    time.sleep(2)\n"
             "kernel.shell_handlers['kernel_info_request'] = reply_then_linger")


def _slow_tail_notebook(folder):
    folder.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SLOW_TAIL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, folder / "00_tail.ipynb")
    return folder / "00_tail.ipynb"


def test_a_kernel_in_its_last_handler_is_shut_down_without_a_keyboardinterrupt(tmp_path, capfd):
    notebooks = tmp_path / "notebooks"
    _slow_tail_notebook(notebooks)
    assert run_all(runs_dir=tmp_path / "runs", notebooks_dir=notebooks) == 0
    status = json.loads((tmp_path / "runs" / "latest" / "status.json").read_text())
    assert status["notebooks"][0]["status"] == "ok", status["notebooks"][0].get("error")
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_the_stock_kernel_manager_interrupts_that_kernel(tmp_path, capfd):
    """The case above is the failure it guards against: with jupyter_client's
    own manager, the shutdown's SIGINT lands in the lingering handler."""
    import papermill as pm

    from lab_utils.runall import kernel_config
    path = _slow_tail_notebook(tmp_path / "notebooks")
    pm.execute_notebook(str(path), str(tmp_path / "out.ipynb"), kernel_name="python3",
                        progress_bar=False, config=kernel_config())
    assert "KeyboardInterrupt caught in kernel" in capfd.readouterr().err


def _status(folder, machine, notebooks, smoke=False):
    folder.mkdir(parents=True)
    (folder / "status.json").write_text(json.dumps(
        {"profile": "cpu", "base_url": "", "smoke": smoke, "parameters": {}, "machine": machine,
         "notebooks": [{"name": n, "status": s, "seconds": t} for n, s, t in notebooks]}))


def test_a_run_is_estimated_from_the_newest_ok_time_of_each_notebook_on_this_machine(tmp_path):
    from lab_utils import run_estimate as est
    runs = tmp_path / "runs"
    _status(runs / "20261201-100000", "abc", [("00_a", "ok", 100.0), ("01_b", "failed", 9.0)])
    _status(runs / "20261202-100000", "abc", [("00_a", "ok", 120.0), ("01_b", "ok", 50.0)])
    _status(runs / "20261203-100000", "other", [("00_a", "ok", 10.0), ("02_c", "ok", 7.0)])
    _status(runs / "20261204-100000", "abc", [("00_a", "ok", 1.0)], smoke=True)
    _status(runs / "20261205-100000", "abc", [("02_c", "ok", 3.0)])   # the run in progress
    (runs / "latest").symlink_to("20261205-100000")
    want = est.key("cpu", "", False, None, "abc")
    got = est.previous_seconds(runs, want, exclude=runs / "20261205-100000")
    assert got == {"00_a": (120.0, "20261202-100000"), "01_b": (50.0, "20261202-100000")}
    assert est.before("00_a", got) == " (~120 s last time)" and est.before("02_c", got) == ""
    assert est.expected_line(["00_a", "01_b"], got) == (
        "expected: ~3 min, from earlier runs on this machine with these settings (20261202-100000)")
    assert est.expected_line(["00_a", "01_b", "02_c"], got).startswith(
        "expected: ~3 min for the 2 of 3 notebooks run before")
    assert est.left(["01_b"], got) == "; ~50 s left"
    assert est.left(["01_b", "02_c"], got) == "" and est.left([], got) == ""
    # explicit parameters are part of what makes two runs comparable
    assert est.previous_seconds(runs, est.key("cpu", "", False, {"repeats": 1}, "abc")) == {}


def test_the_second_run_on_a_machine_prints_the_first_runs_times(tmp_path, capfd):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, notebooks / "00_one.ipynb")
    assert run_all(runs_dir=tmp_path / "runs", notebooks_dir=notebooks) == 0
    first = json.loads((tmp_path / "runs" / "latest" / "status.json").read_text())
    assert "expected" not in capfd.readouterr().out
    import time
    time.sleep(1.1)  # run folders are named by the second
    assert run_all(runs_dir=tmp_path / "runs", notebooks_dir=notebooks) == 0
    out = capfd.readouterr().out
    seconds = first["notebooks"][0]["seconds"]
    assert f"[1/1] 00_one (~{seconds:.0f} s last time) ... ok" in out, out
    assert f"expected: ~{seconds:.0f} s, from earlier runs on this machine" in out, out
