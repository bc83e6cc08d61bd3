"""The device check: saver.torch on one CUDA GPU against what a GPU user would pick instead, and
the limits of the machine it runs on, in one run. Writes one JSON (--json) and a markdown table
(stdout), removes every output before the next, and exits non-zero when any restore is not
bitwise.

    python benches/gpu_check.py [--gib 12] [--rounds 2] [--work DIR] [--json OUT]
    python benches/gpu_check.py --cpu-fake        # tiny sizes, CPU tensors through the stand-in

(a) limits: pageable and pinned device-to-host and host-to-device rates, 64 MiB to 2 GiB; a
durable write of the same bytes (buffered + fsync, and O_DIRECT) and a cold read of them;
(b) a CUDA model (nn.Embedding tables with Adagrad state) saved and restored by saver.torch
(save, save_async, load), torch.save (+ fsync) / torch.load(map_location=device), and DCP
(dcp.save, dcp.async_save with a new DefaultStager per call where the installed torch has one,
dcp.load): the caller's blocked time, the wall time, peak resident memory, bitwise restore;
(c) the step time of a matmul loop while each background save drains, against the same loop
with no save.

With --cpu-fake the same code runs on CPU tensors taken as device tensors
(SAVER_STAND_IN_DEVICE=1), with no pinned memory (CPU torch cannot pin), at tiny sizes: what CI
runs so that this script cannot rot. Its figures mean nothing."""

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import saver
import saver.torch


def rss_peak_reset():
    # Linux: writing 5 to clear_refs resets the peak resident size (VmHWM).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_peak():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drop_caches(path):
    """The file's pages out of the page cache, so that the next read reads the disk."""
    for root, _, files in os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]:
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def transfer_rates(device, fake):
    out = []
    sizes = [64 << 20, 256 << 20, 1 << 30, 2 << 30] if not fake else [1 << 20, 4 << 20]
    for size in sizes:
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        for pinned in ([False] if fake else [False, True]):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            row = {"bytes": size, "pinned": pinned}
            for way, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
                dst.copy_(src)
                sync_device(device)
                t = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                sync_device(device)
                row[way] = size / (time.perf_counter() - t) / 1e9
            out.append(row)
            del host
        del dev
    return out


def disk_rates(work, size):
    path = os.path.join(work, "limit.bin")
    block = 8 << 20
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (block // 4096))
    out = {}
    for name, flags in (("buffered", 0), ("o_direct", getattr(os, "O_DIRECT", 0))):
        if name == "o_direct" and not flags:
            continue
        t = time.perf_counter()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags)
        except OSError:
            continue
        try:
            for _ in range(size // block):
                os.write(fd, buf)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            continue
        os.close(fd)
        out[f"write {name}"] = size / (time.perf_counter() - t) / 1e9
    drop_caches(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    out["read cold"] = size / (time.perf_counter() - t) / 1e9
    os.remove(path)
    return out


def make_model(gib, device, seed=0):
    torch.manual_seed(seed)
    dim = 128
    rows = max(1024, int(gib * (1 << 30) / 2 / 4 / dim / 4))  # 4 tables, weights + Adagrad's sum
    model = torch.nn.ModuleDict({f"t{i}": torch.nn.Embedding(rows, dim) for i in range(4)}).to(device)
    opt = torch.optim.Adagrad(model.parameters())
    for m in model.values():
        m(torch.arange(min(rows, 4096), device=device)).sum().backward()
    opt.step()
    return model, opt


def state_of(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def step_loop(device, seconds, n):
    a = torch.randn(n, n, device=device)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a = torch.tanh(a @ a)
        sync_device(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) if times else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=12.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-fake", action="store_true")
    args = ap.parse_args()
    fake = args.cpu_fake
    if fake:
        os.environ["SAVER_STAND_IN_DEVICE"] = "1"
        args.gib, args.rounds = min(args.gib, 0.02), 1
    elif not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --cpu-fake to check the script on a CPU)")
    device = torch.device("cpu" if fake else "cuda")
    work = args.work or tempfile.mkdtemp(prefix="gpu-check-")
    os.makedirs(work, exist_ok=True)
    result = {"device": "cpu (fake)" if fake else torch.cuda.get_device_name(device), "torch": torch.__version__,
              "gib": args.gib, "rounds": args.rounds}
    print("== limits", file=sys.stderr)
    result["transfers"] = transfer_rates(device, fake)
    model, opt = make_model(args.gib, device)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    result["state_bytes"] = state_bytes
    result["disk"] = disk_rates(work, max(8 << 20, state_bytes // (8 << 20) * (8 << 20)))
    reference = {k: v.detach().cpu().clone() for k, v in state_of(model, opt)["model"].items()}
    reference_sum = {k: v["sum"].detach().cpu().clone() for k, v in opt.state_dict()["state"].items()}

    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:  # pragma: no cover - every torch this script meets has it
        dcp = None

    def saver_save(path):
        return saver.torch.save(path, model, opt)

    def saver_async(path):
        return saver.torch.save_async(path, model, opt)

    def saver_load(path, back, back_opt):
        saver.torch.load(path, back, back_opt)

    def torch_save(path):
        os.makedirs(path)
        torch.save(state_of(model, opt), os.path.join(path, "model.pt"))
        fsync_tree(path)

    def torch_load(path, back, back_opt):
        st = torch.load(os.path.join(path, "model.pt"), map_location=device)
        back.load_state_dict(st["model"])
        back_opt.load_state_dict(st["optim"])

    def dcp_save(path):
        dcp.save(state_of(model, opt), checkpoint_id=path)

    def dcp_async(path):
        kwargs = {}
        try:
            from torch.distributed.checkpoint.staging import DefaultStager

            kwargs["async_stager"] = DefaultStager()  # a new one per call: reusing one crashes in 2.11
        except ImportError:
            pass
        try:
            return dcp.async_save(state_of(model, opt), checkpoint_id=path, **kwargs)
        except TypeError:
            return dcp.async_save(state_of(model, opt), checkpoint_id=path)

    def dcp_load(path, back, back_opt):
        st = state_of(back, back_opt)
        dcp.load(st, checkpoint_id=path)
        back.load_state_dict(st["model"])
        back_opt.load_state_dict(st["optim"])

    peers = {"saver": (saver_save, saver_async, saver_load), "torch": (torch_save, None, torch_load)}
    if dcp is not None:
        peers["dcp"] = (dcp_save, dcp_async, dcp_load)
    rows = {}
    bitwise = True
    base_step = step_loop(device, 1.0 if not fake else 0.1, 2048 if not fake else 64)
    result["step_seconds_without_save"] = base_step
    for r in range(args.rounds):
        for who, (save, save_async, load) in peers.items():
            for kind, fn in (("async", save_async), ("save", save)):
                if fn is None:
                    continue
                # The load below reads the blocking save's output (saved last).
                path = os.path.join(work, f"{who}-{kind}")
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
                rss_peak_reset()
                sync_device(device)
                t = time.perf_counter()
                try:
                    handle = fn(path)
                    blocked = time.perf_counter() - t
                    steps = []
                    if kind == "async":
                        # DCP's newer async_save answers with its completions; older, a future.
                        waited = getattr(handle, "upload_completion", handle)
                        while not waited.done():
                            steps.append(step_loop(device, 0.05, 2048 if not fake else 64))
                        report = waited.wait() if hasattr(waited, "wait") else waited.result()
                    else:
                        report = handle
                except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
                    if who == "saver":
                        raise
                    rows[f"{who} {kind}"] = {"error": f"{type(e).__name__}: {e}"[:200]}
                    print(f"{who} {kind}: {e}", file=sys.stderr)
                    continue
                wall = time.perf_counter() - t
                if kind == "async":
                    shutil.rmtree(path, ignore_errors=True)
                row = rows.setdefault(f"{who} {kind}", {"blocked": [], "wall": [], "peak_rss": [], "step_ratio": []})
                row["blocked"].append(blocked)
                row["wall"].append(wall)
                row["peak_rss"].append(rss_peak())
                if steps and base_step:
                    row["step_ratio"].append(statistics.median(steps) / base_step)
                if who == "saver" and report is not None:
                    row.setdefault("moment", getattr(report, "moment", None))
                    row.setdefault("staging_bytes", getattr(report, "staging_bytes", 0))
                    row.setdefault("device_copy_bytes", getattr(report, "device_copy_bytes", 0))
            path = os.path.join(work, f"{who}-save")
            if not os.path.exists(path):
                continue
            drop_caches(path)
            back, back_opt = make_model(args.gib, device, seed=1)
            sync_device(device)
            rss_peak_reset()
            t = time.perf_counter()
            load(path, back, back_opt)
            sync_device(device)
            took = time.perf_counter() - t
            row = rows.setdefault(f"{who} load", {"blocked": [], "wall": [], "peak_rss": [], "step_ratio": []})
            row["wall"].append(took)
            row["peak_rss"].append(rss_peak())
            ok = all(torch.equal(v.detach().cpu(), reference[k]) for k, v in back.state_dict().items())
            ok = ok and all(torch.equal(v["sum"].detach().cpu(), reference_sum[k]) for k, v in back_opt.state_dict()["state"].items())
            row["bitwise"] = row.get("bitwise", True) and ok
            bitwise = bitwise and ok
            del back, back_opt
            shutil.rmtree(path, ignore_errors=True)
            print(f"round {r}: {who} done", file=sys.stderr)
    med = {k: {m: (statistics.median(v) if isinstance(v, list) and v else (None if isinstance(v, list) else v)) for m, v in row.items()} for k, row in rows.items()}
    result["runs"] = med
    result["bitwise"] = bitwise
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"# gpu_check on {result['device']}, torch {result['torch']}, {state_bytes / (1 << 30):.2f} GiB of state, medians of {args.rounds}\n")
    print("| transfer | bytes | GB/s d2h | GB/s h2d |\n| --- | --- | --- | --- |")
    for t in result["transfers"]:
        print(f"| {'pinned' if t['pinned'] else 'pageable'} | {t['bytes'] >> 20} MiB | {t['d2h']:.1f} | {t['h2d']:.1f} |")
    print("\n| disk | GB/s |\n| --- | --- |")
    for k, v in result["disk"].items():
        print(f"| {k} | {v:.2f} |")
    print("\n| run | blocked s | wall s | peak RSS GiB | steps while draining / without | bitwise |\n| --- | --- | --- | --- | --- | --- |")
    for k, v in med.items():
        if "error" in v:
            print(f"| {k} | - | - | - | - | {v['error']} |")
            continue
        blocked = f"{v['blocked']:.3f}" if v.get("blocked") else "-"
        ratio = f"{v['step_ratio']:.3f}" if v.get("step_ratio") else "-"
        extra = f" ({v['moment']})" if v.get("moment") else ""
        print(f"| {k}{extra} | {blocked} | {v['wall']:.3f} | {v['peak_rss'] / (1 << 30):.2f} | {ratio} | {v.get('bitwise', '-')} |")
    shutil.rmtree(work, ignore_errors=True)
    if not bitwise:
        sys.exit("gpu_check: a restore was not bitwise")


if __name__ == "__main__":
    main()
