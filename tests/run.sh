#!/usr/bin/env bash
# The whole test suite: Rust unit, property, integration and doc tests, the examples, and the
# Python interoperability test (which installs safetensors and numpy into its own venv).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
for example in trainer_loop serving_export multi_process background_save; do
  echo "example $example"
  cargo run --quiet --example "$example" > /dev/null
done
bash tests/interop/run.sh
