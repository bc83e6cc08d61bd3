"""Side-by-side benchmark: saver against the physical limit and its peers, on the same model bytes.

Every measured operation runs in a child process that first loads the model (untimed) and then
times only the operation, so all tools start with the model in memory; the parent takes each
child's peak RSS from wait4. Configurations are interleaved within each round, with `sync` before
every run; the tables report medians of --runs rounds after a warm-up round, each as a ratio to the
limit measured in the same run (and to the best peer where there is one).

Usage (from the repository root, after `cargo build --release -p saver-cli`):
    target/bench-venv/bin/python benches/peers/harness.py --runs 3 [--no-peers] [--quick]
It writes docs/benchmarks/peers.md and PNG plots next to it. --no-peers skips the Python peers
(safetensors, torch DCP), which need `pip install safetensors numpy torch matplotlib`, and saver's
own rows at the peers' boundary (its Python package saving the model from memory), which need
`maturin develop --release` in python/ with that Python's venv active.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAVER = os.path.join(ROOT, "target", "release", "saver")
CHILD = os.path.abspath(__file__)
MIB = 1 << 20
GIB = 1 << 30


# ---------------------------------------------------------------- children (one operation each)

def child(op, args):
    """Runs one operation and prints {"seconds": s, ...}. Model loading is not timed."""
    out = {}
    if op == "write":  # limit: sequential write from one reused 8 MiB buffer
        n, path, fsync = int(args[0]), args[1], args[2] == "1"
        buf = b"\x5a" * (8 * MIB)
        t = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            left = n
            while left > 0:
                k = min(left, len(buf))
                f.write(buf[:k] if k < len(buf) else buf)
                left -= k
            if fsync:
                os.fsync(f.fileno())
        out["seconds"] = time.perf_counter() - t
    elif op == "write_direct":  # limit: the same with O_DIRECT, from an aligned buffer
        import mmap
        n, path = int(args[0]), args[1]
        buf = mmap.mmap(-1, 8 * MIB)  # anonymous: page-aligned, as O_DIRECT needs
        buf.write(b"\x5a" * (8 * MIB))
        view = memoryview(buf)
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            left = n
            while left > 0:
                k = min(left, len(buf))
                os.write(fd, view[: (k + 4095) // 4096 * 4096])  # the tail padded to a block
                left -= k
            os.ftruncate(fd, n)
            os.fsync(fd)
        finally:
            os.close(fd)
        out["seconds"] = time.perf_counter() - t
    elif op == "read":  # limit: read files into one reused buffer
        files = args
        buf = bytearray(8 * MIB)
        view = memoryview(buf)
        t = time.perf_counter()
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass
        out["seconds"] = time.perf_counter() - t
    elif op == "memcpy":  # limit: one memory copy of the same size
        import numpy as np
        n = int(args[0])
        a = np.ones(n, dtype=np.uint8)
        b = np.empty_like(a)
        b[:] = 1
        t = time.perf_counter()
        np.copyto(b, a)
        out["seconds"] = time.perf_counter() - t
    elif op == "st_save":  # peer: safetensors.numpy.save_file (+ fsync)
        from safetensors.numpy import load_file, save_file
        arrays = load_plain(args[0], load_file)
        path, fsync = args[1], args[2] == "1"
        t = time.perf_counter()
        save_file(arrays, path)
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        out["seconds"] = time.perf_counter() - t
    elif op == "saver_py_save":  # saver at the peers' boundary: the Python package, model in memory
        import saver
        from safetensors.numpy import load_file
        arrays = load_plain(args[0], load_file)
        path, shards, parallel, fsync = args[1], int(args[2]), int(args[3]), args[4] == "1"
        tables, dense = {}, {}
        for name, a in arrays.items():
            if "/" in name:  # an export's `<table>/ids` and `<table>/<slot>`
                table, column = name.split("/", 1)
                tables.setdefault(table, {})[column] = a
            else:
                dense[name] = a
        t = time.perf_counter()
        saver.save(path, tables, dense, shards=shards, parallel=parallel, durable=fsync)
        out["seconds"] = time.perf_counter() - t
    elif op == "st_load":  # peer: safetensors.numpy.load_file
        from safetensors.numpy import load_file
        t = time.perf_counter()
        d = load_file(args[0])
        out["seconds"] = time.perf_counter() - t
        out["bytes"] = sum(a.nbytes for a in d.values())
    elif op in ("dcp_save", "dcp_load"):  # peer: torch.distributed.checkpoint, single process
        import torch
        import torch.distributed.checkpoint as dcp
        from safetensors.numpy import load_file
        arrays = load_plain(args[0], load_file)
        path, threads = args[1], int(args[2])
        state = {k: torch.from_numpy(v) for k, v in arrays.items() if v.dtype.kind != "b"}
        state.update({k: torch.from_numpy(v.view("uint8")) for k, v in arrays.items() if v.dtype.kind == "b"})
        if op == "dcp_save":
            fsync = args[3] == "1"
            writer = dcp.FileSystemWriter(path, thread_count=threads, sync_files=fsync, overwrite=True)
            t = time.perf_counter()
            dcp.save(state, storage_writer=writer, no_dist=True)
            out["seconds"] = time.perf_counter() - t
        else:
            target = {k: torch.empty_like(v) for k, v in state.items()}
            del state, arrays
            t = time.perf_counter()
            dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            out["seconds"] = time.perf_counter() - t
    else:
        raise SystemExit(f"unknown child op {op}")
    print(json.dumps(out))


def load_plain(directory, load_file):
    arrays = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            arrays.update(load_file(os.path.join(directory, f)))
    return arrays


# ---------------------------------------------------------------- parent

def run(cmd, env=None):
    """Runs a child; returns (its JSON output, its peak RSS in bytes, wall seconds)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    out, err = p.stdout.read().decode(), p.stderr.read().decode()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    line = [l for l in out.splitlines() if l.startswith("{")][-1]
    return json.loads(line), usage.ru_maxrss * 1024, wall


def py(op, *args):
    return [sys.executable, CHILD, "--child", op, *map(str, args)]


def saver_seconds(js):
    """A load's time, or a save's whole time: reading its input (for `save --from`, the
    distribution of the rows into bucket order, a full read and write of the tables), planning,
    writing and committing. The peers' times exclude loading their model, which saver's input
    phase includes: the comparison can only favour the peers."""
    if "load_seconds" in js:
        return js["load_seconds"]
    return js["input_seconds"] + js["plan_seconds"] + js["write_seconds"] + js["commit_seconds"]


def rounds(configs, runs):
    """configs: name -> (cmd, cleanup, extract seconds). Interleaved; cleanup before and after each
    run, sync before each; warm-up round dropped."""
    times = {n: [] for n in configs}
    rss = {n: [] for n in configs}
    for r in range(runs + 1):
        for name, (cmd, pre, secs) in configs.items():
            if pre:
                pre()
            os.sync()
            js, peak, wall = run(cmd)
            if pre:
                pre()  # two dozen copies of a 2 GiB model would fill the disk
            if r > 0:
                times[name].append(secs(js, wall))
                rss[name].append(peak)
    return {n: (statistics.median(times[n]), max(rss[n])) for n in configs}


def rm(path):
    def f():
        shutil.rmtree(path, ignore_errors=True)
        if os.path.isfile(path):
            os.remove(path)
    return f


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def fmt_s(s):
    return f"{s:.2f} s"


def gibs(b, s):
    return f"{b / s / GIB:.2f} GiB/s"


def table(title, rows, nbytes, limit_name, peers):
    """rows: name -> (seconds, rss). Ratio to the limit and to the best peer (fastest). The limit
    is the fastest plain way to do the same work: of every row named "limit: …", the fastest
    (for durable saves, the better of a buffered write + fsync and an O_DIRECT write)."""
    limit = min(v[0] for n, v in rows.items() if n.startswith("limit:")) if limit_name is None else rows[limit_name][0]
    best_peer = min((rows[p][0] for p in peers if p in rows), default=None)
    lines = [f"| {title} | time | throughput | peak RSS | vs limit (fastest limit row) | vs best peer |", "| --- | --- | --- | --- | --- | --- |"]
    for name, (s, rss) in rows.items():
        vs_peer = f"{best_peer / s:.2f}" if best_peer and name not in peers else ("-" if not best_peer else f"{best_peer / s:.2f}")
        lines.append(f"| {name} | {fmt_s(s)} | {gibs(nbytes, s)} | {rss / MIB:.0f} MiB | {limit / s:.2f} | {vs_peer} |")
    return "\n".join(lines)


def measure_durable(spec, work, runs, out):
    """Durable saves only: saver's whole save against the fastest plain durable write of the same
    bytes (buffered + fsync, and O_DIRECT), alternated."""
    src, plain = os.path.join(work, "src"), os.path.join(work, "plain")
    for d in (src, plain):
        shutil.rmtree(d, ignore_errors=True)
    subprocess.run([SAVER, "save", "--synthetic", spec, "--out", src, "--no-fsync"], check=True, capture_output=True)
    subprocess.run([SAVER, "export", src, "--out", plain, "--max-file-size", "64GiB"], check=True, capture_output=True)
    shutil.rmtree(src, ignore_errors=True)
    nbytes = dir_bytes(plain)
    out.append(f"\n### Model `{spec}`: {nbytes / GIB:.2f} GiB of tensors, durable saves\n")
    f, fd = os.path.join(work, "limit.bin"), os.path.join(work, "limit-direct.bin")
    save = {
        "limit: plain sequential write + fsync": (py("write", nbytes, f, 1), rm(f), lambda js, w: js["seconds"]),
        "limit: sequential write, O_DIRECT": (py("write_direct", nbytes, fd), rm(fd), lambda js, w: js["seconds"]),
    }
    for shards in (1, 8):
        d = os.path.join(work, f"s{shards}")
        cmd = [SAVER, "save", "--from", plain, "--out", d, "--shards", str(shards), "--parallel", "2", "--json"]
        save[f"saver save --from, {shards} shard(s), parallel 2, whole"] = (cmd, rm(d), lambda js, w: saver_seconds(js))
    res = rounds(save, runs)
    out.append(table("durable save", res, nbytes, None, []))
    clear(work)


def measure_model(spec, work, runs, peers, out):
    src, plain = os.path.join(work, "src"), os.path.join(work, "plain")
    for d in (src, plain):
        shutil.rmtree(d, ignore_errors=True)
    subprocess.run([SAVER, "save", "--synthetic", spec, "--out", src, "--no-fsync"], check=True, capture_output=True)
    subprocess.run([SAVER, "export", src, "--out", plain, "--max-file-size", "64GiB"], check=True, capture_output=True)
    plain_file = [os.path.join(plain, f) for f in os.listdir(plain) if f.endswith(".safetensors")][0]
    nbytes = dir_bytes(plain)
    out.append(f"\n### Model `{spec}`: {nbytes / GIB:.2f} GiB of tensors\n")

    save = {}
    for fsync in (1, 0):
        tag = "fsync" if fsync else "no fsync"
        f = os.path.join(work, "limit.bin")
        save[f"limit: plain sequential write ({tag})"] = (py("write", nbytes, f, fsync), rm(f), lambda js, w: js["seconds"])
        for shards, par in ((1, 1), (1, 2), (1, 4), (8, 2), (8, 4)):
            d = os.path.join(work, f"s{shards}p{par}{fsync}")
            cmd = [SAVER, "save", "--from", plain, "--out", d, "--shards", str(shards), "--parallel", str(par), "--json"]
            if not fsync:
                cmd.append("--no-fsync")
            save[f"saver save, {shards} shard(s), parallel {par} ({tag})"] = (cmd, rm(d), lambda js, w: saver_seconds(js))
        if fsync:
            # By default the plan's rows past 16 MiB wait in a spill file, which keeps save
            # memory within the bound (64 MiB + parallel x chunk); these rows keep the
            # whole plan in memory instead, to show what spilling costs.
            for shards, par in ((1, 2), (8, 4)):
                d = os.path.join(work, f"s{shards}p{par}inmem")
                cmd = [SAVER, "save", "--from", plain, "--out", d, "--shards", str(shards), "--parallel", str(par),
                       "--plan-memory", "1GiB", "--json"]
                save[f"saver save, {shards} shard(s), parallel {par}, --plan-memory 1GiB ({tag})"] = (
                    cmd, rm(d), lambda js, w: saver_seconds(js))
            # The limit without the page cache: what durable saves with direct I/O approach.
            f = os.path.join(work, "limit-direct.bin")
            save[f"limit: sequential write, O_DIRECT ({tag})"] = (py("write_direct", nbytes, f), rm(f), lambda js, w: js["seconds"])
            # Durable saves through the page cache: the default where direct I/O is not (auto
            # picks direct I/O on ext4 and XFS).
            for shards in (1, 8):
                d = os.path.join(work, f"s{shards}p2buffered")
                cmd = [SAVER, "save", "--from", plain, "--out", d, "--shards", str(shards), "--parallel", "2", "--direct-io=off", "--json"]
                save[f"saver save, {shards} shard(s), parallel 2, --direct-io=off ({tag})"] = (cmd, rm(d), lambda js, w: saver_seconds(js))
        if peers:
            # saver timed as the peers are, from the model in memory: the Python package's save
            # of the export's arrays, read in place.
            for shards in (1, 8):
                d = os.path.join(work, f"py{shards}")
                save[f"saver.save (Python, arrays in memory), {shards} shard(s), parallel 2 ({tag})"] = (
                    py("saver_py_save", plain, d, shards, 2, fsync), rm(d), lambda js, w: js["seconds"])
            f = os.path.join(work, "st.safetensors")
            save[f"peer: safetensors.numpy.save_file ({tag})"] = (py("st_save", plain, f, fsync), rm(f), lambda js, w: js["seconds"])
            for th in (1, 2):
                d = os.path.join(work, f"dcp{th}")
                save[f"peer: torch DCP save, thread_count {th} ({tag})"] = (py("dcp_save", plain, d, th, fsync), rm(d), lambda js, w: js["seconds"])
        if fsync:
            f = os.path.join(work, "rust_st.safetensors")
            save[f"peer: Rust safetensors::serialize_to_file ({tag})"] = (
                ["cargo", "bench", "--quiet", "--bench", "st_serialize", "--", plain, f], rm(f), lambda js, w: js["seconds"])
    res = rounds(save, runs)
    peer_names = [n for n in res if n.startswith("peer:")]
    for tag in ("fsync", "no fsync"):
        rows = {n: v for n, v in res.items() if n.endswith(f"({tag})")}
        out.append(table(f"save ({tag})", rows, nbytes, None, [p for p in peer_names if p in rows]))
        out.append("")

    # Loads, warm page cache.
    ck1, ck8 = os.path.join(work, "ck1"), os.path.join(work, "ck8")
    for d, n in ((ck1, 1), (ck8, 8)):
        shutil.rmtree(d, ignore_errors=True)
        subprocess.run([SAVER, "save", "--from", plain, "--out", d, "--shards", str(n), "--no-fsync"], check=True, capture_output=True)
    files = [os.path.join(ck1, f) for f in os.listdir(ck1) if f.endswith(".safetensors")]
    load = {"limit: plain read into a reused buffer": (py("read", *files), None, lambda js, w: js["seconds"])}
    # The least an owning load can do: the same read, into new memory (benches/read_fresh.rs).
    load["limit: plain read into new memory, 2 threads"] = (
        ["cargo", "bench", "--quiet", "--bench", "read_fresh", "--", *files], None, lambda js, w: js["seconds"])
    load["limit: memory copy of the same size"] = (py("memcpy", nbytes), None, lambda js, w: js["seconds"])
    for par in (1, 2):
        load[f"saver load into arrays, parallel {par}"] = ([SAVER, "load", ck1, "--into", "arrays", "--parallel", str(par), "--json"], None, lambda js, w: saver_seconds(js))
    load["saver load into arrays, parallel 2, huge pages"] = ([SAVER, "load", ck1, "--into", "arrays", "--parallel", "2", "--huge-pages", "--json"], None, lambda js, w: saver_seconds(js))
    load["saver load into hashtables, parallel 2"] = ([SAVER, "load", ck1, "--parallel", "2", "--json"], None, lambda js, w: saver_seconds(js))
    load["saver load shard 1 of 3 (from 8 shards) into arrays, parallel 2"] = (
        [SAVER, "load", ck8, "--into", "arrays", "--shards", "3", "--shard-index", "1", "--parallel", "2", "--json"], None, lambda js, w: saver_seconds(js))
    if peers:
        load["peer: safetensors.numpy.load_file"] = (py("st_load", plain_file), None, lambda js, w: js["seconds"])
        d = os.path.join(work, "dcp-load")
        shutil.rmtree(d, ignore_errors=True)
        run(py("dcp_save", plain, d, 2, 0))
        load["peer: torch DCP load"] = (py("dcp_load", plain, d, 2), None, lambda js, w: js["seconds"])
    res = rounds(load, runs)
    rows = dict(res)
    part = rows.pop("saver load shard 1 of 3 (from 8 shards) into arrays, parallel 2")
    out.append(table("load (warm page cache)", rows, nbytes, "limit: plain read into a reused buffer", [n for n in rows if n.startswith("peer:")]))
    js, _, _ = run([SAVER, "load", ck8, "--into", "arrays", "--shards", "3", "--shard-index", "1", "--json"])
    out.append(f"\nResharding load, shard 1 of 3 from the 8-shard checkpoint: {fmt_s(part[0])}, "
               f"{js['bytes_read'] / MIB:.1f} MiB read for {js['bytes_kept'] / MIB:.1f} MiB kept, "
               f"read amplification {js['read_amplification']:.4f}.")
    t = time.perf_counter()
    d3 = os.path.join(work, "ck3")
    shutil.rmtree(d3, ignore_errors=True)
    subprocess.run([SAVER, "reshard", ck8, "--out", d3, "--shards", "3", "--no-fsync"], check=True, capture_output=True)
    out.append(f"`saver reshard` 8 → 3 (whole process: open, load, save): {fmt_s(time.perf_counter() - t)}.\n")
    clear(work)


def clear(work):
    """Empties the work directory: a section leaves several copies of its model behind."""
    for name in os.listdir(work):
        rm(os.path.join(work, name))()


def sweep(sizes, work, runs, peers, out, plot_dir):
    points = []
    for size in sizes:
        rows = size // (8 + 2 * 64 * 4)
        spec = f"tables=8,rows={rows // 8},dim=64,slots=embedding+adagrad,dense=0,seed=5"
        src, plain = os.path.join(work, "src"), os.path.join(work, "plain")
        for d in (src, plain):
            shutil.rmtree(d, ignore_errors=True)
        subprocess.run([SAVER, "save", "--synthetic", spec, "--out", src, "--no-fsync"], check=True, capture_output=True)
        subprocess.run([SAVER, "export", src, "--out", plain, "--max-file-size", "64GiB"], check=True, capture_output=True)
        shutil.rmtree(src, ignore_errors=True)
        nbytes = dir_bytes(plain)
        f, d, s = os.path.join(work, "limit.bin"), os.path.join(work, "sw"), os.path.join(work, "st.safetensors")
        configs = {
            "limit": (py("write", nbytes, f, 1), rm(f), lambda js, w: js["seconds"]),
            "saver": ([SAVER, "save", "--from", plain, "--out", d, "--parallel", "2", "--json"], rm(d), lambda js, w: saver_seconds(js)),
        }
        if peers:
            configs["safetensors"] = (py("st_save", plain, s, 1), rm(s), lambda js, w: js["seconds"])
        res = rounds(configs, runs)
        points.append((nbytes, {k: v[0] for k, v in res.items()}))
        clear(work)
    out.append("\n### Durable save time against model size\n")
    names = list(points[0][1])
    out.append("| size | " + " | ".join(f"{n} time (GiB/s)" for n in names) + " | saver vs limit |")
    out.append("| --- | " + " | ".join("---" for _ in names) + " | --- |")
    for nbytes, t in points:
        cells = " | ".join(f"{t[n]:.2f} s ({nbytes / t[n] / GIB:.2f})" for n in names)
        out.append(f"| {nbytes / MIB:.0f} MiB | {cells} | {t['limit'] / t['saver']:.2f} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = {"limit": "plain write + fsync (limit)", "saver": "saver save (parallel 2, durable)", "safetensors": "safetensors.numpy.save_file + fsync"}
        for n in names:
            ax.plot([p[0] / GIB for p in points], [p[0] / p[1][n] / GIB for p in points], marker="o", label=labels.get(n, n))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("model size (GiB)")
        ax.set_ylabel("durable save throughput (GiB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(plot_dir, "save_throughput_vs_size.png"), dpi=110)
        out.append("\n![durable save throughput against model size](save_throughput_vs_size.png)\n")
    except ImportError:
        out.append("\n(matplotlib not installed: no plot)\n")


def commit():
    """The commit measured, with `+dirty` when the tree has changes."""
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the harness")
    ap.add_argument("--sweep", default="64MiB,256MiB,1GiB,4GiB,8GiB", help="model sizes of the size sweep ('' for none)")
    ap.add_argument("--models", default="small,scale=10;criteo-kaggle,scale=0.5",
                    help="';'-separated synthetic specs ('' for none); the defaults give about 2 GiB each")
    ap.add_argument("--durable-only", action="store_true",
                    help="only durable saves against the fastest plain durable write (no peers, loads or sweep)")
    ap.add_argument("--work", default=os.path.join(ROOT, "target", "bench-peers"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"))
    a = ap.parse_args()
    peers = not a.no_peers
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    out = ["# saver against the limit and its peers\n",
           f"Generated by `benches/peers/harness.py --runs {a.runs} --models '{a.models}' --sweep '{a.sweep}'{' --quick' if a.quick else ''}{' --durable-only' if a.durable_only else ''}{' --no-peers' if not peers else ''}` "
           f"at commit {commit()} on {time.strftime('%Y-%m-%d')}; "
           f"{os.cpu_count()} cores. Medians of {a.runs} rounds after a warm-up round, configurations interleaved, "
           "`sync` before each run. The peers' times exclude loading the model into memory (they start with it in memory), "
           "as do the rows of `saver.save` (saver's Python package, from the same arrays in memory); "
           "the `saver save` rows are the binary's whole save: reading its input (for `save --from`, distributing the rows into bucket order), "
           "planning, writing and committing. Each ratio is to the fastest limit row of its table. "
           "Peak RSS is the whole process's, model included."]
    if peers:
        # Probed in a child: importing torch here would make this process large, and children are
        # spawned from it (their peak RSS would count our pages until they exec).
        probe = subprocess.run([sys.executable, "-c", "import torch, safetensors, numpy, saver; print(safetensors.__version__, torch.__version__)"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            raise SystemExit("peers need safetensors, numpy, torch and saver's Python package (`maturin develop "
                             f"--release` in python/) in this Python; or pass --no-peers\n{probe.stderr}")
        st, tv = probe.stdout.split()
        out.append(f"Peers: safetensors {st}, torch {tv} (PyPI wheels).")
    models = ["tiny", "tables=2,rows=20000,dim=16,slots=embedding+adagrad,dense=1MiB"] if a.quick else [m for m in a.models.split(";") if m]
    def write():
        # After every section, so a failure late in a long run keeps what was measured.
        with open(os.path.join(a.out, "peers.md"), "w") as f:
            f.write("\n".join(out) + "\n")

    clear(a.work)
    if a.durable_only:
        for spec in models:
            measure_durable(spec, a.work, a.runs, out)
            write()
        print("\n".join(out))
        shutil.rmtree(a.work, ignore_errors=True)
        return
    for spec in models:
        measure_model(spec, a.work, a.runs, peers, out)
        write()
    units = {"MiB": MIB, "GiB": GIB}
    sizes = [4 * MIB, 16 * MIB] if a.quick else [int(float(x[:-3]) * units[x[-3:]]) for x in a.sweep.split(",") if x]
    if sizes:
        sweep(sizes, a.work, a.runs, peers, out, a.out)
        write()
    print("\n".join(out))
    # The work directory held several copies of the largest model; leave the disk as we found it.
    shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
    else:
        main()
