# Two commands do all set-up on a fresh machine:
#   make run   - create .venv if missing, install, run the pipeline end to end on embedded defaults
#   make test  - same bootstrap, then the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU-only torch unless this machine has an NVIDIA driver (then pip picks the CUDA build).
CONSTRAINTS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints-cpu.txt)
ARGS ?=
PYTEST_ARGS ?=
# make server's port on 127.0.0.1, and the API's that make serve talks to (unless PREFECT_API_URL is set)
PREFECT_PORT ?= 4200

# Keep all state of a local run under ./.pipeline, and keep an offline machine quiet.
export PREFECT_HOME ?= $(CURDIR)/.pipeline/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install run test test-fast lint typecheck s3 server serve bench bench-smoke docs clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(CONSTRAINTS) -e '.[dev]'
	@touch $@

install: $(VENV)/.installed

run: install
	$(PY) -m flows.training $(ARGS)

# The whole suite in two passes: the tests without the marker `slow` in two processes as test-fast runs them,
# then the end-to-end tests serially (each trains on both cores; their stop and heartbeat windows are measured in
# seconds). Both passes run whatever the first's outcome; pytest's exit 5 (nothing selected) fails only when
# neither pass selected a test. A PYTEST_ARGS with its own -m runs one serial pass with it instead.
test: install
	$(VENV)/bin/lint-imports
ifneq (,$(findstring -m ,$(PYTEST_ARGS) ))
	$(PY) -m pytest $(PYTEST_ARGS)
else
	@fast=0; slow=0; \
	$(PY) -m pytest -m "not slow" -n 2 --dist loadscope $(PYTEST_ARGS) || fast=$$?; \
	$(PY) -m pytest -m slow $(PYTEST_ARGS) || slow=$$?; \
	echo "make test: not slow exit $$fast, slow exit $$slow (5: no test selected)"; \
	for rc in $$fast $$slow; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done; \
	[ $$fast -ne 5 ] || [ $$slow -ne 5 ] || exit 5
endif

# Everything but the end-to-end tests, in two processes (pytest-xdist): most of their time is imports and
# subprocesses. The end-to-end tests stay serial in `make test`: each trains on both cores, and their stop and
# heartbeat windows are measured in seconds. --dist loadscope keeps each module in one process: its module-scoped
# fixtures (a prepared dataset, the registry's champions) start once, and its tests run in file order.
test-fast: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -m "not slow" -n 2 --dist loadscope $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m devtools.check_sizes

typecheck: install
	$(VENV)/bin/mypy flows tasks raytrain_driver raytrain_tasks deployments bench examples

s3: install  ## a local S3-compatible server on 127.0.0.1:8333 (SeaweedFS), data in .pipeline/s3
	$(PY) -m devtools.s3_server --dir .pipeline/s3 --port 8333

server: install  ## a local Prefect server and UI on http://127.0.0.1:4200 (another: PREFECT_PORT=...)
	@mkdir -p "$(PREFECT_HOME)"
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

serve: install  ## serve the deployments of deployments/prefect.yaml from this process (schedules included)
	PREFECT_API_URL=$${PREFECT_API_URL:-http://127.0.0.1:$(PREFECT_PORT)/api} $(PY) -m deployments.serve $(ARGS)

bench: install  ## benchmarks that print figures (not tests); results in bench/results/, every target in targets.md
	@mkdir -p bench/results && date +%s > bench/results/started
	$(PY) -m bench.overhead
	$(PY) -m bench.served --bare-from bench/results/overhead.json
	$(PY) -m bench.checkpoint_upload
	$(PY) -m bench.recovery
	$(PY) -m bench.failfast
	$(PY) -m bench.waits
	$(PY) -m bench.own_code
	$(PY) -m bench.summary

bench-smoke: install  ## the overhead benchmark at tiny sizes, one repetition (run it before changing bench/)
	$(PY) -m bench.overhead --smoke

docs: install  ## regenerate docs/configuration.md from the config model (tests/docs/test_docs.py checks it)
	$(PY) -m devtools.config_reference

clean:
	rm -rf .pipeline
