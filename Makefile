# Two commands do all set-up on a fresh machine:
#   make run   - create .venv if missing, install, run the pipeline end to end on embedded defaults
#   make test  - same bootstrap, then the fast and end-to-end tiers of the tests (make test-chaos: the third)
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

.PHONY: install run test test-fast test-chaos test-profile lint typecheck s3 server serve bench bench-smoke docs clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(CONSTRAINTS) -e '.[dev]'
	@touch $@

install: $(VENV)/.installed

run: install
	$(PY) -m flows.training $(ARGS)

# The tests in three tiers, by marker (declared in pyproject.toml, described in docs/development.md):
#   fast:  neither `slow` nor `chaos`: no training run; two processes (XDIST: each module in one, the
#          longest first, by bench/results/suite_cpu.tsv; tests/conftest.py orders them)
#   e2e:   `slow` and not `chaos`: every promise that needs the whole pipeline, shown once; two processes too,
#          each with a local Ray of its own (a third of a serial pass's time waits on servers and starts)
#   chaos: `chaos`: real time windows and real deaths across processes and machines; two processes, then
#          the tests also marked `window` (a bound of seconds that load beside it could break) alone
# make test runs the import rules, the fast tier, then the end-to-end tier; CI runs
# make test-chaos after it. A PYTEST_ARGS with its own -m runs one serial pass with it instead.
FAST := not slow and not chaos
E2E := slow and not chaos
# --no-loadscope-reorder: xdist would otherwise hand out modules by their number of tests.
XDIST := -n 2 --dist loadscope --no-loadscope-reorder
PROFILE ?=
# A tier that selects no test (pytest's exit 5) fails, unless PYTEST_ARGS narrowed the selection.
NARROWED := $(if $(strip $(PYTEST_ARGS)),yes,)
test: install
	$(VENV)/bin/lint-imports
ifneq (,$(findstring -m ,$(PYTEST_ARGS) ))
	$(PY) -m pytest $(PROFILE) $(PYTEST_ARGS)
else
	@fast=0; e2e=0; \
	$(PY) -m pytest -m "$(FAST)" $(XDIST) $(PROFILE) $(PYTEST_ARGS) || fast=$$?; \
	$(PY) -m pytest -m "$(E2E)" $(XDIST) $(PROFILE) $(PYTEST_ARGS) || e2e=$$?; \
	echo "make test: fast tier exit $$fast, end-to-end tier exit $$e2e (5: no test selected, an error unless PYTEST_ARGS narrowed it)"; \
	for rc in $$fast $$e2e; do [ $$rc -eq 0 ] || { [ $$rc -eq 5 ] && [ -n "$(NARROWED)" ]; } || exit $$rc; done; \
	[ $$fast -ne 5 ] || [ $$e2e -ne 5 ] || exit 5
endif

test-fast: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -m "$(FAST)" $(XDIST) $(PROFILE) $(PYTEST_ARGS)

test-chaos: install
ifneq (,$(findstring -m ,$(PYTEST_ARGS) ))
	$(PY) -m pytest $(PROFILE) $(PYTEST_ARGS)
else
	@beside=0; alone=0; \
	$(PY) -m pytest -m "chaos and not window" $(XDIST) $(PROFILE) $(PYTEST_ARGS) || beside=$$?; \
	$(PY) -m pytest -m "chaos and window" $(PROFILE) $(PYTEST_ARGS) || alone=$$?; \
	echo "make test-chaos: two at a time exit $$beside, windows alone exit $$alone (5: no test selected, an error unless PYTEST_ARGS narrowed it)"; \
	for rc in $$beside $$alone; do [ $$rc -eq 0 ] || { [ $$rc -eq 5 ] && [ -n "$(NARROWED)" ]; } || exit $$rc; done; \
	[ $$beside -ne 5 ] || [ $$alone -ne 5 ] || exit 5
endif

# Every tier with devtools/pytest_profile.py: each test's wall and CPU seconds, in bench/results/suite_cpu.tsv.
test-profile: install
	@rm -f bench/results/suite_cpu.tsv
	-$(MAKE) --no-print-directory test PROFILE="-p devtools.pytest_profile --profile-tsv=bench/results/suite_cpu.tsv"
	-$(MAKE) --no-print-directory test-chaos PROFILE="-p devtools.pytest_profile --profile-tsv=bench/results/suite_cpu.tsv"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m devtools.check_sizes
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

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
	$(PY) -m bench.long_runs
	$(PY) -m bench.scoring
	$(PY) -m bench.failfast
	$(PY) -m bench.waits
	$(PY) -m bench.own_code
	$(PY) -m bench.summary

bench-smoke: install  ## the overhead benchmark at tiny sizes, one repetition (run it before changing bench/)
	$(PY) -m bench.overhead --smoke

docs: install  ## regenerate docs/configuration.md from the config model, then build the site into .pipeline/site
	$(PY) -m devtools.config_reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf .pipeline
