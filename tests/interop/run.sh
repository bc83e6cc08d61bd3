#!/usr/bin/env bash
# Runs the Python interoperability test in its own venv (safetensors + numpy from PyPI).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${SAVER_INTEROP_VENV:-$root/target/interop-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "safetensors>=0.4" "numpy>=1.24" "zstandard>=0.22"
# Opt-in: Hugging Face's loaders need torch (a large install), so CI leaves them out. Run with
# SAVER_INTEROP_HF=1 bash tests/interop/run.sh.
if [ -n "${SAVER_INTEROP_HF:-}" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check huggingface_hub torch
fi
cargo build --quiet -p saver-cli
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" "$root/tests/interop/interop.py" "${CARGO_TARGET_DIR:-$root/target}/debug/saver" "$work"
