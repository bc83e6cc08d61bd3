"""Benchmarks of the Python package, in one run: saves and loads of the same numpy arrays by
saver, by the `saver` binary, by safetensors' numpy API and (if torch is importable) by PyTorch
DCP, alternated, medians.

    python python/bench.py --saver-bin target/release/saver [--rows N] [--dim D] [--runs R]

The model: one table of N ids with an f32 embedding and an f32 Adagrad slot of width D each, and
a 64 MiB dense tensor. Every save is durable (data and directory synced) and timed whole:
``saver.save`` and ``safetensors.numpy.save_file`` + fsync at the Python call, the binary's
``saver save --from`` (of a plain safetensors file holding the same arrays, in the page cache) as
a process, DCP's ``save`` at the call. Loads are from the page cache (each file was just written
or read): ``saver.load`` into arrays, ``safetensors.numpy.load_file`` of the plain file, and a
plain read of the plain file's bytes into fresh memory (``numpy.fromfile``), the floor.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np
import safetensors.numpy

import saver


def fsync_tree(path):
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def timed(f):
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--saver-bin", required=True)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    a = p.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="saver-pybench-")
    os.makedirs(work, exist_ok=True)
    rng = np.random.default_rng(1)
    ids = rng.choice(2**48, size=a.rows, replace=False).astype(np.int64)
    emb = rng.standard_normal((a.rows, a.dim)).astype(np.float32)
    ada = rng.random((a.rows, a.dim)).astype(np.float32)
    w = rng.standard_normal((4096, 4096)).astype(np.float32)
    tables = {"user": {"ids": ids, "embedding": emb, "adagrad": ada}}
    dense = {"mlp.w": w}
    plain = {"user/ids": ids, "user/embedding": emb, "user/adagrad": ada, "mlp.w": w}
    total = sum(v.nbytes for v in plain.values())
    plain_dir = os.path.join(work, "plain")
    os.makedirs(plain_dir, exist_ok=True)
    plain_file = os.path.join(plain_dir, "model.safetensors")
    safetensors.numpy.save_file(plain, plain_file)
    try:
        import torch
        import torch.distributed.checkpoint as dcp

        state = {k: torch.from_numpy(v) for k, v in plain.items()}
    except ImportError:
        dcp = None

    def out(name):
        d = os.path.join(work, name)
        shutil.rmtree(d, ignore_errors=True)
        return d

    def st_save():
        d = out("st")
        os.makedirs(d)
        safetensors.numpy.save_file(plain, os.path.join(d, "model.safetensors"))
        fsync_tree(d)

    saves = {
        "saver.save": lambda: saver.save(out("py"), tables=tables, dense=dense),
        "saver save --from (binary)": lambda: subprocess.run(
            [a.saver_bin, "save", "--out", out("cli"), "--from", plain_dir], check=True, capture_output=True
        ),
        "safetensors.numpy.save_file + fsync": st_save,
    }
    if dcp is not None:
        saves["DCP save"] = lambda: dcp.save(state, checkpoint_id=out("dcp"), no_dist=True)
    loads = {
        "saver.load": lambda: saver.load(os.path.join(work, "py")),
        "safetensors.numpy.load_file": lambda: safetensors.numpy.load_file(plain_file),
        "plain read (numpy.fromfile)": lambda: np.fromfile(plain_file, dtype=np.uint8),
    }
    times = {k: [] for k in list(saves) + list(loads)}
    for r in range(a.runs):
        for k, f in saves.items():
            times[k].append(timed(f))
        for k, f in loads.items():
            f()  # the file in the page cache, as for every tool
            times[k].append(timed(f))
    med = {k: statistics.median(v) for k, v in times.items()}
    gib = total / 2**30
    print(f"{a.rows} rows x 2 slots of {a.dim} f32 + 64 MiB dense = {gib:.2f} GiB; medians of {a.runs} alternated runs")
    print("| operation | seconds | GiB/s | its time ÷ saver's |")
    print("| --- | --- | --- | --- |")
    base = med["saver.save"]
    for k in saves:
        print(f"| {k} | {med[k]:.3f} | {gib / med[k]:.2f} | {med[k] / base:.2f} |")
    base = med["saver.load"]
    for k in loads:
        print(f"| {k} | {med[k]:.3f} | {gib / med[k]:.2f} | {med[k] / base:.2f} |")
    if a.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
