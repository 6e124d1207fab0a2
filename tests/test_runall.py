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
