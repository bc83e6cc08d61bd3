"""Writes docs/BENCHMARKS.md and its plots from the JSON figures of benches/torch_peers.py,
benches/torchrec_peers.py and benches/dcp_compare.py (one run of each, at one commit): `bash benches/report` runs them and
then this. Every figure on the page is a median over the rounds, given as a ratio to a peer or to
the limit measured in the same run; the seconds are beside it."""

import argparse
import datetime
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only: no display here
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1 << 20
#: The tools of the plain model's run, in the order of the tables and plots.
PLAIN = [("saver", "saver.torch"), ("dcp", "DCP"), ("torch", "torch.save"), ("safetensors", "safetensors"), ("limit", "limit")]
COLORS = {"saver": "#1f77b4", "dcp": "#ff7f0e", "torch": "#2ca02c", "safetensors": "#9467bd", "limit": "#7f7f7f"}


def bars(path, title, groups, series, unit):
    """A grouped bar chart: `groups` (labels) on the x axis, one bar per series
    ({key: (label, [value per group, or None])})."""
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=110)
    width = 0.8 / max(1, len(series))
    for i, (key, (label, values)) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        shown = [(x, v) for x, v in zip(xs, values) if v is not None]
        drawn = ax.bar([x for x, _ in shown], [v for _, v in shown], width, label=label, color=COLORS.get(key))
        # Values on the bars: a bar too small to see (saver's memory) still says what it is.
        ax.bar_label(drawn, labels=[f"{v:.3g}" for _, v in shown], fontsize=6, padding=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "-"


def seconds(v):
    return "-" if v is None else f"{v:.3f} s"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", required=True)
    ap.add_argument("--torch", required=True)
    ap.add_argument("--torchrec", required=True)
    ap.add_argument("--dcp", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--page", required=True)
    ap.add_argument("--plots", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    with open(args.torch) as f:
        t = json.load(f)
    with open(args.torchrec) as f:
        r = json.load(f)
    with open(args.dcp) as f:
        d = json.load(f)
    m, rm, dm = t["medians"], r["medians"], d["medians"]
    # dcp_compare.py's calls: (label, saver's, DCP's own).
    dcp_ops = [("dcp.save", "save: saver.dcp.StorageWriter", "save: FileSystemWriter"),
               ("dcp.load, warm", "load, warm: saver.dcp.StorageReader", "load, warm: FileSystemReader"),
               ("dcp.load, cold", "load, cold: saver.dcp.StorageReader", "load, cold: FileSystemReader"),
               ("dcp.async_save: the call's stall", "async_save blocked: saver.dcp.StorageWriter", "async_save blocked: FileSystemWriter + DefaultStager")]
    rel = os.path.relpath(args.plots, os.path.dirname(args.page))

    def plain(op, who):
        return m.get(f"{op} {who}")

    # Plots.
    ops = [("save", "blocking save"), ("load warm", "restore, warm"), ("load cold", "restore, cold")]
    bars(os.path.join(args.plots, "plot-plain-times.png"),
         f"Plain PyTorch model ({t['bytes'] / (1 << 30):.2f} GiB, Adagrad): seconds, lower is better",
         [label for _, label in ops],
         {who: (label, [m.get(f"{op.split()[0]} {who}" + (f" {op.split()[1]}" if " " in op else "")) for op, _ in ops])
          for who, label in PLAIN}, "seconds")
    rops = [("save", "blocking save"), ("load warm", "restore, warm"), ("load cold", "restore, cold"), ("reshard", "resharding load 2 -> 3")]
    bars(os.path.join(args.plots, "plot-torchrec-times.png"),
         f"TorchRec DMP, 2 ranks, fused row-wise Adagrad ({r['bytes'] / (1 << 30):.2f} GiB): seconds",
         [label for _, label in rops],
         {who: (label, [rm.get(f"{op.split()[0]} {who}" + (f" {op.split()[1]}" if " " in op else "")) for op, _ in rops])
          for who, label in (("saver", "saver.torch"), ("dcp", "DCP"), ("limit", "limit (restores)"))}, "seconds")
    peaks = t["peaks"]
    mem_groups = ["plain: save", "plain: restore", "TorchRec: save", "TorchRec: restore"]
    mem = {}
    for who, label in PLAIN[:4]:
        vals = [peaks.get(f"save {who}", [None])[0], peaks.get(f"load {who}", [None])[0]]
        if who in ("saver", "dcp"):
            vals += [rm[f"first mem save {who}"], rm[f"first mem load {who} warm"]]
        else:
            vals += [None, None]
        mem[who] = (label, [None if v is None else v / MIB for v in vals])
    bars(os.path.join(args.plots, "plot-memory.png"), "Peak memory an operation adds, first in a process (MiB)", mem_groups, mem, "MiB")
    disk = {who: (label, [t["disk"].get(who, 0) / MIB, r["medians"].get(f"disk {who}", None) and r["medians"][f"disk {who}"] / MIB])
            for who, label in PLAIN[:4]}
    bars(os.path.join(args.plots, "plot-disk.png"), "Bytes on disk (MiB)", ["plain model", "TorchRec model"], disk, "MiB")
    bars(os.path.join(args.plots, "plot-background.png"),
         "Background save on the plain model: the trainer's loss (seconds)",
         ["call's stall", "training lost", "blocking save's stall"],
         {who: (label, [m[f"async {who}"], m[f"lost {who}"], m[f"save {who}"]]) for who, label in (("saver", "saver.torch"), ("dcp", "DCP"))},
         "seconds")

    # The page.
    date = datetime.date.today().isoformat()
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `bash benches/report` at commit {args.commit} on {date} ({os.cpu_count()} cores; a shared, "
        "noisy virtual machine whose disk writes about 1–2 GiB/s). Each figure is the median of "
        f"{args.rounds} rounds that interleave the tools on the same model in the same run; ratios are "
        "saver's time (or bytes) over the other's, so below 1 means saver is faster or smaller. "
        "Saves are durable (fsync) for every tool. The figures of earlier rounds, and the "
        "investigations behind the design, are in [benchmarks/HISTORY.md](benchmarks/HISTORY.md); "
        "the engine's own figures (hashed tables, object storage, deltas, the manager) in "
        "[benchmarks/summary.md](benchmarks/summary.md), from `bash benches/summary.sh`.",
        "",
    ]
    if args.quick:
        lines += ["**A `--quick` run: tiny models, one round. These figures mean nothing.**", ""]
    lines += [
        "## In one table",
        "",
        "| what a user waits for | saver / DCP | saver / torch.save | saver / safetensors | saver / limit |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, key in (("blocking save, plain model", "save"), ("restore, warm cache, plain model", "load warm"), ("restore, cold cache, plain model", "load cold")):
        k = key.split()
        get = (lambda who: m.get(f"{k[0]} {who}" + (f" {k[1]}" if len(k) > 1 else "")))
        lines.append(f"| {label} | {ratio(get('saver'), get('dcp'))} | {ratio(get('saver'), get('torch'))} | "
                     f"{ratio(get('saver'), get('safetensors'))} | {ratio(get('saver'), get('limit'))} |")
    for label, a, b in (("blocking save, TorchRec", "save saver", "save dcp"), ("restore, warm, TorchRec", "load saver warm", "load dcp warm"),
                        ("restore, cold, TorchRec", "load saver cold", "load dcp cold"), ("resharding load 2 → 3 ranks, TorchRec", "reshard saver", "reshard dcp"),
                        ("resharding load 2 → 3 ranks into column shards, TorchRec", "replan saver", "replan dcp")):
        lines.append(f"| {label} | {ratio(rm[a], rm[b])} | - | - | {ratio(rm[a], rm.get(a.replace('saver', 'limit')))} |")
    lines.append(f"| background save: training lost, plain model | {ratio(m['lost saver'], m['lost dcp'])} | - | - | - |")
    for label, ours, theirs in dcp_ops:
        lines.append(f"| DTensors at {d['world']} ranks through saver.dcp: {label} | {ratio(dm[ours], dm[theirs])} | - | - | - |")
    for what, key in (("save", "save"), ("restore", "load")):
        first = {who: peaks[f"{key} {who}"][0] for who, _ in PLAIN[:4]}
        lines.append(f"| peak memory of a {what}, plain model (first in a process) | {ratio(first['saver'], first['dcp'])} | "
                     f"{ratio(first['saver'], first['torch'])} | {ratio(first['saver'], first['safetensors'])} | - |")
    lines.append(f"| bytes on disk, plain model | {ratio(t['disk']['saver'], t['disk']['dcp'])} | {ratio(t['disk']['saver'], t['disk']['torch'])} | "
                 f"{ratio(t['disk']['saver'], t['disk']['safetensors'])} | - |")
    lines += [
        "",
        "The **limit** is the fastest plain way to do the same work here: for a save, the faster of "
        "(a) each tensor written from its own memory through the page cache by a thread a core into a "
        "file allocated first, its writeback started as it goes, then fsync, and (b) as many bytes "
        "written with `O_DIRECT` from reused aligned buffers, a thread a core (both timed every "
        "round); for a restore, a plain read of as many bytes into the fresh model's own tensors, a "
        "thread a core. safetensors' warm restore does the same work (`load_file` maps the file and the copies "
        "into the model read the page cache in place).",
        "",
        "## The plain PyTorch model",
        "",
        f"Six `nn.EmbeddingBag` tables (3.76 M rows of dimension 32 at scale 1) and an MLP, with Adagrad's "
        f"state: {t['bytes'] / (1 << 30):.2f} GiB. `saver.torch.save(path, model, opt)` / `.load`, against "
        "`torch.save` of both state dicts + fsync / `torch.load` + `load_state_dict`, `dcp.save` / `dcp.load` "
        "+ `set_state_dict` (the state dicts of `get_state_dict`), and `safetensors.torch.save_file` of "
        "the same tensors + fsync / `load_file` + copies into the model and optimizer. A restore fills a "
        "freshly made model, warm (files read once before) or cold (evicted first; the host may still "
        "cache them).",
        "",
        f"![seconds per operation]({rel}/plot-plain-times.png)",
        "",
        "| operation | saver.torch | DCP | torch.save | safetensors | limit | saver / DCP | saver / torch.save |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, key in (("blocking save (the trainer's stall)", "save"), ("restore, warm", "load warm"), ("restore, cold", "load cold")):
        k = key.split()
        vals = {who: m.get(f"{k[0]} {who}" + (f" {k[1]}" if len(k) > 1 else "")) for who, _ in PLAIN}
        lines.append(f"| {label} | " + " | ".join(seconds(vals[w]) for w, _ in PLAIN)
                     + f" | {ratio(vals['saver'], vals['dcp'])} | {ratio(vals['saver'], vals['torch'])} |")
    lines += [
        f"| background save: the call's stall | {seconds(m['async saver'])} | {seconds(m['async dcp'])} | - | - | - | {ratio(m['async saver'], m['async dcp'])} | - |",
        f"| background save: training lost | {seconds(m['lost saver'])} | {seconds(m['lost dcp'])} | - | - | - | {ratio(m['lost saver'], m['lost dcp'])} | - |",
        "",
        "Training lost is the time sparse Adagrad steps took from the background save's call until "
        "the save ended, less the same steps without a save: what the trainer loses, stall and "
        f"slowdown together. saver loses {m['lost saver'] / m['save saver']:.2f} × its blocking save's stall, DCP "
        f"{m['lost dcp'] / m['save dcp']:.2f} × its own; on 2 cores a background save's writing competes with "
        "the training for the same cores. Medians over the rounds after a warm-up round: a process's first "
        "background save copies the model into fresh memory, which saver keeps for the next save, placed as "
        "the files place it so that direct I/O writes it without another copy (docs/GUIDE.md, \"Python\").",
        "",
        f"![background saves]({rel}/plot-background.png)",
        "",
        "## The TorchRec model",
        "",
        f"The same tables in an `EmbeddingBagCollection` under `DistributedModelParallel` (CPU, gloo, "
        f"{r['world']} ranks, table-wise) with fused row-wise Adagrad, {r['bytes'] / (1 << 30):.2f} GiB; "
        "`saver.torch.save(path, model)` / `.load` against TorchRec's DCP recipe (`dcp.save` / `dcp.load` "
        "of the model's and the fused optimizer's state dicts, then `load_state_dict` of both). Each "
        f"operation is timed on the slowest rank. The resharding load reads the checkpoint of {r['world']} "
        f"ranks into a plan of {r['reshard_world']}, table-wise as well: each table moves whole to another "
        "rank, its column cut unchanged; and into a column-wise plan of "
        f"{r['reshard_world']} (a plan change: every table in 4 column shards of 8 columns, each rank "
        "reading some columns of every row, scattered in memory). There DCP restores the weights "
        "alone, since its load of the fused row-wise state (a value a row per column shard) refuses "
        "the new cut; saver.torch restores the weights and the state, converted to the new cut.",
        "",
        f"![seconds per operation]({rel}/plot-torchrec-times.png)",
        "",
        "| operation | saver.torch | DCP | limit | saver / DCP | saver / limit |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, a, b in (("blocking save", "save saver", "save dcp"), ("restore, warm", "load saver warm", "load dcp warm"),
                        ("restore, cold", "load saver cold", "load dcp cold"), ("resharding load 2 → 3 ranks", "reshard saver", "reshard dcp"),
                        ("resharding load 2 → 3 ranks, into column shards", "replan saver", "replan dcp")):
        limit = rm.get(a.replace("saver", "limit"))
        lines.append(f"| {label} | {seconds(rm[a])} | {seconds(rm[b])} | {seconds(limit)} | {ratio(rm[a], rm[b])} | {ratio(rm[a], limit)} |")
    lines += [
        "",
        "The limit of a restore is each rank's own bytes read from a plain file into the same "
        "tensors, a thread a core, timed as a job like the others. Saves have none here: saver's "
        "save of 2 ranks was faster than both plain ways of writing each rank's bytes that the "
        "plain model's limit takes the faster of, so they are no limit (measured once, with each "
        "way timed as a job, when this table was added at c569224: 0.137 s against 0.182 s; the "
        "report does not rerun it).",
    ]
    flips = d["flips"]
    lines += [
        "",
        "## Behind DCP's own API",
        "",
        f"A state dict of DTensors cut as FSDP2 cuts them (`Shard(0)`, `Shard(1)`, a `Replicate`d one, a 4-d "
        f"tensor, a BYTE_IO item), {d['gib']:.2f} GiB at {d['world']} gloo ranks: `dcp.save` / `dcp.load` / "
        "`dcp.async_save` with DCP's planners unchanged, through `saver.dcp.StorageWriter` / `StorageReader` "
        f"and through DCP's own `FileSystemWriter(thread_count={d['threads']})` / `FileSystemReader` "
        f"(saver's get `parallel={d['threads']}`), in turn each round. Both saves are durable (saver fsyncs, "
        "DCP's `sync_files`). Each call is timed on rank 0 between two barriers; a background save until "
        "its call returns (the trainer's stall; saver stages into the host copy it kept from the last "
        "such save, DCP into a new `DefaultStager`'s). A load fills the same state dict, warm (every file "
        "read once first) or cold (evicted first).",
        "",
        "| call | saver.dcp | DCP's own files | saver / DCP |",
        "| --- | --- | --- | --- |",
    ]
    for label, ours, theirs in dcp_ops:
        lines.append(f"| {label} | {seconds(dm[ours])} | {seconds(dm[theirs])} | {ratio(dm[ours], dm[theirs])} |")
    lines += [
        "",
        "Then one byte flipped in one data file, past its header, for each of "
        f"{flips['saver.dcp']['of']} loads of each checkpoint (the byte put back after each):",
        "",
        "| reader | flips caught | loaded silently wrong | of |",
        "| --- | --- | --- | --- |",
    ]
    for who, label in (("saver.dcp", "saver.dcp.StorageReader"), ("DCP", "FileSystemReader")):
        f = flips[who]
        lines.append(f"| {label} | {f['caught']} | {f['wrong']} | {f['of']} |")
    if any(f["caught"] + f["wrong"] < f["of"] for f in flips.values()):
        lines += ["", "A flip neither caught nor loaded wrong fell where a load does not look (padding, "
                  "a part of its file no tensor reads)."]
    lines += [
        "",
        "## Memory and bytes on disk",
        "",
        "Peak memory is what an operation adds to its process's peak resident set (VmHWM reset "
        "before it), less the file pages it maps meanwhile (the code of a library used for the "
        "first time): for the plain model in a process of its own, for TorchRec the largest rank's. "
        "\"First\" is the first such operation in the process (a restart's restore), \"again\" the "
        "next (a trainer's next save).",
        "",
        f"![peak memory]({rel}/plot-memory.png)",
        "",
        "| peak memory | saver.torch | DCP | torch.save | safetensors |",
        "| --- | --- | --- | --- | --- |",
    ]
    for what, key in (("save", "save"), ("restore", "load")):
        for run, when in ((0, "first"), (1, "again")):
            lines.append(f"| plain model, {what} ({when}) | " + " | ".join(f"{peaks[f'{key} {w}'][run] / MIB:.2f} MiB" for w, _ in PLAIN[:4]) + " |")
    for what, key in (("save", "save {}"), ("restore", "load {} warm")):
        for when, prefix in (("first", "first mem "), ("again", "mem ")):
            lines.append(f"| TorchRec, {what} ({when}) | {rm[prefix + key.format('saver')] / MIB:.2f} MiB | {rm[prefix + key.format('dcp')] / MIB:.2f} MiB | - | - |")
    lines += [
        "",
        f"![bytes on disk]({rel}/plot-disk.png)",
        "",
        "| bytes on disk | saver.torch | DCP | torch.save | safetensors |",
        "| --- | --- | --- | --- | --- |",
        "| plain model | " + " | ".join(f"{t['disk'][w] / MIB:.1f} MiB" for w, _ in PLAIN[:4]) + " |",
        f"| TorchRec model | {rm['disk saver'] / MIB:.1f} MiB | {rm['disk dcp'] / MIB:.1f} MiB | - | - |",
        "",
        "## Reproduce",
        "",
        "`bash benches/report` on a clean tree (it refuses a dirty one) reruns the three scripts and rewrites "
        "this page and its plots; the scripts alone print their tables:",
        "",
        "```",
        f"$VENV/bin/python benches/torch_peers.py --rounds {args.rounds}",
        f"$VENV/bin/python benches/torchrec_peers.py --rounds {args.rounds}",
        f"$VENV/bin/python benches/dcp_compare.py --gib {d['gib']} --rounds {args.rounds} --flips {flips['saver.dcp']['of']}",
        "```",
        "",
        "with `$VENV` the venv of `python/tests/run.sh` (python/tests/venv.sh) and the package built "
        "into it by `maturin develop --release` in `python/`.",
        "",
    ]
    os.makedirs(os.path.dirname(args.page), exist_ok=True)
    with open(args.page, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
