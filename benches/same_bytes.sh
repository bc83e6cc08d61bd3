#!/usr/bin/env bash
# Do two saver binaries write the same checkpoints? For refactors that must not change behaviour.
#
#   bash benches/same_bytes.sh OLD_BINARY NEW_BINARY [WORK]
#
# Each case is run by both binaries with the same save id where the command takes one: full saves
# of the synthetic presets at 1, 2 and 3 shards, a save --from a plain safetensors model, a delta,
# a reshard, a compact of a chain, and an export. Then, per case: every data file byte for byte
# (names compared with their save id taken out, for the commands that choose one), every document
# (index, manifest, shard manifests) field for field except who wrote it and when (the writer
# claims are compared by name only), and the digests.
# Exits non-zero, naming the case and the file, on the first difference.
set -euo pipefail
old=${1:?usage: same_bytes.sh OLD_BINARY NEW_BINARY [WORK]}
new=${2:?usage: same_bytes.sh OLD_BINARY NEW_BINARY [WORK]}
work=${3:-$(mktemp -d)}
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT

# run NAME ARGS...: runs `BIN ARGS` with @OUT@ standing for the case's output and @W@ for the
# binary's own work directory, for each binary.
run() {
  local name=$1
  shift
  local side bin
  for side in old new; do
    bin=${!side}
    local args=()
    for a in "$@"; do
      a=${a//@OUT@/$work/$side/$name}
      args+=("${a//@W@/$work/$side}")
    done
    "$bin" "${args[@]}" > /dev/null
  done
}

# compare NAME: the outputs of case NAME.
compare() {
  python3 - "$work/old/$1" "$work/new/$1" "$1" <<'EOF'
import json, os, re, sys
a, b, case = sys.argv[1:]
def files(d):
    out = {}
    for n in sorted(os.listdir(d)):
        # A save id is part of a data file's and a document's name: take it out, so that the
        # commands that pick one (reshard, compact, export) compare too.
        key = re.sub(r"^(model|saver)-[A-Za-z0-9_-]+?-(s\d+)", r"\1-ID-\2", n)
        key = re.sub(r"^saver-.+\.manifest\.json$", "saver-ID.manifest.json", key)
        out[key] = os.path.join(d, n)
    return out
fa, fb = files(a), files(b)
if sorted(fa) != sorted(fb):
    sys.exit(f"{case}: different files:\n  old {sorted(fa)}\n  new {sorted(fb)}")
def doc(path):
    v = json.load(open(path))
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(w) for k, w in x.items()
                    # Who wrote it; the ids a command picks; the CRC of a manifest, which
                    # holds who wrote it, and of a header, which holds the save id (the files
                    # themselves are compared apart).
                    if k not in ("writer", "replaces", "save_id", "saver_save_id", "saver_manifest",
                                 "saver_manifest_crc32", "manifest_crc32", "header_crc32")}
        if isinstance(x, list):
            return [strip(w) for w in x]
        if isinstance(x, str):
            return re.sub(r"(model|saver)-[A-Za-z0-9_-]+?-(s\d+)", r"\1-ID-\2", x)
        return x
    return strip(v)
def tensor_file(b):
    # A data file's header names its save id: with two ids (a command that picks one), the
    # header is compared without it, and every tensor byte as it is.
    import struct
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    h.get("__metadata__", {}).pop("saver.save_id", None)
    return h, b[8 + n:]
n = 0
for k in fa:
    if k.endswith(".writer.json"):
        continue  # who wrote the shard, and when: never the same
    if k.endswith(".json"):
        da, db = doc(fa[k]), doc(fb[k])
        if da != db:
            keys = sorted(x for x in set(da) | set(db) if da.get(x) != db.get(x))
            sys.exit(f"{case}: document {k} differs in {keys}: old {[da.get(x) for x in keys]}"
                     f" new {[db.get(x) for x in keys]}"[:2000])
    else:
        x, y = open(fa[k], "rb").read(), open(fb[k], "rb").read()
        if x != y and (tensor_file(x) != tensor_file(y)):
            sys.exit(f"{case}: {k} differs")
    n += 1
print(f"{case}: {n} files equal")
EOF
  local da db
  da=$("$old" digest "$work/old/$1")
  db=$("$new" digest "$work/new/$1")
  if [ "$da" != "$db" ]; then
    echo "$1: digests differ: $da / $db" >&2
    exit 1
  fi
}

for spec in tiny small "criteo-kaggle,scale=0.01"; do
  for shards in 1 2 3; do
    name="full-${spec%%,*}-$shards"
    run "$name" save --synthetic "$spec" --shards "$shards" --save-id same --out @OUT@ --no-fsync
    compare "$name"
  done
done
# A plain safetensors model (the export of a checkpoint) saved --from, in 2 shards.
run plain export --out @OUT@ @W@/full-small-3
compare plain
run from-plain save --from @W@/plain --shards 2 --save-id same --out @OUT@ --no-fsync
compare from-plain
# A delta of another model against a full checkpoint, and its compaction.
run delta save --synthetic small,seed=9 --parent @W@/full-small-2 --shards 2 --save-id same2 \
  --out @OUT@ --no-fsync
compare delta
run compacted compact --out @OUT@ --shards 3 @W@/delta
compare compacted
run resharded reshard --out @OUT@ --shards 2 @W@/full-tiny-3
compare resharded
echo "same bytes: every case"
