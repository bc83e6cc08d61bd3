"""saver.torch against what a PyTorch user would pick instead, on one model, in one run.

The model is the DLRM-like one of benches/row_range.py as a plain PyTorch module: 6
`nn.EmbeddingBag` tables, 3.76 M rows of dimension 32 in all, a small MLP, and
`torch.optim.Adagrad` (its `sum` state as large as the weights): 0.9 GiB of weights and state.
Every round runs every operation once, in turn (a noisy minute hits all alike); figures are
medians over the rounds.

- blocking save, timed as the trainer waits: `saver.torch.save` (durable: fsync), `torch.save`
  of `{"model": state_dict, "optim": state_dict}` followed by an fsync of its file (the same
  durability), and `dcp.save` of the same through `get_state_dict` (its writer fsyncs);
- background save, the trainer's stall: the time `saver.torch.save_async` and `dcp.async_save`
  take to return (the rest runs meanwhile; waited for, untimed, before the next operation);
- training lost to a background save: sparse Adagrad steps run from the `save_async` (or
  `dcp.async_save`) call until the save has ended, less the same steps without a save; compared
  with the blocking save's stall (the issue's goal: at most that);
- restore into a freshly made model and optimizer (made before the timer): `saver.torch.load`,
  `torch.load` + `load_state_dict` (both), and `dcp.load` + `set_state_dict`, with the files in
  the page cache (warm) and evicted from it (cold: posix_fadvise DONTNEED; on this VM the host
  often still caches them);
- peak memory: for each operation, in a process of its own that made the model first, the
  growth of its peak resident set (VmHWM, reset before each run) during the operation's first
  run (a restart's restore; it also pays for starting threads) and during its second (a
  trainer's next save), less the file pages it mapped meanwhile (RssFile: the code of a
  library used for the first time, 3.6 MiB of saver's native module, shared and reclaimable:
  not memory the operation takes from the trainer).

Usage (from the repository root; python/tests/run.sh makes the venv, `maturin develop --release`
in python/ for figures worth keeping):

    $VENV/bin/python benches/torch_peers.py --rounds 5 [--scale 0.1] [--json out.json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import saver
import saver.torch

import safetensors.torch

import plain_limit
from page_cache import MIB, evict, files_under, fsync_path, warm

TABLE_ROWS = [1_500_000, 1_000_000, 600_000, 400_000, 200_000, 60_000]
DIM = 32


class Dlrm(torch.nn.Module):
    def __init__(self, scale, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tables = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(max(1, int(r * scale)), DIM, mode="sum") for r in TABLE_ROWS
        )
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM * 6, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def make(scale, seed=5):
    model = Dlrm(scale, seed)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            opt.state[p]["sum"].copy_(torch.rand(p.shape, generator=g))
    return model, opt


def nbytes(model, opt):
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return n + sum(s["sum"].numel() * 4 for s in opt.state.values())


# The operations: each returns the seconds the trainer waits.

def saver_save(model, opt, path):
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    saver.torch.save(path, model, opt)
    return time.perf_counter() - t0


def saver_save_async(model, opt, path):
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    h = saver.torch.save_async(path, model, opt)
    stall = time.perf_counter() - t0
    h.wait()
    return stall


def torch_save(model, opt, path):
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    fsync_path(path)
    return time.perf_counter() - t0


def dcp_state(model, opt):
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def dcp_save(model, opt, path):
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    dcp.save(dcp_state(model, opt), checkpoint_id=path, no_dist=True)
    return time.perf_counter() - t0


def dcp_async_save(model, opt, path):
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    f = dcp.async_save(dcp_state(model, opt), checkpoint_id=path, no_dist=True)
    stall = time.perf_counter() - t0
    f.result()
    return stall


def flat_state(model, opt):
    """The model's and the optimizer's tensors in one flat dict, as a safetensors user saves
    them (safetensors holds tensors only)."""
    out = {f"model.{k}": t for k, t in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = v
    return out


def safetensors_save(model, opt, path):
    t0 = time.perf_counter()
    safetensors.torch.save_file(flat_state(model, opt), path)
    fsync_path(path)
    return time.perf_counter() - t0


def safetensors_load(model, opt, path):
    t0 = time.perf_counter()
    got = safetensors.torch.load_file(path)
    model.load_state_dict({k[len("model."):]: v for k, v in got.items() if k.startswith("model.")})
    for name, p in model.named_parameters():
        for k, st in opt.state[p].items():
            st.copy_(got[f"optim.{name}.{k}"])
    return time.perf_counter() - t0


def limit_save(model, opt, path):
    """The fastest plain way to write the model's bytes durably here (see plain_limit.write)."""
    return plain_limit.write(list(flat_state(model, opt).values()), path)


def limit_load(model, opt, path):
    """A plain read of as many bytes into the fresh model's and optimizer's own tensors (what a
    restore must fill), by as many threads as cores."""
    return plain_limit.read(list(flat_state(model, opt).values()), path)


def saver_load(model, opt, path):
    t0 = time.perf_counter()
    saver.torch.load(path, model, opt)
    return time.perf_counter() - t0


def torch_load(model, opt, path):
    t0 = time.perf_counter()
    state = torch.load(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return time.perf_counter() - t0


def dcp_load(model, opt, path):
    t0 = time.perf_counter()
    state = dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return time.perf_counter() - t0


def train_step(model, opt, g, batch=2048, pool=4):
    """One step of sparse training: each table looked up by `batch` bags of `pool` ids, an MLP,
    Adagrad on the rows touched (sparse gradients) and on the MLP."""
    offsets = torch.arange(0, batch * pool, pool)
    xs = [t(torch.randint(t.num_embeddings, (batch * pool,), generator=g), offsets) for t in model.tables]
    loss = model.mlp(torch.cat(xs, 1)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def training_lost(model, opt, start, path, min_steps):
    """Seconds of training a background save costs: steps run from the call on until the save
    has ended (at least `min_steps`), timed, less the same number of steps without a save
    (timed just before, on the same model). Returns (lost, the call's stall, steps)."""
    g = torch.Generator().manual_seed(7)
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    done = start(model, opt, path)
    stall = time.perf_counter() - t0
    steps = 0
    while steps < min_steps or not done():
        train_step(model, opt, g)
        steps += 1
    with_save = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(steps):
        train_step(model, opt, g)
    without = time.perf_counter() - t1
    return with_save - without, stall, steps


def start_saver(model, opt, path):
    h = saver.torch.save_async(path, model, opt)
    return h.done


def start_dcp(model, opt, path):
    f = dcp.async_save(dcp_state(model, opt), checkpoint_id=path, no_dist=True)
    return f.done


SAVES = {"saver": saver_save, "torch": torch_save, "dcp": dcp_save, "safetensors": safetensors_save, "limit": limit_save}
ASYNC = {"saver": saver_save_async, "dcp": dcp_async_save}
LOADS = {"saver": saver_load, "torch": torch_load, "dcp": dcp_load, "safetensors": safetensors_load, "limit": limit_load}
#: The tools that restore a model (the limit only reads its bytes).
PEERS = ["saver", "torch", "dcp", "safetensors"]


def paths_in(work):
    return {"saver": os.path.join(work, "saver"), "torch": os.path.join(work, "model.pt"), "dcp": os.path.join(work, "dcp"),
            "safetensors": os.path.join(work, "model.safetensors"), "limit": os.path.join(work, "limit.bin")}


def disk_bytes(path):
    return sum(os.path.getsize(f) for f in files_under(path))


def peak_of(kind, who, scale, work):
    """Peak RSS growth of one operation, in a process of its own (see --memory-of)."""
    out = subprocess.run(
        [sys.executable, __file__, "--memory-of", f"{kind}:{who}", "--scale", str(scale), "--work", work],
        capture_output=True, text=True, check=True,
    )
    return [int(v) for v in out.stdout.strip().splitlines()[-1].split()]


def memory_of(spec, scale, work):
    kind, who = spec.split(":")
    model, opt = make(scale, seed=11 if kind == "load" else 5)
    paths = paths_in(work)

    def hwm():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0

    def rss(key="VmRSS:"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    op = {"save": SAVES, "async": ASYNC, "load": LOADS}[kind][who]
    path = paths[who] if kind != "async" else paths[who] + "-async"
    growth = []
    for _ in range(2):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base, files = rss(), rss("RssFile:")
        op(model, opt, path)
        growth.append(max(0, hwm() - base - (rss("RssFile:") - files)))
    print(*growth)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--work", default=os.path.join("target", "bench-scratch", "torch-peers"))
    ap.add_argument("--json")
    ap.add_argument("--memory-of")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.memory_of:
        return memory_of(args.memory_of, args.scale, args.work)
    model, opt = make(args.scale)
    n = nbytes(model, opt)
    paths = paths_in(args.work)
    times = {}

    def keep(r, key, v):
        if r > 0:
            times.setdefault(key, []).append(v)

    for r in range(args.rounds + 1):  # round 0 warms up
        for who, f in SAVES.items():
            keep(r, f"save {who}", f(model, opt, paths[who]))
        for who, f in ASYNC.items():
            keep(r, f"async {who}", f(model, opt, paths[who] + "-async"))
        for cache in ("warm", "cold"):
            for who, f in LOADS.items():
                fresh, fresh_opt = make(args.scale, seed=11)
                if cache == "warm":
                    warm([paths[who]])
                else:
                    evict([paths[who]])
                keep(r, f"load {who} {cache}", f(fresh, fresh_opt, paths[who]))
                if r == 0 and who != "limit":
                    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
                        assert torch.equal(a, b), (who, k)
                    for p, q in zip(model.parameters(), fresh.parameters()):
                        assert torch.equal(opt.state[p]["sum"], fresh_opt.state[q]["sum"]), who
                del fresh, fresh_opt
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()) if r else "round 0 (warm-up)", file=sys.stderr)
    # Training lost to a background save, against the blocking save's stall: the model trains
    # (sparse Adagrad) from here on, so it runs after the timed rounds.
    for m in model.tables:
        m.sparse = True
    for r in range(args.rounds + 1):
        for who, start in (("saver", start_saver), ("dcp", start_dcp)):
            lost, _, steps = training_lost(model, opt, start, paths[who] + "-async", min_steps=20)
            keep(r, f"lost {who}", lost)
            keep(r, f"lost steps {who}", steps)
        print(f"lost round {r}: " + ", ".join(f"{w} {times[f'lost {w}'][-1]:.3f}s" for w in ("saver", "dcp")) if r else "lost round 0 (warm-up)", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    disk = {who: disk_bytes(paths[who]) for who in SAVES}
    peaks = {}
    for kind in ("save", "load"):
        for who in PEERS:
            peaks[f"{kind} {who}"] = peak_of(kind, who, args.scale, args.work)
    gib = n / (1 << 30)
    print(f"model: {gib:.2f} GiB of weights and Adagrad state, {args.rounds} rounds, medians")
    print("| operation | saver | torch | dcp | safetensors | limit | saver / torch | saver / dcp | saver / limit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def row(what, key):
        got = {w: med.get(key.format(w)) for w in SAVES}
        cells = " | ".join("-" if v is None else f"{v:.3f} s" for v in got.values())
        ratios = " | ".join(f"{got['saver'] / got[w]:.3f}" if got.get(w) else "-" for w in ("torch", "dcp", "limit"))
        print(f"| {what} | {cells} | {ratios} |")

    row("blocking save (stall)", "save {}")
    row("background save (stall: the call)", "async {}")
    row("background save (training lost)", "lost {}")
    print(f"training lost / blocking save's stall: saver {med['lost saver'] / med['save saver']:.3f}, "
          f"dcp {med['lost dcp'] / med['save dcp']:.3f} (steps trained while saving: saver {med['lost steps saver']:.0f}, dcp {med['lost steps dcp']:.0f})")
    for cache in ("warm", "cold"):
        row(f"restore, {cache}", f"load {{}} {cache}")
    for kind, what in (("save", "a save"), ("load", "a restore")):
        for run, when in ((0, "first in a process"), (1, "again")):
            got = {w: peaks[f"{kind} {w}"][run] for w in PEERS}
            print(f"| peak memory of {what} ({when}) | " + " | ".join(f"{got[w] / MIB:.2f} MiB" for w in got)
                  + f" | - | {got['saver'] / max(got['torch'], 1):.3f} | {got['saver'] / max(got['dcp'], 1):.3f} | - |")
    print("| bytes on disk | " + " | ".join(f"{disk[w] / MIB:.1f} MiB" for w in SAVES)
          + f" | {disk['saver'] / disk['torch']:.3f} | {disk['saver'] / disk['dcp']:.3f} | - |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": n, "rounds": args.rounds, "scale": args.scale, "medians": med, "all": times, "peaks": peaks, "disk": disk}, f, indent=1)
    # Five copies of the model: gone with the run.
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
