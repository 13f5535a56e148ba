# Everything runs inside a repo-local virtual environment, created on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch is pinned first so that pip does not pull CUDA wheels;
# override it, e.g. `make install TORCH=torch==2.13.0`.
TORCH  ?= torch==2.13.0

.PHONY: install demo test test-slow bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: install
	$(BIN)/python -m graphrunner demo

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	GRAPHRUNNER_SLOW=1 $(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m pytest bench -q --benchmark-enable --benchmark-only \
		--benchmark-warmup=on --benchmark-min-rounds=50 --benchmark-disable-gc

lint: install
	$(BIN)/ruff check graphrunner tests bench
	$(BIN)/ruff format --check graphrunner tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks
