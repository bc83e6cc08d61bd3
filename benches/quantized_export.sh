#!/usr/bin/env bash
# Quantized serving exports against a plain export of the same checkpoint, in one run.
#
#   bash benches/quantized_export.sh [ROUNDS] [SPEC]
#
# Saves SPEC (default: 4 tables of 500,000 rows, dim 64, embedding + Adagrad, 16 MiB dense) with
# 4 shards, then exports it without the Adagrad slots ROUNDS times (default 5), alternating a
# plain export and `--quantize int8`, `int4` and `int2` (durable, as by default). Prints, per
# configuration, the median wall time (process start to exit), its ratio to the plain export's,
# the bytes written and the size ratio of the embedding tensors alone, and the peak RSS.
set -euo pipefail
rounds=${1:-5}
spec=${2:-tables=4,rows=500000,dim=64,slots=embedding+adagrad,dense=16MiB,seed=1}
cd "$(dirname "$0")/.."
cargo build --release -q -p saver-cli
bin=target/release/saver
work=$(mktemp -d "${SAVER_BENCH_DIR:-${TMPDIR:-/tmp}}/quantized-export.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$bin" save --out "$work/ck" --synthetic "$spec" --shards 4 >/dev/null
for r in $(seq "$rounds"); do
  for m in plain int8 int4 int2; do
    rm -rf "$work/ex"
    args=()
    [ "$m" = plain ] || args=(--quantize "$m")
    /usr/bin/time -f "$m %e %M" -o "$work/time" \
      "$bin" export "$work/ck" --out "$work/ex" --exclude-slots 'adagrad*' "${args[@]}" --json >"$work/report"
    python3 - "$work/report" "$work/ex" "$(cat "$work/time")" >>"$work/runs" <<'PY'
import json, os, sys
report, ex, timing = sys.argv[1:]
m, secs, kib = timing.split()
index = json.load(open(os.path.join(ex, "model.safetensors.index.json")))
emb = 0
for f in sorted(set(index["weight_map"].values())):
    with open(os.path.join(ex, f), "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    emb += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k.endswith("/embedding"))
print(json.dumps({"mode": m, "s": float(secs), "rss_mib": int(kib) / 1024, "bytes": json.load(open(report))["bytes_written"], "emb": emb}))
PY
  done
done
python3 - "$work/runs" "$spec" "$(git rev-parse --short HEAD)" <<'PY'
import json, statistics, sys
runs, spec, rev = sys.argv[1:]
by = {}
for line in open(runs):
    d = json.loads(line)
    by.setdefault(d["mode"], []).append(d)
med = lambda m, f: statistics.median(d[f] for d in by[m])
print(f"quantized exports of `{spec}` at {rev}: medians of {len(by['plain'])} alternated rounds")
print("| export | time | × plain time | bytes written | embedding tensors, × smaller | peak RSS |")
print("| --- | --- | --- | --- | --- | --- |")
for m in ("plain", "int8", "int4", "int2"):
    print(f"| {m} | {med(m, 's'):.2f} s | {med(m, 's') / med('plain', 's'):.2f} | {med(m, 'bytes') / 2**20:.0f} MiB | "
          f"{med('plain', 'emb') / med(m, 'emb'):.2f} | {med(m, 'rss_mib'):.0f} MiB |")
PY
