#!/usr/bin/env bash
# Time and peak RSS of the commands that read or rewrite a whole model, against `cp` + `sync` of
# the model file in the same run. For docs/benchmarks/HISTORY.md ("Every command streams").
#
#   bash benches/streaming/run.sh SAVER_BINARY WORK_DIR SIZE_GIB...
#
# Needs /usr/bin/time and a Python with numpy (the model generator). Each size's files are
# removed before the next size.
set -euo pipefail
saver="$(realpath "$1")"; work="$2"; shift 2
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
mkdir -p "$work"
cd "$work"
measure() { # label command...
  local label="$1"; shift
  sync
  /usr/bin/time -f "$label %e s %M KB" "$@" > /dev/null 2>> times.log || { echo "$label failed"; tail -3 times.log; exit 1; }
  tail -1 times.log
}
for gib in "$@"; do
  rm -rf model.safetensors ck ck3 ex cp.out
  "$python" "$here/make_plain_model.py" model.safetensors "$gib" > /dev/null
  echo "== $gib GiB ($(stat -c %s model.safetensors) bytes)"
  measure "cp+sync" sh -c 'cp model.safetensors cp.out && sync'
  rm -f cp.out
  measure "save --from" "$saver" save --from model.safetensors --out ck --shards 4 --no-fsync
  measure "digest" "$saver" digest ck
  measure "reshard" "$saver" reshard ck --out ck3 --shards 3 --no-fsync
  measure "export" "$saver" export ck --out ex
  measure "verify" "$saver" verify ck
done
rm -rf model.safetensors ck ck3 ex
