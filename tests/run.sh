#!/usr/bin/env bash
# The whole test suite: Rust unit, property, integration and doc tests, the examples, the
# Python interoperability test (which installs safetensors and numpy into its own venv), and the
# Python package's tests (built by maturin into a venv of their own).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
# The peak-RSS bound of every streaming command, on a model five times larger than it: needs an
# optimised build (a debug build skips it).
cargo test --release -p saver-cli --test cli memory::
for example in trainer_loop serving_export multi_process background_save incremental managed_training; do
  echo "example $example"
  cargo run --quiet --example "$example" > /dev/null
done
bash tests/interop/run.sh
bash python/tests/run.sh
