#!/usr/bin/env bash
# Same-run A/B of durable saves between saver binaries, with the limit measured in each round.
#
#   bash benches/peers/ab.sh ROUNDS "LABEL|BINARY|EXTRA ARGS" ["LABEL|BINARY|EXTRA ARGS" ...]
#
# Each round writes the model's bytes once plainly with fsync (the limit), then runs
# `BINARY save --synthetic $SPEC --json EXTRA ARGS` for every configuration in turn, so that a
# noisy hour hits all of them alike. Prints each configuration's median of plan + write + commit
# seconds, and every round's figure. SPEC defaults to criteo-kaggle,scale=0.5; WORK (a directory
# on the disk under test, default target/ab) holds the outputs, removed after each run.
set -euo pipefail
rounds=${1:?usage: ab.sh ROUNDS "LABEL|BINARY|ARGS" ...}
shift
spec=${SPEC:-criteo-kaggle,scale=0.5}
work=${WORK:-target/ab}
mkdir -p "$work"

seconds() {
  python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["plan_seconds"]+d["write_seconds"]+d["commit_seconds"], 2))'
}

declare -A times
bytes=""
for _ in $(seq "$rounds"); do
  i=0
  for config in "$@"; do
    IFS='|' read -r label bin args <<< "$config"
    rm -rf "$work/ck"
    sync
    # shellcheck disable=SC2086 # ARGS are several arguments
    json=$("$bin" save --synthetic "$spec" --out "$work/ck" --json $args)
    times[$i]+="$(seconds <<< "$json") "
    bytes=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_written"])' <<< "$json")
    rm -rf "$work/ck"
    i=$((i + 1))
  done
  sync
  times[limit]+="$(python3 - "$work/plain" "$bytes" <<'EOF'
import os, sys, time
path, n = sys.argv[1], int(sys.argv[2])
buf = b"Z" * (8 << 20)
t = time.perf_counter()
with open(path, "wb", buffering=0) as f:
    while n > 0:
        k = min(n, len(buf))
        f.write(buf[:k])
        n -= k
    os.fsync(f.fileno())
print(round(time.perf_counter() - t, 2))
os.remove(path)
EOF
) "
done

median() {
  python3 -c 'import statistics,sys; v=[float(x) for x in sys.argv[1:]]; print(statistics.median(v), v)' "$@"
}
# shellcheck disable=SC2086 # one figure per round
echo "limit (plain write + fsync of the same bytes): $(median ${times[limit]})"
i=0
for config in "$@"; do
  # shellcheck disable=SC2086
  echo "[${config%%|*}]: $(median ${times[$i]})"
  i=$((i + 1))
done
