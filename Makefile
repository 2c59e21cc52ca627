# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TOOLS  := $(VENV)/.system-tools

.PHONY: help demo test quick lint typecheck unit titan procs s3server faults soak bench standalone s3real goodput costs costs-large clean

# Test lanes (tests/lanes.py marks every test at collection; docs/testing.md has the times):
#   make quick     the in-process tests, both cores: what to run after each edit (under a minute)
#   make test      lint, types and every lane: the README's test command and .ci/run
#   make procs     only the tests that start processes (multi-rank jobs, CLI, torchrun, tools)
#   make s3server  only the tests against the real S3 server (SeaweedFS)
#   make faults    the long randomised fault sweeps (FAULT_SEEDS seeds each; make test runs a few)
#   make soak      the long run of the commit protocol's models and its mutation kit (many examples)
#   make titan     the torchtitan integration against torchtitan itself, in its own venv (.venv-titan)
QUICK := not procs and not s3server and not slow and not faults
# pytest keeps its rewritten test modules as .pyc files; where the environment sets
# PYTHONDONTWRITEBYTECODE (this machine's does) every run rewrote all of them again, 7-8 s of CPU in
# each worker, and every process a test starts compiled tierstore anew
unexport PYTHONDONTWRITEBYTECODE
FAULT_SEEDS ?= 20

help:
	@sed -n 's/^#   make/make/p' Makefile

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on this machine. An unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,bench]'
	touch $(STAMP)

# The torchtitan lane's own venv, built like the main one: torchtitan's dependency set (datasets) pins
# fsspec below s3fs's, so torchtitan is installed --no-deps beside the `titan` extra (what its
# checkpointer, optimizer and config modules import), never into .venv.
TITAN_VENV  := .venv-titan
TITAN_STAMP := $(TITAN_VENV)/.installed

$(TITAN_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/pip install --quiet --upgrade pip
	$(TITAN_VENV)/bin/pip install --quiet torch==2.13.0
	$(TITAN_VENV)/bin/pip install --quiet -c constraints.txt -e '.[dev,titan]'
	$(TITAN_VENV)/bin/pip install --quiet -c constraints.txt --no-deps torchtitan==0.3.0
	touch $(TITAN_STAMP)

# The system commands the tests run (faketime, fiu-run, promtool, ...): installed once as root where
# missing, or the run stops before any test, naming them (tests/system-tools.txt lists them).
$(TOOLS): tests/system-tools.txt tests/install-system-tools | $(STAMP)
	tests/install-system-tools tests/system-tools.txt
	touch $(TOOLS)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check tierstore tests examples benchmarks
	$(BIN)/ruff format --check tierstore tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# Both cores (pytest-xdist): serial, the suite took 20 of CI's 90 minutes; every test bounds its own
# waits, so a loaded core slows a test but does not fail it.
unit: $(STAMP) $(TOOLS)
	$(BIN)/pytest -q -n 2 --durations=15

# The quick lane's tmp_path roots lie on a tmpfs where there is one: on this machine's disk each
# durable write (fsync the file, rename, fsync the directory) waited 4-5 ms, and the lane waited on
# thousands of them (half its time). make unit keeps them on disk, where the fsyncs are real. The
# lane writes about 0.6 GB there: a smaller /dev/shm (a container's 64 MB) is passed over.
QUICK_TMP = $(or $(shell df -Pk /dev/shm 2>/dev/null | awk 'NR==2 && $$4 > 2097152 {print "/dev/shm"}'),$(or $(TMPDIR),/tmp))
quick: $(STAMP) $(TOOLS)
	@base=$$(mktemp -d -p $(QUICK_TMP) tierstore-quick.XXXXXX); \
	$(BIN)/pytest -q -n 2 -m "$(QUICK)" --durations=10 --basetemp="$$base"; status=$$?; \
	rm -rf "$$base"; exit $$status

procs: $(STAMP) $(TOOLS)
	$(BIN)/pytest -q -m "procs and not s3server" --durations=15

s3server: $(STAMP) $(TOOLS)
	$(BIN)/pytest -q -m s3server --durations=10

faults: $(STAMP) $(TOOLS)
	TIERSTORE_FAULT_SEEDS=$(FAULT_SEEDS) $(BIN)/pytest -q -m faults -s --durations=10

titan: $(TITAN_STAMP) $(TOOLS)
	TIERSTORE_TITAN_LANE=1 $(TITAN_VENV)/bin/pytest -q --durations=10 tests/integrations

soak: $(STAMP) $(TOOLS)
	TIERSTORE_MODEL_EXAMPLES=2000 $(BIN)/pytest -q -p no:randomly --timeout=0 tests/records/test_model.py tests/records/test_model_multinode.py tests/records/test_machine_model.py tests/records/test_model_keeper.py

test: $(TOOLS) lint typecheck unit titan

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/standalone.py $(STANDALONE_ARGS)
	$(BIN)/python benchmarks/costs.py $(COSTS_ARGS)
	$(BIN)/python benchmarks/cost_plots.py bench-results/costs.json $(wildcard $(COSTS_LARGE)/costs.json)

# requests and time per operation as ranks and retained checkpoints grow (make bench runs it too),
# to 1,000 retained; the 10,000 point is costs-large (about 20 minutes: the first pass reads 40,000
# markers), kept apart so that make bench stays near 25 minutes. The plot merges both when both ran.
COSTS_ARGS ?= --retained 10 100 1000 --ranks 8 64 256 1024
COSTS_LARGE := bench-results/costs-large
# The fleet: what N nodes' promoters ask of one S3 tier per second (benchmarks/fleet.py), N to 1,250
# over 100 retained (about 25 minutes, 12 of them the 1,250 point), plotted to bench-results/fleet.png;
# FLEET_ARGS="--nodes 8 64" for a short run.
FLEET_ARGS ?= --nodes 8 64 256 1250 --retained 100
costs: $(STAMP)
	$(BIN)/python benchmarks/costs.py $(COSTS_ARGS)
	$(BIN)/python benchmarks/fleet.py $(FLEET_ARGS)
	$(BIN)/python benchmarks/cost_plots.py bench-results/costs.json $(wildcard $(COSTS_LARGE)/costs.json) bench-results/fleet.json

costs-large: $(STAMP)
	$(BIN)/python benchmarks/costs.py --retained 10000 --ranks --seaweed 0 --out $(COSTS_LARGE)

# what an S3 outage costs the fast path, against a real S3 server (make bench runs it too)
standalone: $(STAMP)
	$(BIN)/python benchmarks/standalone.py $(STANDALONE_ARGS)

# the S3 paths on a real server against boto3's best (make bench runs s3_real as its s3real phase),
# three runs in a row, then each call's request timeline beside boto3's (about 12 minutes)
s3real: $(STAMP)
	for run in 1 2 3; do $(BIN)/python benchmarks/s3_real.py --out bench-results/s3real-$$run || exit 1; done
	$(BIN)/python benchmarks/s3_timeline.py

# the training-loop benchmark alone (make bench runs it too, at --goodput-size)
goodput: $(STAMP)
	$(BIN)/python benchmarks/goodput.py $(GOODPUT_ARGS)

clean:
	rm -rf $(VENV) $(TITAN_VENV) .pytest_cache .mypy_cache .ruff_cache bench-results
