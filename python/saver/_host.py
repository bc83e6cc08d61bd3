"""The host seam: where a tensor or array the caller gives becomes host memory that the native
module reads or fills, and where loaded memory becomes a tensor again. Every tensor that
`saver.save`, `saver.load` and `saver.torch` read or fill passes here, and no other module
calls `.cpu()` or `.numpy()` or decides what a device tensor gets (python/tests/test_host.py
holds the package to it).

A CPU tensor or a numpy array is taken as it is, without a copy. A tensor in device memory
that a save gives as a dense tensor or a row-range chunk (every tensor of `saver.torch`) is
staged: the save's writers read it a chunk at a time through a bounded ring of host buffers
(`_staging`), never whole. A device tensor among a hashed table's columns is copied to the host
(its rows are read in bucket order, not in runs). A device tensor is refused where saver would
fill in place or keep a view of it (`writable`, `on_host`), but for the buffers of a load's
row-range targets, which land through bounded host buffers (`_staging.Landing`). torch is imported only
when a tensor is given."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _staging
from ._dtypes import _ML_DTYPES_PATTERNS, _PATTERN_BITS, _PATTERN_TYPE, _TORCH_PATTERNS, Bits
from ._errors import InputError


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "detach") and hasattr(value, "numpy")


def _pattern_view(t, pattern: str) -> Bits:
    """A host tensor of a dtype numpy has no type for, as its bit patterns (no copy)."""
    import torch

    width = torch.int16 if _PATTERN_BITS[pattern] == 16 else torch.int8
    return Bits(t.view(width).numpy(), pattern)


def saver_dtype_of(tensor: Any, what: str) -> str:
    """The saver dtype name of a torch tensor's dtype."""
    import torch

    pattern = _TORCH_PATTERNS.get(str(tensor.dtype))
    if pattern is not None:
        return pattern
    from . import _dtype_name

    return _dtype_name(torch.empty((), dtype=tensor.dtype).numpy(), what)


def readable(value: Any, what: str, staging: Optional[_staging.Staging] = None):
    """``value`` as a C-contiguous numpy array a save reads: no copy for a contiguous array or
    a CPU torch tensor, one copy for a strided view or a tensor on another device. With
    ``staging``, a device tensor comes as a :class:`_staging.StagedTensor` its save reads
    through the staging ring instead (no whole copy)."""
    if staging is not None and _staging.is_staged(value):
        return staging.add(value, what, saver_dtype_of(value, what))
    if _is_tensor(value):
        # `.numpy()` shares a CPU tensor's memory.
        t = value.detach().cpu()
        pattern = _TORCH_PATTERNS.get(str(t.dtype))
        value = _pattern_view(t.contiguous(), pattern) if pattern is not None else t.numpy()
    elif getattr(getattr(value, "dtype", None), "name", None) in _ML_DTYPES_PATTERNS and not isinstance(value, Bits):
        a = np.asarray(value)
        pattern = _ML_DTYPES_PATTERNS[a.dtype.name]
        value = Bits(a.view(_PATTERN_TYPE[_PATTERN_BITS[pattern]]), pattern)
    if isinstance(value, Bits):
        return value if value.flags.c_contiguous else Bits(np.ascontiguousarray(value), value.saver_dtype)
    try:
        a = np.asarray(value)
    except Exception as e:  # numpy's own errors name nothing of ours
        raise InputError(f"{what}: not an array ({e})") from None
    if a.dtype.byteorder == ">":
        raise InputError(f"{what}: big-endian arrays are not supported; use a.astype(a.dtype.newbyteorder('<'))")
    # `ascontiguousarray` would make a 0-d array 1-d; a 0-d array is contiguous.
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def writable(value: Any, what: str, landing: Optional[_staging.Landing] = None):
    """``value`` as a writable C-contiguous numpy array over the caller's memory, which a load
    fills in place (a CPU torch tensor shares it; a dtype numpy has no type for comes as a
    :class:`Bits` view of it), or an :class:`InputError`: a load into a copy would be lost.
    With ``landing``, a device tensor comes as a :class:`_staging.DeviceTarget` that
    ``landing`` fills through its host buffers (its ``like``: a zero-size host array of its
    dtype, for the load's checks)."""
    if landing is not None and _staging.is_staged(value):
        import torch

        t = value.detach()
        return landing.target(t, what, writable(torch.empty(0, dtype=t.dtype), what))
    if _is_tensor(value):
        t = value.detach()
        on_host(t, what, "load into a CPU tensor and copy it over")
        pattern = _TORCH_PATTERNS.get(str(t.dtype))
        value = _pattern_view(t, pattern) if pattern is not None else t.numpy()
    elif getattr(getattr(value, "dtype", None), "name", None) in _ML_DTYPES_PATTERNS and not isinstance(value, Bits):
        pattern = _ML_DTYPES_PATTERNS[value.dtype.name]
        value = Bits(value.view(_PATTERN_TYPE[_PATTERN_BITS[pattern]]), pattern)
    if not isinstance(value, np.ndarray):
        raise InputError(f"{what}: give a numpy array or a torch tensor to fill, got {type(value).__name__}")
    if not value.flags.c_contiguous or not value.flags.writeable:
        raise InputError(f"{what}: the buffer must be C-contiguous and writable (it is filled in place)")
    return value


def on_host(tensor: Any, what: str, instead: str) -> None:
    """Refuses a tensor that is not in host memory where saver would read or fill it in place:
    ``what`` names it, ``instead`` says what to do."""
    device = getattr(tensor, "device", None)
    if device is not None and device.type != "cpu":
        raise InputError(f"{what} is on {device}; {instead}")


def torch_dtypes() -> dict:
    """Every saver dtype torch has, by its saver name."""
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
            "U8": torch.uint8, "BOOL": torch.bool}


def torch_dtype(name: str, what: str):
    """The torch dtype of saver dtype ``name``, or an :class:`InputError` naming ``what``."""
    dtypes = torch_dtypes()
    if name not in dtypes:
        raise InputError(f"{what}: dtype {name} has no torch type here")
    return dtypes[name]


def known_torch_dtype(name: str):
    """The torch dtype of saver dtype ``name``, or None where torch has none."""
    try:
        return torch_dtype(name, "")
    except InputError:
        return None


def tensor_of(array: Any, dtype=None):
    """A loaded array as a CPU tensor over its memory (16-bit and 8-bit float patterns viewed
    as `dtype`). A 0-d array stays 0-d (numpy's ascontiguousarray would make it 1-d)."""
    import torch

    a = np.asarray(array)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a).reshape(array.shape)
    if isinstance(array, Bits):
        raw = torch.from_numpy(a.view(np.uint8).reshape(-1))
        return raw.view(dtype).reshape(array.shape) if dtype is not None else raw
    return torch.from_numpy(a).reshape(array.shape)


def copy_into(target: Any, array: Any, name: str) -> None:
    """Copies a loaded array into `target` (a tensor of the model), shape and dtype checked."""
    import torch

    src = tensor_of(array, target.dtype)
    if tuple(src.shape) != tuple(target.shape) or src.dtype != target.dtype:
        raise InputError(f"{name}: the checkpoint holds {src.dtype} of shape {tuple(src.shape)}, the model {target.dtype} of shape {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(src)


def on_cuda(tensor: Any) -> bool:
    """Whether ``tensor`` lives in CUDA memory."""
    return bool(getattr(tensor, "is_cuda", False))


def pin_host_copies(tensors) -> bool:
    """Whether host copies of ``tensors`` are to be pinned: some live in CUDA memory (and CUDA
    is here), so that their copies to and from the device run asynchronously."""
    import torch

    return any(on_cuda(t) for t in tensors) and torch.cuda.is_available()


def empty_beside(like: Any, shape, dtype):
    """An uninitialized tensor of ``shape`` and ``dtype`` on ``like``'s device: a load's target
    for optimizer state the optimizer has not made yet, which must live where its parameter
    does (a CUDA parameter's Adagrad sum on the CUDA device, filled through a landing)."""
    import torch

    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def copied_beside(tensor: Any, like: Any):
    """A copy of ``tensor`` on ``like``'s device."""
    return tensor.to(like.device, copy=True)
