#!/usr/bin/env bash
# saver.dcp's suite again on the newest torch release (pinned: the newest on the package index
# when this was written), beside the one python/tests/venv.sh pins: DCP's interfaces drift
# between releases (keyword arguments of set_up_storage_writer and read_metadata, the
# futures write_data returns), and saver.dcp must follow both. Its own venv, reused while its
# pins match; no TorchRec (the DCP suite needs none).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
pins=("maturin>=1.7,<2" "pytest>=7" "numpy>=1.24" "safetensors>=0.4" "torch==2.15.0")
key="$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-12)"
venv="${SAVER_NEWEST_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/saver/python-venv-newest-$key}"
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
"$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.15.0'), torch.__version__"
(cd "$root/python" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" maturin develop --quiet)
SAVER_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/saver" \
  "$venv/bin/python" -m pytest -q --basetemp "${CARGO_TARGET_DIR:-$root/target}/pytest-tmp-newest" \
  "$root/python/tests/test_dcp.py"
