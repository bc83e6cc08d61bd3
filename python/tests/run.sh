#!/usr/bin/env bash
# The Python package's tests: builds it with maturin into a venv of their own (made here, kept
# between runs; see below) and runs pytest. The digest test compares with the `saver` binary
# built here.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
# The venv (pinned torch and TorchRec, kept between runs): python/tests/venv.sh sets $venv.
source "$root/python/tests/venv.sh"
cargo build --quiet -p saver-cli
# A debug build into the venv, sharing the workspace's build directory (and so its compiled
# crates) with `cargo test`.
(cd "$root/python" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop --quiet)
# --basetemp: pytest empties it at each start, where its default keeps the last three runs' files
# (a Garage server's data among them) in the system's temporary directory.
SAVER_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/saver" \
  "$venv/bin/python" -m pytest -q --basetemp "${CARGO_TARGET_DIR:-$root/target}/pytest-tmp" \
  "$root/python/tests"
# The torch suites again with the CPU stand-in of a device (saver/_staging.py): every torch
# tensor a save reads goes through the staging ring, as a CUDA tensor does.
SAVER_STAND_IN_DEVICE=1 SAVER_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/saver" \
  "$venv/bin/python" -m pytest -q --basetemp "${CARGO_TARGET_DIR:-$root/target}/pytest-tmp" \
  "$root/python/tests/test_torch.py" "$root/python/tests/test_torch_sharded.py" \
  "$root/python/tests/test_torch_dtypes.py" "$root/python/tests/test_torchrec.py" \
  "$root/python/tests/test_torch_trust.py" "$root/python/tests/test_one_opening.py" \
  "$root/python/tests/test_staging.py" "$root/python/tests/test_dcp.py"
# The package's example: a training loop that saves in the background and resumes.
"$venv/bin/python" "$root/python/examples/train_loop.py"
# The staging ring's benchmark still runs (tiny size, one round; figures not kept).
"$venv/bin/python" "$root/benches/staging_ring.py" --gib 0.01 --rounds 1 \
  --work "${CARGO_TARGET_DIR:-$root/target}/staging-ring-quick" > /dev/null
# saver behind DCP's API against DCP's own files still runs (tiny size, one round).
"$venv/bin/python" "$root/benches/dcp_compare.py" --gib 0.01 --rounds 1 --flips 2 \
  --work "${CARGO_TARGET_DIR:-$root/target}/dcp-compare-quick" > /dev/null
# The device check runs on a CPU through the stand-in (tiny sizes; figures not kept), so that it
# is ready for a GPU machine and exits non-zero on a restore that is not bitwise.
"$venv/bin/python" "$root/benches/gpu_check.py" --cpu-fake \
  --work "${CARGO_TARGET_DIR:-$root/target}/gpu-check-quick" > /dev/null
