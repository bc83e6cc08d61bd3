"""How long ``saver.Manager.save_async`` holds the Python caller, for a full save and for a delta
(a numpy table keeps no record of its changes, so a delta compares its rows with the parent's),
against the blocking ``Manager.save`` of the same step and a plain numpy copy of the same arrays
(what any background save must at least do before it returns). Saves alternated, medians.

    python python/bench_stall.py [--rows 1000000] [--runs 5]

Build the package with ``maturin develop --release`` first: a debug build's copies and
comparisons are several times slower.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import saver


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    n = args.rows
    ids = np.arange(n, dtype=np.int64)
    emb = np.random.default_rng(7).random((n, 32), dtype=np.float32)
    ada = np.zeros((n, 32), dtype=np.float32)
    tables = {"t": {"ids": ids, "embedding": emb, "adagrad": ada}}
    work = tempfile.mkdtemp(prefix="saver-bench-stall-")
    times = {k: [] for k in ("copy", "async full", "async delta", "blocking full", "blocking delta")}
    try:
        for rnd in range(args.runs + 1):
            for full in (True, False):
                for background in (True, False):
                    root = os.path.join(work, f"r{rnd}-{full}-{background}")
                    m = saver.Manager(root, full_every=8, max_chain_links=8, keep_latest=8)
                    m.save(0, tables=tables)
                    # 1 % of the rows change before the step saved.
                    emb[rnd * 1000 : rnd * 1000 + n // 100] += 1.0
                    t = time.perf_counter()
                    if background:
                        m.save_async(1, tables=tables, full=full)
                        held = time.perf_counter() - t
                        report = m.wait()
                    else:
                        report = m.save(1, tables=tables, full=full)
                        held = time.perf_counter() - t
                    assert (report.full_because is None) != full, report
                    if rnd > 0:
                        kind = ("async " if background else "blocking ") + ("full" if full else "delta")
                        times[kind].append(held)
                    shutil.rmtree(root)
            t = time.perf_counter()
            copy = [ids.copy(), emb.copy(), ada.copy()]
            if rnd > 0:
                times["copy"].append(time.perf_counter() - t)
            del copy
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"## Manager.save_async from Python: {n} rows of 256 bytes, medians of {args.runs} rounds\n")
    print("| save | the caller is held | blocking save | a numpy copy of the arrays |")
    print("| --- | --- | --- | --- |")
    for kind in ("full", "delta"):
        print(
            f"| {kind} | {med['async ' + kind] * 1e3:.0f} ms | {med['blocking ' + kind] * 1e3:.0f} ms "
            f"| {med['copy'] * 1e3:.0f} ms |"
        )


if __name__ == "__main__":
    main()
