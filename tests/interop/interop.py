"""Interoperability with Python's safetensors and numpy.

1. Files written by `saver save` open with `safetensors.safe_open` and hold exactly the bytes the
   manifest describes (CRC32 of every tensor); the tables rebuilt from them equal `saver export`.
2. A plain input written by `safetensors.numpy.save_file` goes through `saver save --from`,
   `reshard` and `export`, and comes back exactly equal.
3. The content digest, recomputed here from its definition in docs/FORMAT.md, equals `saver digest`.
4. `saver export --quantize` writes, byte for byte, what an independent numpy implementation of
   FBGEMM's row-wise conversions computes, for every bit rate and layout and for odd dims; the
   rows dequantize to within half a step of the originals.
5. A reader written from docs/FORMAT.md alone, sharing no code with saver (`read_checkpoint`),
   reads checkpoints of every format version: full (1), delta (2: removed ids, dense tensors kept
   from the parent, a chain of three), compressed (3) and compressed delta (4: zstd frames, every
   filter), row-range tables (5: chunks that must tile each slot, raw and compressed) and deltas
   of them (6: patches of changed rows over the parent's),
   checking every CRC-32 and every bucket index; what it reads has saver's digest and, for the
   models saved from plain inputs, is exactly the model saved.

Usage: python interop.py SAVER_BINARY WORK_DIR
"""

import hashlib
import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

SAVER, WORK = sys.argv[1], sys.argv[2]
CHECKS = 0


def saver(*args):
    out = subprocess.run([SAVER, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"saver {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def check(cond, what):
    global CHECKS
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    CHECKS += 1


def read_export(directory):
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(os.path.join(directory, file)))
    check(set(out) == set(index["weight_map"]), "export index lists every tensor")
    return out


def saver_files_hold_the_manifest_bytes():
    ckpt = os.path.join(WORK, "synthetic")
    saver("save", "--out", ckpt, "--synthetic", "tiny,rows=500,slots=embedding+adagrad+freq", "--shards", "3", "--no-fsync")
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        index = json.load(f)
    with open(os.path.join(ckpt, index["metadata"]["saver_manifest"])) as f:
        manifest = json.load(f)
    tensors = {}
    for fm in manifest["files"]:
        with safe_open(os.path.join(ckpt, fm["name"]), framework="numpy") as f:
            meta = f.metadata()
            check(meta["saver.save_id"] == manifest["save_id"], "file metadata names the save")
            # Hugging Face loaders refuse a file whose metadata lacks format pt (or mlx).
            check(meta.get("format") == "pt", "file metadata says format pt")
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    refs = []
    for t in manifest["tables"]:
        for p in t["partitions"]:
            for s in p["segments"]:
                refs += [s["ids"], s["bucket_index"], *s["slots"]]
    refs += [d["tensor"] for d in manifest["dense"]]
    check(len(refs) == len(tensors), "every tensor of the files is in the manifest")
    for r in refs:
        arr = tensors[r["name"]]
        check(list(arr.shape) == r["shape"], f"shape of {r['name']}")
        check(zlib.crc32(arr.tobytes()) == r["crc32"], f"CRC32 of {r['name']}")
    # Rebuild table t0 from the shards and compare with the export.
    exp_dir = os.path.join(WORK, "synthetic-export")
    saver("export", ckpt, "--out", exp_dir)
    exported = read_export(exp_dir)
    t0 = next(t for t in manifest["tables"] if t["name"] == "t0")
    ids, rows = [], {s["name"]: [] for s in t0["slots"]}
    for p in t0["partitions"]:
        for s in p["segments"]:
            ids.append(tensors[s["ids"]["name"]])
            for name, ref in zip(p["slots"], s["slots"]):
                rows[name].append(tensors[ref["name"]])
    ids = np.concatenate(ids)
    order = np.argsort(ids, kind="stable")
    check(np.array_equal(ids[order], exported["t0/ids"]), "t0 ids equal the export's")
    for name, parts in rows.items():
        check(np.array_equal(np.concatenate(parts)[order], exported[f"t0/{name}"]), f"t0/{name} equals the export's")


M64 = (1 << 64) - 1


def bucket(ids):
    """The partition rule of docs/FORMAT.md: MurmurHash3's fmix64 of the id's bits, top 16 bits."""
    k = ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        k ^= k >> np.uint64(33)
        k *= np.uint64(0xFF51AFD7ED558CCD)
        k ^= k >> np.uint64(33)
        k *= np.uint64(0xC4CEB9FE1A85EC53)
        k ^= k >> np.uint64(33)
    return k >> np.uint64(48)


def digest(tables, dense, version=2, row_tables=None):
    """The content digest of docs/FORMAT.md, computed independently: version 2 orders a table's
    rows by (bucket, id bits), version 1 by id; row-range tables ({name: (rows, {slot: whole
    array})}) follow the hashed ones."""
    h = hashlib.sha256(b"saver-digest-v%d\n" % version)

    def put_str(s):
        h.update(s.encode() + b"\0")

    def put_shape(shape):
        h.update(struct.pack("<I", len(shape)))
        for d in shape:
            h.update(struct.pack("<Q", d))

    names = {np.dtype("int64"): "I64", np.dtype("uint64"): "U64", np.dtype("float32"): "F32",
             np.dtype("float16"): "F16", np.dtype("float64"): "F64", np.dtype("int32"): "I32",
             np.dtype("bool"): "BOOL"}
    for tname in sorted(tables):
        ids, slots = tables[tname]
        h.update(b"table\0")
        put_str(tname)
        put_str(names[ids.dtype])
        h.update(struct.pack("<I", len(slots)))
        for sname in sorted(slots):
            put_str(sname)
            put_str(names[slots[sname].dtype])
            put_shape(slots[sname].shape[1:])
        if version == 1:
            order = np.argsort(ids, kind="stable")
        else:
            order = np.lexsort((ids.view(np.uint64), bucket(ids)))
        h.update(struct.pack("<Q", len(ids)))
        for i in order:
            h.update(ids[i].tobytes())
            for sname in sorted(slots):
                h.update(slots[sname][i].tobytes())
    for tname in sorted(row_tables or {}):
        rows, slots = row_tables[tname]
        h.update(b"rowtable\0")
        put_str(tname)
        h.update(struct.pack("<QI", rows, len(slots)))
        for sname in sorted(slots):
            put_str(sname)
            put_str(names[slots[sname].dtype])
            put_shape(slots[sname].shape)
        for sname in sorted(slots):
            h.update(np.ascontiguousarray(slots[sname]).tobytes())
    for dname in sorted(dense):
        a = dense[dname]
        h.update(b"dense\0")
        put_str(dname)
        put_str(names[a.dtype])
        put_shape(a.shape)
        h.update(struct.pack("<Q", a.nbytes))
        h.update(a.tobytes())
    return h.hexdigest()


def plain_input_round_trips():
    rng = np.random.default_rng(7)
    n = 3000
    user_ids = np.unique(np.concatenate([
        rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64),
        np.array([-(2**63), -1, 0, 1, 2**63 - 1], dtype=np.int64),
    ]))
    rng.shuffle(user_ids)
    item_ids = np.unique(rng.integers(0, 2**64 - 1, size=500, dtype=np.uint64, endpoint=True))
    rng.shuffle(item_ids)
    plain = {
        "user/ids": user_ids,
        "user/embedding": rng.standard_normal((len(user_ids), 8)).astype(np.float32),
        "user/clicks": rng.integers(0, 100, size=len(user_ids), dtype=np.int32),
        "item/ids": item_ids,
        "item/vec": rng.standard_normal((len(item_ids), 4)).astype(np.float16),
        "item/seen": rng.integers(0, 2, size=len(item_ids)).astype(bool),
        "tower.w": rng.standard_normal((3, 3)),
        "tower.b": np.arange(5, dtype=np.int64),
    }
    src = os.path.join(WORK, "plain")
    os.makedirs(src, exist_ok=True)
    save_file(plain, os.path.join(src, "model.safetensors"))
    a, b, e = (os.path.join(WORK, x) for x in ("from-plain", "resharded", "exported"))
    saver("save", "--out", a, "--from", src, "--shards", "4", "--no-fsync")
    saver("reshard", a, "--out", b, "--shards", "3", "--no-fsync")
    saver("export", b, "--out", e, "--max-file-size", "64KiB")
    back = read_export(e)
    check(set(back) == set(plain), "the export has every input tensor")
    for table in ("user", "item"):
        order = np.argsort(plain[f"{table}/ids"], kind="stable")
        check(np.array_equal(back[f"{table}/ids"], plain[f"{table}/ids"][order]), f"{table} ids, ascending")
        for name in plain:
            if name.startswith(f"{table}/") and name != f"{table}/ids":
                check(back[name].dtype == plain[name].dtype, f"{name} dtype")
                check(np.array_equal(back[name], plain[name][order]), f"{name} values, bit-exact")
    for name in ("tower.w", "tower.b"):
        check(back[name].dtype == plain[name].dtype and np.array_equal(back[name], plain[name]), f"dense {name}")
    tables = {
        "user": (plain["user/ids"], {"embedding": plain["user/embedding"], "clicks": plain["user/clicks"]}),
        "item": (plain["item/ids"], {"vec": plain["item/vec"], "seen": plain["item/seen"]}),
    }
    dense = {"tower.w": plain["tower.w"], "tower.b": plain["tower.b"]}
    expected, expected_v1 = digest(tables, dense), digest(tables, dense, version=1)
    check(expected != expected_v1, "the two digest versions differ")
    for path in (src, a, b, e):
        check(saver("digest", path).strip() == expected, f"digest of {path} equals the Python digest")
        check(
            saver("digest", "--digest-version", "1", path).strip() == expected_v1,
            f"version-1 digest of {path} equals the Python digest",
        )


def fbgemm_nbit_reference(rows, bits):
    """FBGEMM's FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf, in float32 numpy: packed values
    (element i of a byte in its low bits first), f16 scales and f16 biases."""
    n, d = rows.shape
    bias = rows.min(axis=1).astype(np.float16)
    low = bias.astype(np.float32)
    span = rows.max(axis=1) - low
    levels = (1 << bits) - 1
    scale = np.where(span == 0, np.float32(1), span / np.float32(levels)).astype(np.float32)
    scale = scale.astype(np.float16).astype(np.float32)
    scale[scale == 0] = 1
    with np.errstate(divide="ignore"):
        inverse = np.float32(1) / scale
    scale[np.isinf(inverse)], inverse[np.isinf(inverse)] = 1, 1
    q = np.clip(np.rint((rows - low[:, None]) * inverse[:, None]), 0, levels).astype(np.uint8)
    per = 8 // bits
    packed = np.zeros((n, -(-d // per)), dtype=np.uint8)
    for c in range(d):
        packed[:, c // per] |= (q[:, c] << ((c % per) * bits)).astype(np.uint8)
    return packed, scale.astype(np.float16), bias


def fbgemm_8bit_reference(rows):
    """FBGEMM's FloatOrHalfToFused8BitRowwiseQuantizedSBFloat: D bytes, f32 scale, f32 bias."""
    n = rows.shape[0]
    low, high = rows.min(axis=1), rows.max(axis=1)
    span = high - low
    inverse = np.float32(255) / (span + np.float32(1e-8))
    q = np.rint((rows - low[:, None]) * inverse[:, None]).astype(np.uint8)
    scale = (span / np.float32(255)).astype(np.float32)
    return np.concatenate([q, scale.view(np.uint8).reshape(n, 4), low.view(np.uint8).reshape(n, 4)], axis=1)


def dequantized_within_half_a_step(rows, values, scale, bias, bits, what):
    levels = (1 << bits) - 1
    back = values.astype(np.float32) * scale[:, None] + bias[:, None]
    low, high = rows.min(axis=1), rows.max(axis=1)
    # What rounding the bias and the scale to f16 moves a value by, and the share of a tiny range
    # that the f32 form's 1e-8 in its divisor takes off.
    span = high - low
    slack = np.abs(bias - low) + levels * np.abs(scale - (high - bias) / levels) + span * 1e-8 / (span + 1e-8)
    check(np.all(np.abs(back - rows) <= scale[:, None] * 0.5001 + slack[:, None] + 1e-6), f"{what}: within half a step")


def unpack(packed, bits, d):
    per = 8 // bits
    cols = [(packed[:, c // per] >> ((c % per) * bits)) & ((1 << bits) - 1) for c in range(d)]
    return np.stack(cols, axis=1)


def quantized_exports_match_fbgemm():
    rng = np.random.default_rng(11)
    n = 2000
    user = rng.standard_normal((n, 13)).astype(np.float32) * rng.choice([1e-3, 0.05, 1.0, 20.0], size=(n, 1)).astype(np.float32)
    user[:5] = 0.25  # constant rows
    user[5] = np.linspace(-1, 1, 13, dtype=np.float32)  # ties at the half steps
    item = (rng.standard_normal((700, 6)) * 0.1).astype(np.float16)
    plain = {
        "user/ids": rng.permutation(np.arange(10 * n, dtype=np.int64))[:n],
        "user/embedding": user,
        "user/adagrad": np.abs(rng.standard_normal((n, 13))).astype(np.float32),
        "item/ids": rng.permutation(np.arange(700, dtype=np.uint64) * 977),
        "item/embedding": item,
        "tower.w": rng.standard_normal((4, 4)).astype(np.float32),
    }
    src, ckpt = os.path.join(WORK, "quant-plain"), os.path.join(WORK, "quant-ckpt")
    os.makedirs(src, exist_ok=True)
    save_file(plain, os.path.join(src, "model.safetensors"))
    saver("save", "--out", ckpt, "--from", src, "--shards", "3", "--no-fsync")
    for bits in (8, 4, 2):
        for layout in ("fused", "fused-half", "split"):
            out = os.path.join(WORK, f"quant-{bits}-{layout}")
            saver("export", ckpt, "--out", out, "--quantize", f"int{bits}", "--quantize-layout", layout, "--max-file-size", "16KiB")
            back = read_export(out)
            sbfloat = bits == 8 and layout == "fused"
            form = "Fused8BitRowwiseQuantizedSBFloat" if sbfloat else "FusedNBitRowwiseQuantizedSBHalf"
            with open(os.path.join(out, "model.safetensors.index.json")) as f:
                meta = json.load(f)["metadata"]
            check(meta["quantization"] == form and meta["quantization_bits"] == str(bits), f"{out}: index metadata")
            check(meta["quantization_layout"] == ("split" if layout == "split" else "fused"), f"{out}: index layout")
            for file in sorted(os.listdir(out)):
                if file.endswith(".safetensors"):
                    with safe_open(os.path.join(out, file), framework="numpy") as f:
                        m, names = f.metadata() or {}, list(f.keys())
                    quantized = [x for x in names if x.endswith(("/embedding", "_qscale", "_qbias"))]
                    if quantized:
                        check(m.get("quantization") == form and m.get("quantization_bits") == str(bits), f"{file}: metadata")
                        check(sorted(m["quantized_tensors"].split(",")) == sorted(quantized), f"{file}: quantized_tensors")
            for table in ("user", "item"):
                order = np.argsort(plain[f"{table}/ids"], kind="stable")
                check(np.array_equal(back[f"{table}/ids"], plain[f"{table}/ids"][order]), f"{out}: {table} ids")
                rows = plain[f"{table}/embedding"][order].astype(np.float32)
                name, d = f"{table}/embedding", rows.shape[1]
                if sbfloat:
                    want = fbgemm_8bit_reference(rows)
                    check(back[name].dtype == np.uint8 and np.array_equal(back[name], want), f"{out}: {name} bytes equal FBGEMM's")
                    scale, bias = want[:, d:d + 4].copy().view(np.float32)[:, 0], want[:, d + 4:].copy().view(np.float32)[:, 0]
                    dequantized_within_half_a_step(rows, want[:, :d], scale, bias, 8, f"{out}: {name}")
                    continue
                packed, scale, bias = fbgemm_nbit_reference(rows, bits)
                if layout == "split":
                    check(np.array_equal(back[name], packed), f"{out}: {name} values equal FBGEMM's")
                    check(back[f"{name}_qscale"].shape == (len(rows), 1), f"{out}: {name}_qscale shape")
                    check(np.array_equal(back[f"{name}_qscale"][:, 0].view(np.uint16), scale.view(np.uint16)), f"{out}: {name} scales")
                    check(np.array_equal(back[f"{name}_qbias"][:, 0].view(np.uint16), bias.view(np.uint16)), f"{out}: {name} biases")
                else:
                    fused = np.concatenate([packed, scale.view(np.uint8).reshape(-1, 2), bias.view(np.uint8).reshape(-1, 2)], axis=1)
                    check(np.array_equal(back[name], fused), f"{out}: {name} bytes equal FBGEMM's")
                values = unpack(packed, bits, d)
                dequantized_within_half_a_step(rows, values, scale.astype(np.float32), bias.astype(np.float32), bits, f"{out}: {name}")
            order = np.argsort(plain["user/ids"], kind="stable")
            check(np.array_equal(back["user/adagrad"], plain["user/adagrad"][order]), f"{out}: other slots unchanged")
            check(np.array_equal(back["tower.w"], plain["tower.w"]), f"{out}: dense unchanged")


def hugging_face_loaders_read_checkpoint_files():
    """Opt-in (SAVER_INTEROP_HF=1, which installs huggingface_hub and torch into the venv):
    huggingface_hub's loader reads every checkpoint data file, with the bytes the manifest says."""
    import huggingface_hub

    ckpt = os.path.join(WORK, "synthetic")
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        index = json.load(f)
    for file in sorted(set(index["weight_map"].values())):
        state = huggingface_hub.load_state_dict_from_file(os.path.join(ckpt, file))
        with safe_open(os.path.join(ckpt, file), framework="numpy") as f:
            for name in f.keys():
                check(np.array_equal(state[name].numpy(), f.get_tensor(name)), f"huggingface_hub reads {name}")


DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
          "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}


def unfilter(raw, filt):
    """Undoes a frame's filter (docs/FORMAT.md, "Compressed checkpoints")."""
    if filt == "plain":
        return raw
    n = {"shuffle2": 2, "shuffle4": 4, "shuffle8": 8, "delta8": 8}[filt]
    # Byte planes back into elements.
    out = np.frombuffer(raw, dtype=np.uint8).reshape(n, len(raw) // n).T.tobytes()
    if filt == "delta8":
        # Each 64-bit integer was its wrapping difference from the one before, the first from 0.
        with np.errstate(over="ignore"):
            out = np.cumsum(np.frombuffer(out, dtype=np.uint64), dtype=np.uint64).tobytes()
    return out


def tensor_bytes(directory, ref, seen_codecs):
    """A tensor's raw bytes, found by its manifest ref alone and checked against its CRC-32."""
    codec = ref.get("codec")
    with open(os.path.join(directory, ref["file"]), "rb") as f:
        f.seek(ref["offset"])
        stored = f.read(codec["stored"] if codec else ref["len"])
    if not codec:
        data = stored
    else:
        import zstandard

        check(codec["name"] == "zstd", f"{ref['name']}: codec zstd")
        seen_codecs.add(codec["filter"])
        # Frames of the CRC blocks' size (the whole tensor without blocks), the last the rest.
        frame_raw = ref["blocks"]["bytes"] if ref.get("blocks") else ref["len"]
        frames = codec["frames"]
        lengths = [int(frames[i:i + 8], 16) for i in range(0, len(frames), 8)]
        check(sum(lengths) == codec["stored"], f"{ref['name']}: frames sum to the stored bytes")
        out, at, left = [], 0, ref["len"]
        for stored_len in lengths:
            raw_len = min(frame_raw, left)
            frame = stored[at:at + stored_len]
            if stored_len == raw_len:
                out.append(frame)  # zstd did not shrink it: kept raw, unfiltered
            else:
                raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=raw_len)
                out.append(unfilter(raw, codec["filter"]))
            at += stored_len
            left -= raw_len
        data = b"".join(out)
    if len(data) != ref["len"] or zlib.crc32(data) != ref["crc32"]:
        raise AssertionError(f"{ref['name']} in {directory}: not the bytes its CRC-32 names")
    return data


def tensor_array(directory, ref, seen_codecs):
    return np.frombuffer(tensor_bytes(directory, ref, seen_codecs), dtype=DTYPES[ref["dtype"]]).reshape(ref["shape"])


def manifest_of(directory):
    """The manifest the index commits, checked against the CRC-32 the index records."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    with open(os.path.join(directory, index["metadata"]["saver_manifest"]), "rb") as f:
        raw = f.read()
    check(zlib.crc32(raw) == index["metadata"]["saver_manifest_crc32"], f"manifest of {directory}")
    return json.loads(raw)


def link_rows(directory, table, seen_codecs):
    """One link's table as {id: [row of each slot]}, from its partitions' segments."""
    rows = {}
    for p in table["partitions"]:
        for seg in p["segments"]:
            ids = tensor_array(directory, seg["ids"], seen_codecs)
            slots = [tensor_array(directory, r, seen_codecs) for r in seg["slots"]]
            # The bucket index: ascending (bucket << 48) | first_row, each naming the first row
            # of its bucket, the first entry the segment's first non-empty bucket.
            index = tensor_array(directory, seg["bucket_index"], seen_codecs)
            buckets = bucket(ids).astype(np.int64)
            check(len(ids) == 0 or (len(index) > 0 and int(index[0]) >> 48 == buckets[0]), "bucket index starts at the first bucket")
            check(bool(np.all(np.diff(index.astype(np.uint64)) > 0)), "bucket index ascending")
            rows_at = (index & np.uint64((1 << 48) - 1)).astype(np.int64)
            at_bucket = (index >> np.uint64(48)).astype(np.int64)
            check(bool(np.all(buckets[rows_at] == at_bucket)), "bucket index entries name their buckets' rows")
            check(bool(np.all((rows_at == 0) | (buckets[np.maximum(rows_at - 1, 0)] < at_bucket))), "...their first rows")
            for i, x in enumerate(ids.tolist()):
                rows[x] = [s[i] for s in slots]
    return rows


def read_checkpoint(directory, seen_codecs):
    """The model a checkpoint of any format version holds (a delta through its chain), read from
    its files by docs/FORMAT.md alone, sharing no code with saver: ({table: (ids, {slot: rows})},
    {dense name: array}, {row-range table: (rows, {slot: whole array})})."""
    links = []  # (directory, manifest), newest first
    d = directory
    while True:
        m = manifest_of(d)
        check(m["format_version"] in (1, 2, 3, 4, 5, 6), f"{d}: a known format version")
        check((m["format_version"] in (5, 6)) == bool(m.get("row_tables")), f"{d}: versions 5 and 6 if and only if row-range tables")
        check((m["format_version"] in (2, 4, 6)) == bool(m.get("parent")), f"{d}: version and parent agree")
        links.append((d, m))
        if not m.get("parent"):
            break
        parent = m["parent"]
        d = os.path.normpath(os.path.join(d, parent["path"]))
        check(manifest_of(d)["save_id"] == parent["save_id"], f"{d}: the parent the delta names")
    newest = links[0][1]
    tables = {}
    for t in newest["tables"]:
        if t["name"].endswith(":removed"):
            continue
        # Newest link first: the first link that holds an id as a row or a removal decides.
        resolved, decided = {}, set()
        for d, m in links:
            here = {x["name"]: x for x in m["tables"]}
            if t["name"] not in here:
                break
            for x, row in link_rows(d, here[t["name"]], seen_codecs).items():
                if x not in decided:
                    resolved[x] = row
                    decided.add(x)
            if t["name"] + ":removed" in here:
                decided.update(link_rows(d, here[t["name"] + ":removed"], seen_codecs))
        ids = np.array(list(resolved), dtype=DTYPES[t["key_dtype"]])
        slots = {}
        for k, s in enumerate(t["slots"]):
            rows = [resolved[x][k] for x in resolved]
            shape = [len(ids)] + s["shape"]
            slots[s["name"]] = np.array(rows, dtype=DTYPES[s["dtype"]]).reshape(shape)
        tables[t["name"]] = (ids, slots)
    dense = {e["tensor"]["name"]: tensor_array(links[0][0], e["tensor"], seen_codecs) for e in newest["dense"]}
    for name in newest.get("dense_in_parent", []):
        for d, m in links[1:]:
            e = next((x for x in m["dense"] if x["tensor"]["name"] == name), None)
            if e is not None:
                dense[name] = tensor_array(d, e["tensor"], seen_codecs)
                break
        check(name in dense, f"dense tensor {name} kept from a parent is in a link of the chain")
    row_tables = {}
    for t in newest.get("row_tables", []):
        slots = {}
        for s in t["slots"]:
            check(s["shape"][0] == t["rows"], f"{t['name']}/{s['name']}: the table's rows")
            slots[s["name"]] = resolve_row_slot(links, t["name"], s, seen_codecs)
        row_tables[t["name"]] = (t["rows"], slots)
    return tables, dense, row_tables


def resolve_row_slot(links, table, slot, seen_codecs):
    """Slot `slot` of row-range table `table` of the newest link, as a whole array: its chunks
    and its patches (version 6) tile it; a patch's rows are its parent's, with its changed rows
    put over them."""
    d, _ = links[0]
    whole = np.zeros(slot["shape"], dtype=DTYPES[slot["dtype"]])
    covered = np.zeros(slot["shape"], dtype=np.int64)
    for c in slot["chunks"]:
        a = tensor_array(d, c["tensor"], seen_codecs)
        at = tuple(slice(o, o + n) for o, n in zip(c["offset"], a.shape))
        whole[at] = a
        covered[at] += 1
    patches = slot.get("patches", [])
    if patches:
        check(len(links) > 1, f"{table}/{slot['name']}: a patch has a parent")
        parent = next(s for t in links[1][1]["row_tables"] if t["name"] == table for s in t["slots"] if s["name"] == slot["name"])
        check(parent["dtype"] == slot["dtype"] and parent["shape"] == slot["shape"], f"{table}/{slot['name']}: the parent's slot alike")
        before = resolve_row_slot(links[1:], table, parent, seen_codecs)
    for p in patches:
        at = tuple(slice(o, o + n) for o, n in zip(p["offset"], p["shape"]))
        whole[at] = before[at]
        covered[at] += 1
        if "changed" in p:
            rows = tensor_array(d, p["changed"]["rows"], seen_codecs)
            values = tensor_array(d, p["changed"]["values"], seen_codecs)
            check(bool(np.all(np.diff(rows.astype(np.int64)) > 0)), f"{table}/{slot['name']}: changed rows increase")
            cols = slice(p["offset"][1], p["offset"][1] + p["shape"][1]) if len(p["shape"]) == 2 else None
            if cols is None:
                whole[rows] = values
            else:
                whole[rows, cols] = values
    check(bool(np.all(covered == 1)), f"{table}/{slot['name']}: the chunks and patches tile the slot")
    return whole


def every_format_version_reads_by_the_spec():
    """A reader written from docs/FORMAT.md alone reads checkpoints of every format version: full
    (1), delta (2, with removed ids and dense tensors kept from the parent), compressed (3) and
    compressed delta (4), in a chain of three, and finds the model saver says is there (its
    digest) and, for the plain inputs, the very model that was saved."""
    rng = np.random.default_rng(11)
    n = 20000
    ids = rng.permutation(np.arange(-n, n, 2, dtype=np.int64) * 7919)
    base = {
        "user/ids": ids,
        # Low-entropy values, as trained embeddings' exponents are: zstd shrinks them.
        "user/embedding": np.round(rng.standard_normal((len(ids), 8)), 1).astype(np.float32),
        "user/clicks": rng.integers(0, 50, size=len(ids), dtype=np.int64),
        "tower.w": rng.standard_normal((64, 64)).astype(np.float32),
        "tower.b": np.arange(4096, dtype=np.int64),
    }

    def changed(model, seed):
        """Some rows changed, some removed, new ids added, tower.w changed, tower.b kept."""
        r = np.random.default_rng(seed)
        ids = model["user/ids"]
        keep = r.random(len(ids)) > 0.05
        new = r.integers(10**12, 10**13, size=500, dtype=np.int64) + seed * 10**13
        out = {"user/ids": np.concatenate([ids[keep], new])}
        emb = np.concatenate([model["user/embedding"][keep], np.ones((500, 8), np.float32)])
        clicks = np.concatenate([model["user/clicks"][keep], np.zeros(500, np.int64)])
        touched = r.random(len(emb)) < 0.1
        emb[touched] += 1
        clicks[touched] += 1
        out["user/embedding"], out["user/clicks"] = emb, clicks
        out["tower.w"] = model["tower.w"] * 2
        out["tower.b"] = model["tower.b"]
        return out

    def as_tables(model):
        return (
            {"user": (model["user/ids"], {"embedding": model["user/embedding"], "clicks": model["user/clicks"]})},
            {"tower.w": model["tower.w"], "tower.b": model["tower.b"]},
        )

    models = [base, changed(base, 1)]
    models.append(changed(models[1], 2))
    dirs = []
    for k, model in enumerate(models):
        src = os.path.join(WORK, f"versions-in{k}")
        os.makedirs(src, exist_ok=True)
        save_file(model, os.path.join(src, "model.safetensors"))
        out = os.path.join(WORK, f"versions-{k}")
        args = ["save", "--from", src, "--out", out, "--shards", str(2 + k), "--no-fsync"]
        if k > 0:
            args += ["--parent", dirs[-1]]
        if k == 2:
            args += ["--compress", "zstd"]
        saver(*args)
        dirs.append(out)
    synthetic = os.path.join(WORK, "versions-synthetic-zstd")
    # One shard of 100,000 rows: its bucket indexes are large enough to be compressed (delta8).
    saver("save", "--synthetic", "small,rows=100000", "--shards", "1", "--compress", "zstd", "--out", synthetic, "--no-fsync")
    # Row-range tables (version 5), raw and compressed, written as three shards' row chunks; then
    # deltas of them (version 6) with 3% and 60% of their rows touched, as two and one shards.
    row_range = []
    spec = "tiny,kind=rows,rows=30001,dim=12"
    for compress in ([], ["--compress", "zstd"]):
        out = os.path.join(WORK, f"versions-rows{len(row_range)}")
        saver("save", "--synthetic", spec, "--shards", "3", "--out", out, "--no-fsync", *compress)
        row_range.append(out)
    for touched, shards in ((3, 2), (60, 1)):
        out = os.path.join(WORK, f"versions-rows{len(row_range)}")
        saver("save", "--synthetic", f"{spec},touched={touched}", "--shards", str(shards), "--out", out, "--parent", row_range[-1], "--no-fsync", "--compress", "zstd")
        row_range.append(out)
    check(any(s.get("patches") for t in manifest_of(row_range[2])["row_tables"] for s in t["slots"]), "a delta of few touched rows holds patches")
    versions = set()
    seen_codecs = set()
    for k, d in enumerate(dirs + [synthetic] + row_range):
        version = manifest_of(d)["format_version"]
        versions.add(version)
        tables, dense, rows = read_checkpoint(d, seen_codecs)
        check(digest(tables, dense, row_tables=rows) == saver("digest", d).strip(), f"{d} (version {version}) reads as saver reads it")
        if k < len(models):
            check(digest(tables, dense) == digest(*as_tables(models[k])), f"{d} holds the model saved into it")
    check(manifest_of(dirs[1]).get("dense_in_parent") == ["tower.b"], "the delta keeps tower.b from its parent")
    check(any(t["name"] == "user:removed" for t in manifest_of(dirs[1])["tables"]), "the delta removes ids")
    check(versions == {1, 2, 3, 4, 5, 6}, f"every format version read: {sorted(versions)}")
    check({"delta8", "shuffle8", "shuffle4"} <= seen_codecs, f"filters decoded: {sorted(seen_codecs)}")


saver_files_hold_the_manifest_bytes()
plain_input_round_trips()
every_format_version_reads_by_the_spec()
quantized_exports_match_fbgemm()
if os.environ.get("SAVER_INTEROP_HF"):
    hugging_face_loaders_read_checkpoint_files()
print(f"interop: {CHECKS} passed, 0 failed")
