#!/usr/bin/env bash
# A chain's load against its compaction's, in one run (docs/benchmarks/HISTORY.md, "Incremental
# checkpoints"): alternates `saver load CHAIN` and `saver load COMPACTED` (shard 0 of 2,
# --no-digest, warm page cache) N times, into arrays or tables, and prints the medians of the load
# times the binary reports (`load_seconds`), and their ratio (1.0: as fast). The chain and its
# compaction are what `cargo bench --bench delta -- --keep` leaves (`chain9`, `compacted`).
#
#   bash benches/restore/chain_vs_compacted.sh target/release/saver CHAIN COMPACTED [arrays|tables] [N]
set -euo pipefail
bin=$1 chain=$2 compacted=$3 into=${4:-arrays} n=${5:-9}
seconds() {
  "$bin" load "$1" --shards 2 --shard-index 0 --into "$into" --no-digest --json |
    python3 -c "import json, sys; print(json.load(sys.stdin)['load_seconds'])"
}
seconds "$chain" > /dev/null && seconds "$compacted" > /dev/null # warm the page cache
a=() c=()
for _ in $(seq "$n"); do
  a+=("$(seconds "$chain")")
  c+=("$(seconds "$compacted")")
done
python3 - "$into" "${a[*]}" "${c[*]}" <<'PY'
import statistics, sys
into = sys.argv[1]
a = sorted(float(x) for x in sys.argv[2].split())
c = sorted(float(x) for x in sys.argv[3].split())
ma, mc = statistics.median(a), statistics.median(c)
print(f"into {into}: median chain {ma:.3f} s, compacted {mc:.3f} s, chain/compacted {ma / mc:.2f}")
PY
