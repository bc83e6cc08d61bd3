#!/usr/bin/env bash
# `saver save --from` a plain safetensors model (durable) against `cp` + `sync` of the same file,
# alternated N rounds in one run, the page cache warmed before each command; prints each round
# and the medians. With a second binary, it is timed in the same rounds (before/after).
# For docs/benchmarks/HISTORY.md ("Every command streams").
#
#   bash benches/streaming/import_vs_copy.sh SAVER MODEL.safetensors WORK_DIR N [OTHER_SAVER]
#
# WORK_DIR is scratch: the script overwrites and deletes ck, cp.out, cp.t, new.t and old.t in it.
set -euo pipefail
new="$(realpath "$1")"; model="$(realpath "$2")"; work="$3"; n="$4"; old="${5:+$(realpath "$5")}"
mkdir -p "$work"; cd "$work"
warm() { rm -rf ck cp.out; sync; cat "$model" > /dev/null; }
secs() { local s e; s=$(date +%s.%N); "$@" > /dev/null 2>&1 || { echo "failed: $*" >&2; exit 1; }; e=$(date +%s.%N); echo "$e - $s" | bc; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
: > cp.t; : > new.t; : > old.t
for i in $(seq "$n"); do
  warm; c=$(secs sh -c "cp '$model' cp.out && sync"); echo "$c" >> cp.t
  warm; a=$(secs "$new" save --from "$model" --out ck --shards 4); echo "$a" >> new.t
  line="round $i: cp+sync $c s, save --from $a s"
  if [ -n "$old" ]; then
    warm; b=$(secs "$old" save --from "$model" --out ck --shards 4); echo "$b" >> old.t
    line="$line, other $b s"
  fi
  echo "$line"
done
warm
c=$(median < cp.t); a=$(median < new.t)
echo "median: cp+sync $c s, save --from $a s, ratio $(echo "scale=2; $a / $c" | bc)"
if [ -n "$old" ]; then b=$(median < old.t); echo "median: other $b s, ratio $(echo "scale=2; $b / $c" | bc)"; fi
rm -f cp.t new.t old.t
