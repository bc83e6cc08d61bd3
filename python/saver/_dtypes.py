"""The dtypes of saver's safetensors files and the numpy, torch and ml_dtypes types that hold
them; `Bits`, the bit patterns of dtypes numpy has no type for."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._errors import InputError


# numpy dtypes and the safetensors dtype names the core uses.
_TO_SAVER = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
}
_TO_NUMPY = {name: dt for dt, name in _TO_SAVER.items()}

# Dtypes numpy has no type for, by their width in bits: given and returned as their bit patterns
# in a `Bits` array.
_PATTERN_BITS = {
    "BF16": 16,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
}
_PATTERN_TYPE = {16: np.dtype(np.uint16), 8: np.dtype(np.uint8)}

# torch dtypes numpy cannot hold (their `.numpy()` raises), by name, and the saver dtype of each.
_TORCH_PATTERNS = {
    "torch.bfloat16": "BF16",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.float8_e8m0fnu": "F8_E8M0",
    "torch.float8_e4m3fnuz": "F8_E4M3FNUZ",
    "torch.float8_e5m2fnuz": "F8_E5M2FNUZ",
}
# The same from the numpy dtypes of the ml_dtypes package (JAX's), by name.
_ML_DTYPES_PATTERNS = {
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
}


class Bits(np.ndarray):
    """Values of a dtype numpy has no type for (bfloat16, the 8-bit floats), as their bit
    patterns: a ``uint16`` or ``uint8`` array that knows its saver dtype (``.saver_dtype``).

    A load returns such slots and tensors as ``Bits``, and a save stores a ``Bits`` array as its
    dtype, so a model loaded and saved again keeps it. ``torch.bfloat16`` tensors and ml_dtypes
    arrays are taken as they are; wrap 16-bit patterns of your own with ``Bits(a, "BF16")``.
    ``torch.from_numpy(b).view(torch.bfloat16)`` reads a ``Bits`` of BF16 as bfloat16, no copy.
    """

    def __new__(cls, patterns: Any, dtype: str) -> "Bits":
        bits = _PATTERN_BITS.get(dtype)
        if bits is None:
            raise InputError(f"Bits: dtype must be one of {sorted(_PATTERN_BITS)}, got {dtype!r}")
        a = np.asarray(patterns)
        if a.dtype.kind not in "ui" or a.dtype.itemsize * 8 != bits:
            raise InputError(
                f"Bits: {dtype} values are {bits}-bit patterns, given as uint{bits} or int{bits}; "
                f"got {a.dtype}"
            )
        out = a.view(_PATTERN_TYPE[bits]).view(cls)
        out.saver_dtype = dtype
        return out

    def __array_finalize__(self, obj: Any) -> None:
        # Slices and views of a `Bits` array keep its dtype.
        self.saver_dtype = getattr(obj, "saver_dtype", None)
