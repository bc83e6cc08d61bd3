"""Writes a plain safetensors model of about SIZE bytes, in bounded memory, for the streaming
benchmarks: one table `emb` (unique, scrambled I64 ids; slots `embedding` and `adagrad`, F32, 32
wide: 264 bytes a row) plus 4 MiB of dense weights.

    python make_plain_model.py OUT.safetensors SIZE_GIB
"""

import json
import struct
import sys

import numpy as np

DIM = 32
ROW = 8 + 2 * DIM * 4
DENSE = 4 << 20
CHUNK = 1 << 20


def main() -> None:
    out, gib = sys.argv[1], float(sys.argv[2])
    rows = int((gib * (1 << 30) - DENSE) // ROW)
    sizes = [("emb/ids", "I64", [rows], rows * 8)]
    sizes += [(f"emb/{s}", "F32", [rows, DIM], rows * DIM * 4) for s in ("embedding", "adagrad")]
    sizes += [("mlp/weight", "F32", [DENSE // 4], DENSE)]
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, n in sizes:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    # An odd multiplier is a bijection on 64-bit integers: unique ids in no particular order.
    mult = np.uint64(0x9E3779B97F4A7C15)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for lo in range(0, rows, CHUNK):
            n = min(CHUNK, rows - lo)
            f.write((np.arange(lo, lo + n, dtype=np.uint64) * mult).tobytes())
        rng = np.random.default_rng(7)
        for _ in range(2):
            for lo in range(0, rows, CHUNK):
                n = min(CHUNK, rows - lo)
                f.write(rng.standard_normal((n, DIM), dtype=np.float32).tobytes())
        f.write(rng.standard_normal(DENSE // 4, dtype=np.float32).tobytes())
    print(f"{out}: {rows} rows, {off + 8 + len(h)} bytes")


if __name__ == "__main__":
    main()
