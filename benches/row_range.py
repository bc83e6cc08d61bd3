"""Row-range tables against the plain limit and torch.save / torch.load, on one model, in one run.

The model is DLRM-like: 6 embedding tables of 3.76 M rows of dimension 32 in all (float32), each
with its Adagrad state (`sum`, the same shape): 0.9 GiB. Every round runs every operation once,
in turn, so that a noisy minute hits all of them alike; the figures are medians over the rounds,
each as a ratio to the limit measured in the same rounds:

- durable save: saver.save of the tables as chunks (fsync, direct I/O where it can) against a
  plain O_DIRECT write of the same bytes from aligned 8 MiB buffers, one thread per core, with
  fsync (the limit), and torch.save of the same state_dict followed by fsync (the same
  durability);
- restore into the model: saver.load(into=...) filling freshly allocated tensors against a plain
  read of the same bytes into new memory, one thread per core (the limit), and torch.load of the
  torch.save file,
  with the files in the page cache (warm: each read once, untimed, before) and evicted from it
  first (cold: posix_fadvise DONTNEED on every file of the three). On this virtual machine a
  file evicted from its page cache is often still in the host's, so "cold" reads here run at
  2-3 GB/s rather than at the disk's speed;
- a load into another column cut: the same checkpoint read as 4 column shards (4 loads, as the
  ranks of a column-wise plan read a table-wise checkpoint), warm, against the whole restore;
- a resharding load, saved by 2 writers' row halves and read by 3 workers' row thirds: the bytes
  read over the bytes kept;
- a step that changed 1 % of the rows (weight and sum), saved as a delta of the step before
  against a full save of it: seconds and bytes on disk; and the warm restore of the chain
  against that of the full checkpoint.

Usage (from the repository root; python/tests/run.sh makes the venv, with torch, and builds the
package; `maturin develop --release` in python/ for figures worth keeping):

    $VENV/bin/python benches/row_range.py --rounds 5 [--scale 0.1] [--json out.json]

It prints a table; docs/benchmarks/HISTORY.md records it with the command and the commit.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np
import torch

import saver
from page_cache import evict, files_under, fsync_path, warm

MIB = 1 << 20
TABLE_ROWS = [1_500_000, 1_000_000, 600_000, 400_000, 200_000, 60_000]
DIM = 32


def model(scale):
    g = torch.Generator().manual_seed(5)
    tables = {}
    for t, rows in enumerate(TABLE_ROWS):
        rows = max(1, int(rows * scale))
        tables[f"t{t}"] = {
            "weight": torch.randn(rows, DIM, generator=g),
            "sum": torch.rand(rows, DIM, generator=g),
        }
    return tables


def nbytes(tables):
    return sum(a.numel() * a.element_size() for t in tables.values() for a in t.values())


THREADS = os.cpu_count() or 1


def limit_write(tables, path):
    """The fastest plain durable write here: the same bytes with O_DIRECT (each array starting
    on a 4 KiB boundary of the file, so under 4 KiB of padding an array), from aligned 8 MiB
    buffers, one thread per core writing every other piece with positional writes, then
    fsync."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    # (file offset, source, start, length) of every 8 MiB piece.
    pieces, at = [], 0
    for t in tables.values():
        for a in t.values():
            src = a.numpy().reshape(-1).view(np.uint8)
            for start in range(0, len(src), 8 * MIB):
                n = min(8 * MIB, len(src) - start)
                pieces.append((at + start, src, start, n))
            at += (len(src) + 4095) // 4096 * 4096

    def write(k, fd):
        buf = mmap.mmap(-1, 8 * MIB)
        staged = np.frombuffer(buf, dtype=np.uint8)
        view = memoryview(buf)
        for off, src, start, n in pieces[k::THREADS]:
            staged[:n] = src[start:start + n]
            os.pwrite(fd, view[: (n + 4095) // 4096 * 4096], off)

    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(lambda k: write(k, fd), range(THREADS)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def limit_read(path, n):
    """The fastest plain read here of the same bytes into new memory: one thread per core, each
    reading its part with positional reads. The memory is allocated (not touched) before the
    timer by torch, as saver's targets are: on this virtual machine the first touch of memory
    the process has not used lately costs up to 2 s per GiB, which would otherwise land on one
    side only (numpy's fresh arrays took it, torch's reused ones did not)."""
    from concurrent.futures import ThreadPoolExecutor

    out = torch.empty(n, dtype=torch.uint8).numpy()
    view = memoryview(out)
    part = (n + THREADS - 1) // THREADS

    def read(k, fd):
        at, end = k * part, min(n, (k + 1) * part)
        while at < end:
            got = os.preadv(fd, [view[at:min(end, at + 64 * MIB)]], at)
            if not got:
                break
            at += got

    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(lambda k: read(k, fd), range(THREADS)))
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def saver_save(tables, path):
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    saver.save(path, tables={name: {s: saver.Chunk(a) for s, a in t.items()} for name, t in tables.items()})
    return time.perf_counter() - t0


def saver_load(tables, path):
    # A restart's model: fresh tensors of the right shapes, filled in place.
    fresh = {name: {s: torch.empty_like(a) for s, a in t.items()} for name, t in tables.items()}
    t0 = time.perf_counter()
    saver.load(path, dense=False, into={name: {s: saver.Chunk(a) for s, a in t.items()} for name, t in fresh.items()})
    seconds = time.perf_counter() - t0
    return seconds, fresh


def saver_load_columns(tables, path, shards=4):
    """The model's tables read as 4 column shards (as 4 ranks of a column-wise plan read a
    table-wise checkpoint), one load each into fresh tensors, timed together: a column slice
    reads its rows whole and scatters the columns."""
    fresh = [{name: {s: torch.empty(a.shape[0], a.shape[1] // shards, dtype=a.dtype) for s, a in t.items()}
              for name, t in tables.items()} for _ in range(shards)]
    t0 = time.perf_counter()
    for j, part in enumerate(fresh):
        into = {name: {s: saver.Chunk(a, offset=(0, j * a.shape[1])) for s, a in t.items()} for name, t in part.items()}
        saver.load(path, dense=False, into=into)
    seconds = time.perf_counter() - t0
    return seconds, fresh


def torch_save(tables, path):
    state = {f"{name}.{s}": a for name, t in tables.items() for s, a in t.items()}
    t0 = time.perf_counter()
    torch.save(state, path)
    fsync_path(path)
    return time.perf_counter() - t0


def torch_load(path):
    t0 = time.perf_counter()
    state = torch.load(path)
    return time.perf_counter() - t0, state


def reshard(tables, path):
    """Saved by 2 writers (row halves), read by 3 workers (row thirds): bytes read / kept."""
    shutil.rmtree(path, ignore_errors=True)
    for j in range(2):
        mine = {}
        for name, t in tables.items():
            rows = next(iter(t.values())).shape[0]
            a, b = rows * j // 2, rows * (j + 1) // 2
            mine[name] = {s: saver.Chunk(x[a:b], offset=(a, 0), shape=tuple(x.shape)) for s, x in t.items()}
        saver.save(path, tables=mine, shards=2, shard_index=j, save_id="reshard-2")
    read = wanted = 0
    for j in range(3):
        into = {}
        for name, t in tables.items():
            rows = next(iter(t.values())).shape[0]
            a, b = rows * j // 3, rows * (j + 1) // 3
            into[name] = {s: saver.Chunk(torch.empty(b - a, x.shape[1]), offset=(a, 0)) for s, x in t.items()}
        r = saver.load(path, dense=False, into=into).report["row_tables"]
        read += r["bytes_read"]
        wanted += r["bytes_wanted"]
    return read / wanted


def dir_bytes(path):
    return sum(os.path.getsize(f) for f in files_under(path))


def deltas(tables, work, rounds):
    """A step that changed 1 % of every table's rows (weight and sum), saved as a delta of the
    step before (read from the disk, evicted from the page cache first, as a save with direct
    I/O leaves it) and as a full checkpoint, alternated; then restored warm from each: seconds
    and bytes on disk."""
    base = os.path.join(work, "delta-base")
    saver_save(tables, base)
    g = torch.Generator().manual_seed(9)
    changed = {}
    for name, t in tables.items():
        rows = next(iter(t.values())).shape[0]
        idx = torch.randint(rows, (max(1, rows // 100),), generator=g)
        changed[name] = {}
        for s, a in t.items():
            c = a.clone()
            c[idx] += 1.0
            changed[name][s] = c
    full, delta = os.path.join(work, "delta-full"), os.path.join(work, "delta")
    got = {"full_save": [], "delta_save": [], "full_load": [], "delta_load": []}
    for r in range(rounds + 1):
        t_full = saver_save(changed, full)
        shutil.rmtree(delta, ignore_errors=True)
        # The parent as a trainer's last save leaves it: written with direct I/O, not cached.
        evict([base])
        t0 = time.perf_counter()
        saver.save(delta, tables={n: {s: saver.Chunk(a) for s, a in t.items()} for n, t in changed.items()}, parent=base)
        t_delta = time.perf_counter() - t0
        warm([base, full, delta])
        l_full, _ = saver_load(changed, full)
        l_delta, loaded = saver_load(changed, delta)
        if r == 0:
            for name, t in changed.items():
                for s, a in t.items():
                    assert torch.equal(loaded[name][s], a), (name, s)
        del loaded
        if r > 0:
            for k, v in (("full_save", t_full), ("delta_save", t_delta), ("full_load", l_full), ("delta_load", l_delta)):
                got[k].append(v)
        print(f"delta round {r}: full save {t_full:.3f}s, delta save {t_delta:.3f}s, full load {l_full:.3f}s, chain load {l_delta:.3f}s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in got.items()}
    med["full_bytes"], med["delta_bytes"] = dir_bytes(full), dir_bytes(delta)
    return med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--work", default=os.path.join("target", "bench-scratch", "row-range"))
    ap.add_argument("--json")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    tables = model(args.scale)
    n = nbytes(tables)
    paths = {
        "limit": os.path.join(args.work, "limit.bin"),
        "saver": os.path.join(args.work, "saver"),
        "torch": os.path.join(args.work, "model.pt"),
    }
    times = {k: [] for k in ["limit_write", "saver_save", "torch_save",
                             "limit_read_warm", "saver_load_warm", "torch_load_warm",
                             "limit_read_cold", "saver_load_cold", "torch_load_cold", "saver_load_columns_warm"]}
    for r in range(args.rounds + 1):  # the first round warms up and is not kept
        got = {
            "limit_write": limit_write(tables, paths["limit"]),
            "saver_save": saver_save(tables, paths["saver"]),
            "torch_save": torch_save(tables, paths["torch"]),
        }
        for cache in ("warm", "cold"):
            if cache == "warm":
                # Saves written with direct I/O leave nothing in the page cache: read every
                # file once, untimed, so that every reader finds all of its bytes there.
                warm(paths.values())
            if cache == "cold":
                evict(paths.values())
            got[f"limit_read_{cache}"] = limit_read(paths["limit"], n)
            if cache == "cold":
                evict(paths.values())
            seconds, loaded = saver_load(tables, paths["saver"])
            got[f"saver_load_{cache}"] = seconds
            if r == 0:
                for name, t in tables.items():
                    for s, a in t.items():
                        assert torch.equal(loaded[name][s], a), (name, s)
            del loaded
            if cache == "warm":
                seconds, parts = saver_load_columns(tables, paths["saver"])
                got["saver_load_columns_warm"] = seconds
                if r == 0:
                    for name, t in tables.items():
                        for s, a in t.items():
                            assert torch.equal(torch.cat([p[name][s] for p in parts], dim=1), a), (name, s)
                del parts
            if cache == "cold":
                evict(paths.values())
            seconds, state = torch_load(paths["torch"])
            got[f"torch_load_{cache}"] = seconds
            del state
        if r > 0:
            for k, v in got.items():
                times[k].append(v)
        print(f"round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(f"{k} {v:.3f}s" for k, v in got.items()), file=sys.stderr)
    amplification = reshard(tables, os.path.join(args.work, "reshard"))
    delta = deltas(tables, args.work, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    gib = n / (1 << 30)
    rows = [
        ("durable save", "saver.save", med["saver_save"], med["limit_write"], "O_DIRECT write + fsync", med["torch_save"], "torch.save + fsync"),
        ("restore, warm", "saver.load(into=)", med["saver_load_warm"], med["limit_read_warm"], "read into new memory", med["torch_load_warm"], "torch.load"),
        ("restore, cold", "saver.load(into=)", med["saver_load_cold"], med["limit_read_cold"], "read into new memory", med["torch_load_cold"], "torch.load"),
    ]
    print(f"model: {gib:.2f} GiB ({len(tables)} tables of dim {DIM}, weight + Adagrad sum), {args.rounds} rounds, medians")
    print("| operation | saver | limit | saver's speed / limit's | torch | saver's speed / torch's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for what, _, s, lim, lim_name, peer, peer_name in rows:
        print(f"| {what} | {s:.3f} s | {lim:.3f} s ({lim_name}) | {lim / s:.2f} | {peer:.3f} s ({peer_name}) | {peer / s:.2f} |")
    print(f"| resharding load 2 -> 3 workers | bytes read / bytes kept: {amplification:.4f} | | | | |")
    print()
    print("A load into another column cut (4 column shards, 4 loads, warm) against the whole restore (warm):")
    print("| | 4 column shards | whole | columns / whole |")
    print("| --- | --- | --- | --- |")
    print(f"| restore, warm | {med['saver_load_columns_warm']:.3f} s | {med['saver_load_warm']:.3f} s | {med['saver_load_columns_warm'] / med['saver_load_warm']:.2f} |")
    print()
    print("A step that changed 1 % of the rows, as a delta of the step before and as a full save:")
    print("| | delta | full | delta / full |")
    print("| --- | --- | --- | --- |")
    print(f"| durable save | {delta['delta_save']:.3f} s | {delta['full_save']:.3f} s | {delta['delta_save'] / delta['full_save']:.3f} |")
    print(f"| bytes on disk | {delta['delta_bytes'] / MIB:.1f} MiB | {delta['full_bytes'] / MIB:.1f} MiB | {delta['delta_bytes'] / delta['full_bytes']:.4f} |")
    print(f"| restore, warm (the chain of 2 / one checkpoint) | {delta['delta_load']:.3f} s | {delta['full_load']:.3f} s | {delta['delta_load'] / delta['full_load']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": n, "medians": med, "rounds": times, "reshard_read_amplification": amplification, "delta": delta}, f, indent=1)


if __name__ == "__main__":
    main()
