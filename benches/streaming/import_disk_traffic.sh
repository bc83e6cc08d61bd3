#!/usr/bin/env bash
# Where a durable `saver save --from` of a plain safetensors model spends the disk, against `cp` +
# `sync` of the same file (docs/benchmarks/HISTORY.md, "Every command streams"). For each command it
# prints the wall time and the bytes the output's block device wrote (/proc/diskstats), with the
# page cache warmed first; then it times two buffered writers of SIZE MiB each into files of WORK_DIR
# (`dd`), once at SIZE/2 and once at SIZE, which shows the kernel's dirty-page throttling: past
# vm.dirty_ratio of the memory, a buffered writer runs at the disk's speed, not the memory's.
#
#   bash benches/streaming/import_disk_traffic.sh SAVER MODEL.safetensors WORK_DIR [SIZE_MIB]
#
# WORK_DIR is scratch: the script overwrites and deletes ck, cp.out, a and b in it.
set -euo pipefail
bin="$(realpath "$1")"; model="$(realpath "$2")"; work="$3"; size="${4:-3072}"
mkdir -p "$work"; cd "$work"
dev=$(df --output=source . | tail -1 | sed 's|^/dev/||')
sectors() {
  # Sectors written by the filesystem's device; 0 when /proc/diskstats does not list it (a
  # device-mapper volume or a network filesystem: then the byte counts mean nothing).
  awk -v d="$dev" '$3 == d { print $10; found = 1 } END { if (!found) print 0 }' /proc/diskstats
}
run() {
  local what=$1; shift
  rm -rf ck cp.out; sync; cat "$model" > /dev/null
  local w0 s e w1
  w0=$(sectors); s=$(date +%s.%N)
  "$@" > /dev/null 2>&1 || { echo "failed: $*" >&2; exit 1; }
  sync; e=$(date +%s.%N); w1=$(sectors)
  printf '%-28s %6.2f s, %6d MiB written to %s\n' "$what" "$(echo "$e - $s" | bc)" \
    $(((w1 - w0) / 2048)) "$dev"
}
echo "model: $(($(stat -c %s "$model") >> 20)) MiB; vm.dirty_background_ratio $(cat /proc/sys/vm/dirty_background_ratio), vm.dirty_ratio $(cat /proc/sys/vm/dirty_ratio)"
run "cp + sync" sh -c "cp '$model' cp.out"
run "save --from (durable)" "$bin" save --from "$model" --out ck --shards 4
rm -rf ck cp.out
for mib in $((size / 2)) "$size"; do
  sync; s=$(date +%s.%N)
  dd if=/dev/zero of=a bs=128K count=$((mib * 8)) status=none &
  dd if=/dev/zero of=b bs=128K count=$((mib * 8)) status=none &
  wait; e=$(date +%s.%N)
  printf 'two buffered writers of %5d MiB each: %5.2f s (before their sync)\n' "$mib" "$(echo "$e - $s" | bc)"
  rm -f a b; sync
done
