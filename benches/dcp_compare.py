"""saver behind DCP's API against DCP's own files, on the same DTensor state dict, in one run.

Two gloo ranks on this machine hold a state dict of DTensors cut as FSDP2 cuts them (``Shard(0)``
and ``Shard(1)``, a ``Replicate``d one, a BYTE_IO item), ``--gib`` GiB in all. Each round, in
turn: ``dcp.save`` through ``saver.dcp.StorageWriter`` and through DCP's
``FileSystemWriter(thread_count=T)`` (both durable: saver fsyncs, DCP's ``sync_files``), and
``dcp.load`` through ``saver.dcp.StorageReader`` and ``FileSystemReader`` into the same state
dict, warm (every file read once first) and cold (evicted first); saver's writer and reader
get ``parallel=T``, the same thread count; and ``dcp.async_save`` through each writer (saver's
stages through its own kept copy, DCP's through a new ``DefaultStager``), timed until the call
returns (the trainer's stall), its writes awaited untimed. Rank 0 times each call between
two barriers (the whole call, every rank done). Medians after a warm-up round. Then, in one
process, ``--flips`` loads of each checkpoint with one byte flipped in one of its data files
(the byte put back after each): how many each reader caught, and how many DCP's loaded silently
wrong.

    python benches/dcp_compare.py [--gib 1.0] [--rounds 3] [--threads 2] [--flips 40] [--work DIR] [--json OUT]

``--json`` also writes the medians, the flips and the sizes for benches/report_page.py.
"""

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import page_cache  # benches/, beside this script
import saver
import saver.dcp


def state_of(gib, world, zeros=False):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    n = int(gib * (1 << 30) / 4 / 3)  # three tensors of about a third each
    cols = 1024
    g = torch.Generator().manual_seed(0)

    def make(*shape):
        return torch.zeros(*shape) if zeros else torch.randn(*shape, generator=g)

    return {
        "rows": distribute_tensor(make(n // cols, cols), mesh, [Shard(0)]),
        "cols": distribute_tensor(make(n // cols, cols), mesh, [Shard(1)]),
        "same": distribute_tensor(make(n // cols // 8, cols), mesh, [Replicate()]),
        "conv": distribute_tensor(make(n // cols // 64, 16, 8, 8), mesh, [Shard(0)]),
        "sched": {"last_epoch": 0 if zeros else 7},
    }


def _rank(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.simplefilter("ignore")
    state = state_of(args.gib, world)
    ours, theirs = os.path.join(args.work, "saver"), os.path.join(args.work, "dcp")
    def load_ours():
        dcp.load(state, storage_reader=saver.dcp.StorageReader(ours, parallel=args.threads))

    def load_theirs():
        dcp.load(state, storage_reader=dcp.FileSystemReader(theirs))

    # (call, what rank 0 does to the page cache first): a load is timed warm (every file read
    # once, untimed) and cold (evicted), for both alike; saver's writer bypasses the page cache
    # (direct I/O) where DCP's fills it, so a load right after the saves would compare a cold
    # read with a warm one.
    cases = {
        "save: saver.dcp.StorageWriter": (lambda: dcp.save(state, storage_writer=saver.dcp.StorageWriter(ours, parallel=args.threads)), None),
        "save: FileSystemWriter": (lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs, thread_count=args.threads)), None),
        "load, warm: saver.dcp.StorageReader": (load_ours, lambda: page_cache.warm([ours])),
        "load, warm: FileSystemReader": (load_theirs, lambda: page_cache.warm([theirs])),
        "load, cold: saver.dcp.StorageReader": (load_ours, lambda: page_cache.evict([ours])),
        "load, cold: FileSystemReader": (load_theirs, lambda: page_cache.evict([theirs])),
        # The trainer's stall: until the call returns (its save then ends untimed).
        "async_save blocked: saver.dcp.StorageWriter": (lambda: dcp.async_save(state, storage_writer=saver.dcp.StorageWriter(ours, parallel=args.threads)), None),
        "async_save blocked: FileSystemWriter + DefaultStager": (lambda: dcp.async_save(state, storage_writer=dcp.FileSystemWriter(theirs, thread_count=args.threads)), None),
    }
    times = {k: [] for k in cases}
    for r in range(args.rounds + 1):
        for name, (call, cache) in cases.items():
            if cache is not None and rank == 0:
                cache()
            dist.barrier()
            t = time.perf_counter()
            pending = call()
            pending = pending if hasattr(pending, "result") else None
            if pending is not None:
                # A background save: the stall is the call; its writes end before the next case.
                took = time.perf_counter() - t
                pending.result()
            dist.barrier()
            if pending is None:
                took = time.perf_counter() - t
            if r:
                times[name].append(took)
        if rank == 0:
            print(f"round {r}", file=sys.stderr)
    if rank == 0:
        torch.save(times, out)
    dist.barrier()
    dist.destroy_process_group()


def flips(args):
    """Loads of each checkpoint with one byte flipped: (caught, silently wrong) for each."""
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(2000, 512, generator=g), "v": torch.randn(300_000, generator=g), "c": torch.randn(40, 8, 8, 8, generator=g)}
    ours, theirs = os.path.join(args.work, "flip-saver"), os.path.join(args.work, "flip-dcp")
    dcp.save(state, storage_writer=saver.dcp.StorageWriter(ours))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs))
    rng = random.Random(2)
    out = {}
    for name, root, reader, pattern in (("saver.dcp", ours, saver.dcp.StorageReader, ".safetensors"), ("DCP", theirs, dcp.FileSystemReader, ".distcp")):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(pattern))
        caught = wrong = 0
        for _ in range(args.flips):
            f = rng.choice(files)
            size = os.path.getsize(f)
            at = rng.randrange(size // 8, size)  # past the header: a flip of the data
            with open(f, "r+b") as h:
                h.seek(at)
                b = h.read(1)
                h.seek(at)
                h.write(bytes([b[0] ^ 0x04]))
            back = {k: torch.zeros_like(v) for k, v in state.items()}
            try:
                dcp.load(back, storage_reader=reader(root))
                if not all(torch.equal(back[k], state[k]) for k in state):
                    wrong += 1
            except BaseException:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
                caught += 1
            with open(f, "r+b") as h:
                h.seek(at)
                h.write(b)
        out[name] = (caught, wrong)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flips", type=int, default=40)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="dcp-compare-")
    os.makedirs(args.work, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(args.work, "times.pt")
    mp.spawn(_rank, args=(2, port, args, out), nprocs=2, join=True)
    times = torch.load(out)
    med = {k: statistics.median(v) for k, v in times.items()}
    caught = flips(args)
    print(f"# saver behind DCP's API, {args.gib:.2f} GiB of DTensors at 2 ranks, {args.threads} threads, {args.rounds} rounds, medians\n")
    print("| call | seconds | / DCP's own |")
    print("| --- | --- | --- |")
    for k, v in med.items():
        kind = k.split(":")[0]
        base = med[kind + ": " + ("FileSystemWriter + DefaultStager" if kind.startswith("async") else "FileSystemWriter" if kind == "save" else "FileSystemReader")]
        print(f"| {k} | {v:.3f} | {v / base:.3f} |")
    print("\n| reader | flipped bytes caught | loaded silently wrong | of |\n| --- | --- | --- | --- |")
    for k, (c, w) in caught.items():
        print(f"| {k} | {c} | {w} | {args.flips} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "threads": args.threads, "rounds": args.rounds, "world": 2, "medians": med,
                       "flips": {k: {"caught": c, "wrong": w, "of": args.flips} for k, (c, w) in caught.items()}}, f, indent=1)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
