#!/usr/bin/env bash
# usage: verify_race.sh SAVER_BINARY OVERWRITES -> "verifies N, false-corrupt M"
B=$1; N=$2; D=$(mktemp -d)/ck
$B save --out $D --synthetic "tables=2,rows=2000,dim=8,dense=64KiB,seed=0" --no-fsync >/dev/null
( for i in $(seq 1 $N); do $B save --out $D --synthetic "tables=2,rows=2000,dim=8,dense=64KiB,seed=$((i%2))" --no-fsync --overwrite --shards 3 >/dev/null 2>&1; done; touch $D.done ) &
v=0; bad=0
while [ ! -e $D.done ]; do $B verify $D >/dev/null 2>&1 || bad=$((bad+1)); v=$((v+1)); done
wait; echo "verifies $v, failed $bad"
