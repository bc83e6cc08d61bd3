#!/usr/bin/env bash
# usage: save_race.sh SAVER_BINARY ROUNDS [--overwrite] -> rounds where both committed, where the dir failed verify
B=$1; R=$2; OW=${3:-}; both=0; broken=0; root=$(mktemp -d)
for r in $(seq 1 $R); do
  D=$root/r$r
  [ -n "$OW" ] && $B save --out $D --synthetic "tables=2,rows=2000,dim=8,seed=9" --no-fsync >/dev/null
  $B save --out $D --synthetic "tables=2,rows=2000,dim=8,seed=1" --no-fsync $OW >/dev/null 2>&1 & p1=$!
  $B save --out $D --synthetic "tables=2,rows=2000,dim=8,seed=2" --no-fsync $OW >/dev/null 2>&1 & p2=$!
  wait $p1; a=$?; wait $p2; b=$?
  [ $a = 0 ] && [ $b = 0 ] && both=$((both+1))
  $B verify $D >/dev/null 2>&1 || broken=$((broken+1))
done
echo "rounds $R, both reported success $both, directory failed verify $broken"
