#!/usr/bin/env bash
# Training while saving, this tree against a baseline commit, alternated in one run.
#
#   bash benches/train_while_saving_ab.sh BASE_REV ROUNDS [bench arguments...]
#
# Builds benches/train_while_saving.rs (this tree's file, so both measure the same thing) against
# BASE_REV in a worktree and against this tree, runs the two binaries one after the other ROUNDS
# times with `--json` and the given arguments, and prints, per case (trainer threads, hot set,
# writer threads), the median of every figure for each build.
set -euo pipefail
base=${1:?usage: train_while_saving_ab.sh BASE_REV ROUNDS [bench arguments...]}
rounds=${2:?usage: train_while_saving_ab.sh BASE_REV ROUNDS [bench arguments...]}
shift 2
cd "$(dirname "$0")/.."
wt=target/ab-base
rm -rf "$wt" && git worktree prune
git worktree add -q --detach "$wt" "$base"
trap 'git worktree remove --force "$wt"' EXIT
cp benches/train_while_saving.rs "$wt/benches/"
bin() { # the bench binary cargo builds in directory $1 (target directory $2)
  (cd "$1" && CARGO_TARGET_DIR=$2 cargo bench --bench train_while_saving --no-run 2>&1) |
    sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -1
}
# The baseline's build is kept (target/ab-base-target) for the next run against the same commit.
base_bin="$(bin "$wt" "$PWD/target/ab-base-target")"
new_bin="$(bin . "$PWD/target")"
case $base_bin in /*) ;; *) base_bin="$wt/$base_bin" ;; esac
case $new_bin in /*) ;; *) new_bin="$PWD/$new_bin" ;; esac
out=target/ab-tws
rm -rf "$out" && mkdir -p "$out"
for r in $(seq "$rounds"); do
  echo "round $r of $rounds" >&2
  "$base_bin" --json "$@" >>"$out/base.jsonl"
  "$new_bin" --json "$@" >>"$out/new.jsonl"
done
head=$(git rev-parse --short HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then head="$head+changes"; fi
python3 - "$out/base.jsonl" "$out/new.jsonl" "$(git rev-parse --short "$base")" "$head" <<'EOF'
import json, statistics, sys
base, new, base_rev, head = sys.argv[1:]
def load(p):
    out = {}
    for line in open(p):
        d = json.loads(line)
        out.setdefault((d["trainers"], d["hot"], d["writers"]), []).append(d)
    return out
b, n = load(base), load(new)
keys = ["steps_ratio", "p50_out_ms", "p99_out_ms", "p99_during_ms", "p99_ratio", "blocked_ms",
        "lost_s", "stall_s", "save_s", "cow_peak_mib", "trainers_wait_s", "save_cpu_s",
        "tail_run_ms", "tail_wait_ms", "tail_asleep_ms"]
print(f"medians; baseline {base_rev} / this tree {head}")
print("| trainers | hot % | writers | " + " | ".join(keys) + " |")
print("|" + " --- |" * (3 + len(keys)))
for k in sorted(b, key=lambda k: tuple(map(str, k))):
    # A baseline built before a figure existed reports it as missing: "—".
    def cell(rows, f):
        vals = [r[f] for r in rows if f in r]
        return f"{statistics.median(vals):.3g}" if vals else "—"
    cells = [f"{cell(b[k], f)} / {cell(n.get(k, b[k]), f)}" for f in keys]
    print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
EOF
