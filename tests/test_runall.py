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
