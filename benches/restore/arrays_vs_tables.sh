#!/usr/bin/env bash
# Restore into tables against a load into arrays of the same checkpoint, in one run
# (docs/benchmarks/HISTORY.md, "Restore into tables"): alternates `saver load CK --into arrays` and
# `--into tables` (both --no-digest, warm page cache) N times and prints the medians of the load
# times the binary reports, and their ratio (arrays / tables: 1.0 means as fast).
#
#   bash benches/restore/arrays_vs_tables.sh target/release/saver CK [N]
set -euo pipefail
bin=$1 ck=$2 n=${3:-5}
arrays=() tables=()
seconds() { "$bin" load "$ck" --into "$1" --no-digest 2>&1 | grep -o 'in [0-9.]*s' | tr -dc '0-9.'; }
seconds arrays > /dev/null # warm the page cache
for _ in $(seq "$n"); do
  arrays+=("$(seconds arrays)")
  tables+=("$(seconds tables)")
done
python3 - "${arrays[*]}" "${tables[*]}" <<'PY'
import statistics, sys
a = sorted(float(x) for x in sys.argv[1].split())
t = sorted(float(x) for x in sys.argv[2].split())
print("arrays", a)
print("tables", t)
ma, mt = statistics.median(a), statistics.median(t)
print(f"median arrays {ma:.2f} s, tables {mt:.2f} s, arrays/tables {ma / mt:.2f}")
PY
