# Two entry points for a fresh machine: `make demo` and `make test`.
# Everything is installed into .venv by the repo's own files; nothing by hand.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch first and pinned: the CPU 2.13.0 wheel is on these machines' disk; a bare
# `torch` requirement would otherwise pull a multi-GB CUDA build. GPU users: see README.
TORCH_SPEC ?= torch==2.13.0
DEMO_FLEET ?= busy-gpu0
# The browser test (tests/browser) drives JupyterLab in Debian's Chromium through the
# Playwright wheel. `playwright install` would download a browser build, which these
# machines cannot fetch, so the browser comes from apt.
CHROMIUM := /usr/bin/chromium

.PHONY: demo test lint typecheck unit notebooks notebooks-refresh bench clean-venv browser-deps slurm-deps

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

# The anchors the benchmarks compare with (gpustat, nvitop, accelerate, DeepSpeed,
# Lightning) are heavy and only `make bench` needs them: `make test` stays lean.
$(BIN)/.bench-installed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	touch $@

demo: $(BIN)/.installed
	@echo "== nbgpu doctor on the simulated '$(DEMO_FLEET)' fleet (no GPU needed) =="
	NBGPU_SIMULATE=$${NBGPU_SIMULATE:-$(DEMO_FLEET)} $(BIN)/nbgpu doctor || true
	@echo
	@echo "== quickstart notebook, executed headless in a real kernel =="
	NBGPU_SIMULATE=$${NBGPU_SIMULATE:-$(DEMO_FLEET)} $(BIN)/python notebooks/run_headless.py notebooks/quickstart.ipynb
	@echo
	@echo "== launch notebook: %%torchrun jobs on the same fleet (ranks on CPU with gloo) =="
	NBGPU_SIMULATE=$${NBGPU_SIMULATE:-$(DEMO_FLEET)} $(BIN)/python notebooks/run_headless.py notebooks/launch.ipynb

lint: $(BIN)/.installed
	$(BIN)/ruff check nbgpu tests bench notebooks
	$(BIN)/ruff format --check nbgpu tests bench notebooks/run_headless.py

typecheck: $(BIN)/.installed
	$(BIN)/mypy

unit: $(BIN)/.installed browser-deps slurm-deps
	$(BIN)/python -m pytest tests

# The scale-out tests (tests/slurm) start a real two-node SLURM cluster on loopback from
# Debian's slurm-wlm and munge. As root (CI) they are installed; otherwise the tests skip
# and say why. Idempotent: no apt call once the daemons are there.
slurm-deps:
	@if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/munged ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "slurm-wlm/munge missing and we are not root: tests/slurm will skip" >&2; exit 0; \
	fi; \
	echo "== installing Debian's slurm-wlm and munge for tests/slurm (once) =="; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge > /dev/null

# Idempotent: nothing to do (and no apt call) once Chromium is there.
browser-deps:
	@if [ -x $(CHROMIUM) ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "$(CHROMIUM) is missing and we are not root: run 'sudo apt-get install -y chromium' (needed by tests/browser)" >&2; \
		exit 1; \
	fi; \
	echo "== installing Debian's chromium for tests/browser (about 2 min, once) =="; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null \
		&& test -x $(CHROMIUM)

# Every notebooks/*.ipynb, with the cells marked `# NBVAL_CHECK_OUTPUT` (or tagged
# nbval-check-output) compared to their stored outputs after notebooks/sanitize.cfg
# has replaced pids, ports, times and paths in both.
notebooks: $(BIN)/.installed
	cd notebooks && ../$(BIN)/python -m pytest -p no:cacheprovider --nbval-lax --nbval-current-env \
		--nbval-sanitize-with sanitize.cfg \
		--nbval-cell-timeout=300 -o testpaths=. -o addopts= -W ignore::DeprecationWarning .

# Re-store the tutorials' outputs after a change to how results render.
# A fresh runs directory: the stored outputs do not depend on this machine's old runs.
notebooks-refresh: $(BIN)/.installed
	runs=$$(mktemp -d); for nb in notebooks/*.ipynb; do \
		env -u CUDA_VISIBLE_DEVICES COLUMNS=80 NBGPU_SIMULATE=busy-gpu0 NBGPU_RUNS_DIR=$$runs \
		$(BIN)/python notebooks/run_headless.py $$nb --write > /dev/null || exit 1; \
	done; rm -rf $$runs

test: lint typecheck unit notebooks

bench: $(BIN)/.bench-installed
	$(BIN)/python bench/run_all.py

clean-venv:
	rm -rf $(VENV)
