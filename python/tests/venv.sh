# Sourced (bash): makes or reuses the Python venv of the tests and the benchmarks, with its pins
# installed, and sets $venv to it. Needs $root (the repository's root).
# What the suite runs on, pinned where a new release could change what is tested. torch comes
# from PyPI (its CUDA libraries come along and stay unused on a CPU-only machine).
pins=("maturin>=1.7,<2" "pytest>=7" "numpy>=1.24" "safetensors>=0.4" "torch==2.14.1")
# TorchRec on CPU: torchrec pulls in the CUDA fbgemm-gpu, whose import fails on a machine without
# libnvidia-ml; fbgemm-gpu-cpu replaces it, both without their dependencies (fbgemm-gpu-cpu 1.9.0
# does not load on torch 2.15), and torchrec's other dependencies are pinned here.
torchrec_pins=("torchrec==1.9.2" "fbgemm-gpu-cpu==1.9.0")
torchrec_deps=("tensordict==0.15.3" "torchmetrics==1.0.3" "tqdm" "pyre-extensions==0.0.32")
# The venv lives outside the clone, named by its pins, so that a fresh clone (CI's) reuses it
# while the pins match: then pip installs nothing (about a second); a new venv takes about a
# minute and 5.5 GB.
key="$(printf '%s\n' "${pins[@]}" "${torchrec_pins[@]}" "${torchrec_deps[@]}" | sha256sum | cut -c1-12)"
venv="${SAVER_PYTHON_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/saver/python-venv-$key}"
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${torchrec_pins[@]}"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${torchrec_deps[@]}"
# A missing or broken TorchRec fails the suite here, not as skipped tests.
"$venv/bin/python" -c "import torchrec, fbgemm_gpu" 2>/dev/null || {
  echo "python/tests/run.sh: torchrec does not import in $venv" >&2
  exit 1
}
