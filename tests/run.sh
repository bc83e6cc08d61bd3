#!/usr/bin/env bash
# The whole test suite: Rust unit, property, integration and doc tests, the examples, the
# Python interoperability test (which installs safetensors and numpy into its own venv), and the
# Python package's tests (built by maturin into a venv of their own). Ends with one verdict line:
# what passed, failed and was skipped in each suite, whether the optional suites (object store,
# network namespaces) ran, and how long it all took. Each step's output is also kept in
# target/test-logs/.
set -eEuo pipefail
cd "$(dirname "$0")/.."
logs="${CARGO_TARGET_DIR:-target}/test-logs"
mkdir -p "$logs"
rm -f "$logs"/*.log
start=$(date +%s)
step=""
elapsed() {
  local s=$(($(date +%s) - start))
  printf '%dm%02ds' $((s / 60)) $((s % 60))
}
trap 'echo "verdict: FAILED in step \"$step\" after $(elapsed) (its output: $logs/$step.log)"' ERR

# Runs a step, its output shown and kept in $logs/<name>.log.
run() {
  step="$1"
  shift
  echo "== $step"
  "$@" 2>&1 | tee "$logs/$step.log"
}

run rust cargo test --workspace
# The peak-RSS bound of every streaming command, on a model five times larger than it: needs an
# optimised build (a debug build skips it).
run memory cargo test --release -p saver-cli --test cli memory::
examples() {
  for example in trainer_loop serving_export multi_process background_save incremental managed_training; do
    echo "example $example"
    cargo run --quiet --example "$example" > /dev/null
  done
}
run examples examples
run interop bash tests/interop/run.sh
run python bash python/tests/run.sh
# saver.dcp on the newest torch release too (DCP's interfaces drift between releases).
run python-newest-torch bash python/tests/newest_torch.sh
step="verdict"

# libtest's "test result: ok. 12 passed; 0 failed; 5 ignored; …" lines, summed.
rust_counts() {
  cat "$@" | sed -n 's/^test result: [a-zA-Z]*\. \([0-9]*\) passed; \([0-9]*\) failed; \([0-9]*\) ignored.*/\1 \2 \3/p' |
    awk '{p+=$1; f+=$2; i+=$3} END {printf "%d passed, %d failed, %d ignored", p, f, i}'
}
# pytest's summary lines ("=== 150 passed, 2 skipped in 30.12s ==="), summed over its runs.
python_counts() {
  grep -E '[0-9]+ (passed|failed)' "$1" | awk '
    { for (i = 1; i < NF; i++) { w = $(i + 1); sub(/[^a-z].*/, "", w)
        if (w == "passed") p += $i; else if (w == "failed") f += $i; else if (w == "skipped") s += $i } }
    END { printf "%d passed, %d failed, %d skipped", p, f, s }'
}
# The optional suites run where their tools are (and must, where .ci/run requires them).
garage_bin="${SAVER_GARAGE_BIN:-$(command -v garage || echo "$HOME/.cargo/bin/garage")}"
if [ -x "$garage_bin" ]; then
  object_store="ran (garage $("$garage_bin" --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1))"
else
  object_store="SKIPPED (no garage binary)"
fi
if [ "${SAVER_REQUIRE_NETNS:-}" = 1 ] || { [ "$(id -u)" = 0 ] && command -v ip > /dev/null; }; then
  namespaces="ran"
else
  namespaces="SKIPPED (needs root and iproute2)"
fi
echo "verdict: PASSED in $(elapsed) · rust: $(rust_counts "$logs/rust.log" "$logs/memory.log")" \
  "(ignored: child processes their parent tests run, and the memory test in the debug build, run by the memory step) · python: $(python_counts "$logs/python.log") (saver.dcp on the newest torch: $(python_counts "$logs/python-newest-torch.log"))" \
  "· interop: passed · object-store tests: $object_store · network-namespace tests: $namespaces"
