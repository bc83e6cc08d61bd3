"""saver.torch against DCP on a TorchRec model, in one run: the DLRM-like tables of
benches/row_range.py (6 tables, 3.76 M rows of dimension 32 at scale 1) in an
EmbeddingBagCollection under DistributedModelParallel on CPU (gloo, 2 ranks, table-wise), with
fused row-wise Adagrad.

Each operation is timed on every rank between two barriers (the slowest rank's time is the
job's), once per round, in turn; medians over the rounds:

- blocking save: `saver.torch.save(path, model)` against TorchRec's DCP recipe, `dcp.save` of
  `{"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}`;
- restore into the same model, warm (files read once before) and cold (evicted first):
  `saver.torch.load` against `dcp.load` of the same dict, then `load_state_dict` of both;
- resharding load: the checkpoints saved by 2 ranks loaded by 3 ranks, table-wise (a plan of
  3 that keeps each table whole), and column-wise (a plan change: every table cut into 4 column
  shards of 8 columns, each rank reading some columns of every row; DCP's load of the fused
  row-wise state refuses the new cut, so DCP restores the weights alone there, saver.torch the
  weights and the state converted to the new cut);
- the limit of a restore (benches/plain_limit.py): each rank's own bytes (its shards of the
  weights and of the fused optimizer's state) read from a plain file of its own into the same
  tensors, a thread a core, warm and cold. (Saves have none here: saver's save of 2 ranks beat
  the plain ways of benches/plain_limit.py, so they are no limit; see docs/BENCHMARKS.md);
- peak memory: the growth of each rank's peak resident set during an operation, less the file
  pages it mapped (a library's code used for the first time), the largest rank's: in round 0
  (the first save and the first restore of the process) and in the rounds after (medians).

Usage (from the repository root, with the Python suite's venv, which has TorchRec):

    $VENV/bin/python benches/torchrec_peers.py --rounds 3 [--scale 0.25]
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torchrec
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import plain_limit
import saver
import saver.torch
from page_cache import evict, warm

TABLE_ROWS = [1_500_000, 1_000_000, 600_000, 400_000, 200_000, 60_000]
DIM = 32


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model(world, scale, sharding="table_wise"):
    configs = [
        torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=max(1, int(r * scale)), feature_names=[f"f{i}"])
        for i, r in enumerate(TABLE_ROWS)
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    # Column-wise: 4 shards of 8 columns a table, spread over the ranks.
    cut = dict(min_partition=DIM // 4) if sharding == "column_wise" else {}
    constraints = {f"t{i}": ParameterConstraints(sharding_types=[sharding], **cut) for i in range(len(TABLE_ROWS))}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(ebc, [EmbeddingBagCollectionSharder()], dist.GroupMember.WORLD)
    return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan)


def disk_bytes(path):
    """Bytes of the files under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


MEMORY = {}  # the operation's name: this rank's memory growth (see `timed`)


def timed(f, name):
    """Seconds `f` takes on the slowest rank; the growth of this rank's peak resident set
    (VmHWM, reset first) during it, less the file pages it mapped (a library's code used for the
    first time), goes to MEMORY[name]."""
    with open("/proc/self/clear_refs", "w") as c:
        c.write("5")
    base, files = status("VmRSS:"), status("RssFile:")
    dist.barrier()
    t0 = time.perf_counter()
    f()
    dist.barrier()
    seconds = time.perf_counter() - t0
    MEMORY[name] = max(0, status("VmHWM:") - base - (status("RssFile:") - files))
    return seconds


def local_tensors(m):
    """What a rank's save writes and its restore fills: its shards of the tables' weights and of
    their fused optimizer state (views of the model's own memory)."""
    out = []

    def walk(v):
        if isinstance(v, ShardedTensor):
            out.extend(s.tensor for s in v.local_shards())
        elif torch.is_tensor(v):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(m.state_dict())
    walk(m.fused_optimizer.state_dict()["state"])
    return out


def dcp_state(m):
    return {"model": m.state_dict(), "optim": m.fused_optimizer.state_dict()}


def dcp_restore(m, path):
    sd = dcp_state(m)
    dcp.load(sd, checkpoint_id=path)
    m.load_state_dict(sd["model"])
    m.fused_optimizer.load_state_dict(sd["optim"])


def dcp_restore_weights(m, path):
    """DCP's restore of the weights alone: its load of the fused row-wise state (a value a row
    per column shard) into a plan of other column cuts refuses the new shape."""
    sd = {"model": m.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    m.load_state_dict(sd["model"])


def rank_main(rank, world, port, args, phase, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    times = {}
    ok = False
    try:
        m = model(world, args.scale, "column_wise" if phase == "replan" else "table_wise")
        work = args.work
        s_path, d_path = os.path.join(work, "saver"), os.path.join(work, "dcp")
        # The limit of a restore: each rank's own bytes read from a plain file of its own.
        l_dir = os.path.join(work, "limit")
        l_path, local = os.path.join(l_dir, f"rank-{rank}.bin"), local_tensors(m)
        if phase == "main":
            for r in range(args.rounds + 1):
                got = {}
                if rank == 0:
                    shutil.rmtree(s_path, ignore_errors=True)
                    shutil.rmtree(d_path, ignore_errors=True)
                    os.makedirs(l_dir, exist_ok=True)
                got["save saver"] = timed(lambda: saver.torch.save(s_path, m), "save saver")
                got["save dcp"] = timed(lambda: dcp.save(dcp_state(m), checkpoint_id=d_path), "save dcp")
                if r == 0:
                    # The file the limit reads: each rank's bytes, durable.
                    plain_limit.write(local, l_path, ways=(False,))
                for cache in ("warm", "cold"):
                    for who, path, f in (("saver", s_path, lambda: saver.torch.load(s_path, m)), ("dcp", d_path, lambda: dcp_restore(m, d_path)),
                                         ("limit", l_dir, lambda: plain_limit.read(local, l_path))):
                        if rank == 0:
                            (warm if cache == "warm" else evict)([path])
                        got[f"load {who} {cache}"] = timed(f, f"load {who} {cache}")
                # Peak memory of the job: the largest rank's, first in the process and after.
                grown = [None] * world
                dist.all_gather_object(grown, dict(MEMORY))
                for k in [k for k in got if k in MEMORY]:
                    got[f"mem {k}" if r > 0 else f"first mem {k}"] = max(g[k] for g in grown)
                if r > 0:
                    for k, v in got.items():
                        times.setdefault(k, []).append(v)
                else:
                    times.update({k: [v] for k, v in got.items() if k.startswith("first mem")})
        else:  # a plan of `world` ranks reads what 2 ranks saved
            for r in range(args.rounds + 1):
                got = {}
                dcp_f = dcp_restore_weights if phase == "replan" else dcp_restore
                for who, path, f in (("saver", s_path, lambda: saver.torch.load(s_path, m)), ("dcp", d_path, lambda: dcp_f(m, d_path))):
                    if rank == 0:
                        warm([path])
                    key = "replan" if phase == "replan" else "reshard"
                    got[f"{key} {who}"] = timed(f, f"{key} {who}")
                if r > 0:
                    for k, v in got.items():
                        times.setdefault(k, []).append(v)
        if rank == 0:
            if phase == "main":
                times["disk saver"] = [disk_bytes(s_path)]
                times["disk dcp"] = [disk_bytes(d_path)]
            torch.save(times, out)
        ok = True
    finally:
        dist.barrier()
        dist.destroy_process_group()
        if ok:
            # torch 2.14's gloo aborts about one process exit in five at interpreter shutdown
            # after destroy_process_group (python/tests/gloo_ranks.py): leave before it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--work", default=os.path.join("target", "bench-scratch", "torchrec-peers"))
    ap.add_argument("--json", help="also write the figures there")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    out = os.path.join(args.work, "times.pt")
    mp.spawn(rank_main, args=(2, free_port(), args, "main", out), nprocs=2, join=True)
    times = torch.load(out)
    mp.spawn(rank_main, args=(3, free_port(), args, "reshard", out), nprocs=3, join=True)
    times.update(torch.load(out))
    mp.spawn(rank_main, args=(3, free_port(), args, "replan", out), nprocs=3, join=True)
    times.update(torch.load(out))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = sum(max(1, int(r * args.scale)) for r in TABLE_ROWS)
    print(f"TorchRec DMP, 2 ranks (gloo, CPU), table-wise, fused row-wise Adagrad: {rows} rows of dim {DIM}, "
          f"{rows * (DIM + 1) * 4 / (1 << 30):.2f} GiB; {args.rounds} rounds, medians (the slowest rank)")
    print("| operation | saver.torch | DCP | limit | saver / DCP | saver / limit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, a, b in (("blocking save", "save saver", "save dcp"), ("restore, warm", "load saver warm", "load dcp warm"),
                        ("restore, cold", "load saver cold", "load dcp cold"), ("resharding load 2 -> 3 ranks, warm", "reshard saver", "reshard dcp"),
                        ("resharding load 2 -> 3 ranks, table-wise -> column-wise, warm", "replan saver", "replan dcp")):
        limit = med.get(a.replace("saver", "limit"))
        limits = (f"{limit:.3f} s", f"{med[a] / limit:.3f}") if limit else ("-", "-")
        print(f"| {label} | {med[a]:.3f} s | {med[b]:.3f} s | {limits[0]} | {med[a] / med[b]:.3f} | {limits[1]} |")
    mib = 1 << 20
    for label, a, b in (("save", "save saver", "save dcp"), ("restore", "load saver warm", "load dcp warm")):
        for when, prefix in (("first in a process", "first mem "), ("again", "mem ")):
            x, y = med[prefix + a], med[prefix + b]
            print(f"| peak memory of a {label} ({when}), the largest rank's | {x / mib:.2f} MiB | {y / mib:.2f} MiB | {x / max(y, 1):.3f} |")
    print(f"| bytes on disk | {med['disk saver'] / mib:.1f} MiB | {med['disk dcp'] / mib:.1f} MiB | {med['disk saver'] / med['disk dcp']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "dim": DIM, "bytes": rows * (DIM + 1) * 4, "world": 2, "reshard_world": 3,
                       "rounds": args.rounds, "medians": med, "all": times}, f, indent=1)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
