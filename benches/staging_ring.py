"""The staging ring's own cost (python/saver/_staging.py), on one model, in one run.

A CUDA model's save reads every tensor through the ring: a device-to-host copy into a pinned
buffer, then a host copy into the writer's buffer, then the write. Without a GPU the device copy
cannot be timed, but everything else the ring adds can: with SAVER_STAND_IN_DEVICE=1 the CPU
tensors of the same model go through the same ring (their "device" copy a host copy on the
stand-in's thread). Three saves of the same state, durable, same bytes, interleaved, medians:

- ``in place``: saver.torch.save of the CPU model (what the ring replaces);
- ``staged``: the same through the ring (default bound: 1/8 of the state);
- ``copy + torch.save``: what a GPU user does without saver: the state copied to host memory
  whole (here a clone stands for `.cpu()`), then torch.save of it, fsync'd.

Then three restores of the saved step (see ``load_cases``): in place, landed through the
bounded host buffers, and torch.load + copy.

    python benches/staging_ring.py [--gib 1.0] [--rounds 5] [--model table|dense] [--work DIR]

``--model dense``: Linear layers only, every tensor a dense tensor (which a save checksums for
its agreement as well as writes) rather than a row-range table.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import saver
import saver.torch
from gpu_check import fsync_tree  # benches/, beside this script


def model_of(gib, kind="table"):
    """A model of ``gib`` GiB with Adagrad's state: an embedding (a row-range table) and a small
    Linear, or (``dense``) Linear layers only, saved as dense tensors."""
    rows = int(gib * (1 << 30) / 4 / 2 / 128)  # weights and Adagrad's sum, 128 columns
    if kind == "dense":
        width = 4096
        layers = max(1, int(gib * (1 << 30) / 4 / 2 / (width * width)))
        m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        opt = torch.optim.Adagrad(m.parameters())
        m(torch.randn(4, width)).sum().backward()
        opt.step()
        return m, opt
    m = torch.nn.Sequential(torch.nn.Embedding(rows, 128), torch.nn.Linear(128, 64))
    opt = torch.optim.Adagrad(m.parameters())
    m(torch.arange(64)).sum().backward()
    opt.step()
    return m, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", default=None)
    ap.add_argument("--model", choices=["table", "dense"], default="table")
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="staging-ring-")
    os.makedirs(work, exist_ok=True)
    model, opt = model_of(args.gib, args.model)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 2

    def in_place(path):
        os.environ.pop("SAVER_STAND_IN_DEVICE", None)
        return saver.torch.save(path, model, opt)

    def staged(path):
        os.environ["SAVER_STAND_IN_DEVICE"] = "1"
        try:
            return saver.torch.save(path, model, opt)
        finally:
            os.environ.pop("SAVER_STAND_IN_DEVICE", None)

    def copy_then_torch_save(path):
        host = {k: v.clone() for k, v in model.state_dict().items()}
        host_opt = {k: {s: t.clone() if torch.is_tensor(t) else t for s, t in st.items()} for k, st in opt.state_dict()["state"].items()}
        os.makedirs(path)
        torch.save({"model": host, "opt": host_opt}, os.path.join(path, "model.pt"))
        fsync_tree(path)

    cases = {"in place": in_place, "staged": staged, "copy + torch.save": copy_then_torch_save}
    times = {k: [] for k in cases}
    ring = None
    for r in range(args.rounds + 1):
        for name, save in cases.items():
            path = os.path.join(work, name.replace(" ", "_").replace("+", ""))
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            t = time.perf_counter()
            report = save(path)
            took = time.perf_counter() - t
            if name == "staged":
                ring = report
            if r:  # round 0 warms up
                times[name].append(took)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" if v and r else k for k, v in times.items()), file=sys.stderr)
    table(f"Staging ring, {args.model} model, {state_bytes / (1 << 30):.2f} GiB of state, {args.rounds} rounds, medians",
          "save", times, "copy + torch.save")
    print(f"\nThe ring held {ring.staging_bytes / (1 << 20):.1f} MiB and read {ring.staged_bytes / (1 << 30):.2f} GiB through it.")
    print()
    load_cases(work, model, opt, args.rounds)
    shutil.rmtree(work, ignore_errors=True)


def table(title, what, times, other):
    """The medians of ``times`` as a markdown table, each as a ratio to ``in place`` and to
    ``other``."""
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# {title}\n")
    print(f"| {what} | seconds | / in place | / {other} |")
    print("| --- | --- | --- | --- |")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {v / med['in place']:.3f} | {v / med[other]:.3f} |")


def load_cases(work, model, opt, rounds):
    """Three restores of the same step into the same model, interleaved, medians: saver.torch.load
    into the CPU model (in place), the same with its tensors as device tensors (their tables land
    in rounds through the landing's two bounded host buffers), and torch.load of the whole state
    then a copy into the model's tensors (what a GPU user does without saver: map_location="cpu"
    and load_state_dict). Every file is in the page cache (read by round 0)."""
    from saver import _staging

    saved = os.path.join(work, "staged")
    pt = os.path.join(work, "copy__torch.save", "model.pt")
    landing = {}
    land = _staging.Landing.land

    def watched(self, read):
        try:
            return land(self, read)
        finally:
            landing.update(host=self.host_bytes, rounds=self.rounds, landed=self.landed_bytes)

    _staging.Landing.land = watched

    def in_place():
        os.environ.pop("SAVER_STAND_IN_DEVICE", None)
        saver.torch.load(saved, model, opt)

    def landed():
        os.environ["SAVER_STAND_IN_DEVICE"] = "1"
        try:
            saver.torch.load(saved, model, opt)
        finally:
            os.environ.pop("SAVER_STAND_IN_DEVICE", None)

    def torch_load_then_copy():
        state = torch.load(pt, map_location="cpu")
        with torch.no_grad():
            for k, t in model.state_dict().items():
                t.copy_(state["model"][k])

    cases = {"in place": in_place, "landed": landed, "torch.load + copy": torch_load_then_copy}
    times = {k: [] for k in cases}
    for r in range(rounds + 1):
        for name, load in cases.items():
            t = time.perf_counter()
            load()
            if r:
                times[name].append(time.perf_counter() - t)
    table(f"Landing, the same state restored, {rounds} rounds, medians (page cache warm)", "load", times, "torch.load + copy")
    print(f"\nThe landing held {landing['host'] / (1 << 20):.1f} MiB of host buffers and carried "
          f"{landing['landed'] / (1 << 30):.2f} GiB in {landing['rounds']} rounds; torch.load held the whole state.")


if __name__ == "__main__":
    main()
