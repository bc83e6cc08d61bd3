#!/usr/bin/env bash
# The 6 GiB before/after table of docs/benchmarks/HISTORY.md ("Every command streams"): each binary's
# save --from, digest, reshard, export and verify of one plain model, with a cp + sync of the
# model before each half.
#
#   bash benches/streaming/before_after.sh NEW_SAVER OLD_SAVER MODEL.safetensors WORK_DIR
set -u
new="$(realpath "$1")"; old="$(realpath "$2")"; model="$(realpath "$3")"; work="$4"
mkdir -p "$work"; cd "$work"
m() { local l="$1"; shift; sync; /usr/bin/time -f "$l %e s %M KB" "$@" > /dev/null 2>> ab.log || echo "$l FAILED" >> ab.log; tail -1 ab.log; }
for who in new old; do
  b="$new"; [ "$who" = old ] && b="$old"
  rm -rf "ck_$who" "ck3_$who" "ex_$who" cp.out
  m "$who cp+sync" sh -c "cp '$model' cp.out && sync"; rm -f cp.out
  m "$who save--from" "$b" save --from "$model" --out "ck_$who" --shards 4 --no-fsync
  m "$who digest" "$b" digest "ck_$who"
  m "$who reshard" "$b" reshard "ck_$who" --out "ck3_$who" --shards 3 --no-fsync
  m "$who export" "$b" export "ck_$who" --out "ex_$who"
  m "$who verify" "$b" verify "ck_$who"
  rm -rf "ck_$who" "ck3_$who" "ex_$who"
done
