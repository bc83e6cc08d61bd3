"""saver: checkpoints of large recommendation models, from Python.

Sparse tables (ids and slot arrays) and dense tensors are saved as sharded safetensors files
with a manifest, committed crash-safely, and loaded back by any number of workers. The Rust core
does all the work, with the GIL released; this module checks arguments and converts numpy
arrays (and anything ``numpy.asarray`` accepts, such as CPU torch tensors) to and from it.

>>> import numpy as np, saver
>>> ids = np.arange(1000, dtype=np.int64)
>>> emb = np.random.rand(1000, 16).astype(np.float32)
>>> report = saver.save("/tmp/ckpt", tables={"user": {"ids": ids, "embedding": emb}})
>>> loaded = saver.load("/tmp/ckpt", shards=4, shard_index=1)  # a quarter of the rows

Errors are :class:`SaverError` (the core's one-line messages, as the ``saver`` binary prints
them) or :class:`InputError` (bad arguments, found before anything is written; also a
``ValueError``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from . import _host, _staging
from ._dtypes import _PATTERN_BITS, _PATTERN_TYPE, _TO_NUMPY, _TO_SAVER, Bits
from ._errors import InputError, ReplacedError, SaverError, SaverWarning
from ._native import native as _saver

# Defined in the package's parts, shown (in reprs, tracebacks and pickles) as the package's own.
for _public in (Bits, InputError, ReplacedError, SaverWarning):
    _public.__module__ = __name__
del _public

__all__ = [
    "Bits",
    "Checkpoint",
    "Chunk",
    "InputError",
    "Loaded",
    "Manager",
    "ReplacedError",
    "SaveHandle",
    "SaveReport",
    "SaverError",
    "SaverWarning",
    "background_memory",
    "digest",
    "load",
    "open",
    "release_background_memory",
    "row_cut",
    "save",
    "save_async",
    "shard_of",
    "verify",
]

PathLike = Union[str, "os.PathLike[str]"]
ArrayLike = Any


def _int(name: str, value: Any, low: int, high: int = (1 << 64) - 1, *, optional: bool = False):
    """``value`` as an int within ``[low, high]``, or an :class:`InputError` naming the argument
    (the native module would raise a bare ``TypeError`` or ``OverflowError``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < low or v > high:
        raise InputError(f"{name}: must be from {low} to {high}, got {v}")
    return v


def _counts(options: dict) -> None:
    """Checks the integer options of a save in place."""
    options["shards"] = _int("shards", options["shards"], 1, (1 << 32) - 1)
    options["shard_index"] = _int(
        "shard_index", options["shard_index"], 0, options["shards"] - 1, optional=True
    )
    options["step"] = _int("step", options["step"], 0, optional=True)
    options["parallel"] = _int("parallel", options["parallel"], 1, 4096, optional=True)


def _dtype_name(a: np.ndarray, what: str) -> str:
    if isinstance(a, (Bits, _staging.StagedTensor)) and a.saver_dtype is not None:
        return a.saver_dtype
    name = _TO_SAVER.get(a.dtype.newbyteorder("="))
    if name is None:
        supported = ", ".join(sorted(str(d) for d in _TO_SAVER))
        raise InputError(
            f"{what}: dtype {a.dtype} is not supported (supported: {supported}; and, as "
            f"saver.Bits of their bit patterns, {', '.join(sorted(_PATTERN_BITS))})"
        )
    return name


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 view (no copy); a staged device
    tensor is its own source of bytes."""
    if isinstance(a, _staging.StagedTensor):
        return a
    return a.reshape(-1).view(np.uint8)


@dataclass
class SaveReport:
    """What a save did."""

    save_id: str
    shards: list
    files: int
    rows: int
    bytes_written: int
    #: Rows given to this process that belong to other processes' shards, left out because
    #: ``foreign_rows="skip"`` (0 otherwise: such rows are refused).
    skipped_rows: int
    plan_seconds: float
    write_seconds: float
    commit_seconds: float
    committed: bool
    #: Of a :class:`Manager`'s save: why it is full rather than a delta (``None``: a delta, or
    #: not a managed save).
    full_because: Optional[str] = None
    #: Bytes of device tensors the save read through the staging ring (0 for a model in host
    #: memory), and the ring's host memory (pinned on CUDA; ``staging_bytes``).
    staged_bytes: int = 0
    staging_bytes: int = 0
    #: Of a background save of device tensors: how it took its moment, ``"device copy"`` (a
    #: copy in device memory, drained through the ring as the save writes) or ``"host copy"``
    #: (copied through the ring into host memory during the call); and the device memory the
    #: device copy used.
    moment: Optional[str] = None
    device_copy_bytes: int = 0


# Rows a row filter sees at a time.
_FILTER_ROWS = 1 << 20


def _filtered(name, columns, keep):
    """The rows of a table that ``keep`` keeps: called with a dict of column arrays (``"ids"``
    and every slot) for up to ``_FILTER_ROWS`` rows at a time, it returns a boolean array with one
    entry per row. The kept rows are copied out once."""
    arrays = {k: _host.readable(v, f"table {name!r} column {k!r}") for k, v in columns.items()}
    n = len(arrays["ids"]) if "ids" in arrays else 0
    masks = []
    for start in range(0, n, _FILTER_ROWS):
        batch = {k: v[start : start + _FILTER_ROWS] for k, v in arrays.items()}
        mask = np.asarray(keep(batch))
        if mask.dtype != np.bool_ or mask.shape != (len(batch["ids"]),):
            raise InputError(
                f"table {name!r}: row_filter must return a bool array of {len(batch['ids'])} rows, "
                f"got {mask.dtype} of shape {mask.shape}"
            )
        masks.append(mask)
    mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.bool_)
    return {k: v[mask] if v.ndim and len(v) == n else v for k, v in arrays.items()}


class Chunk:
    """A piece of a row-range table's slot (a table whose ids are its row numbers: an
    ``nn.Embedding`` weight, its optimizer state), at its place in the whole slot.

    To save: ``Chunk(values, offset=(row, col), shape=(rows, cols))`` for rows
    ``row..row + len(values)`` and columns ``col..col + values.shape[1]`` of a slot of ``shape``;
    ``offset=(row,)`` and ``shape=(rows,)`` for a state of one value per row. Defaults: the
    whole slot. A table of such slots is given as ``{slot: Chunk or [Chunk, ...]}`` (no
    ``"ids"``); each process gives the chunks it holds, and together they must cover every slot
    exactly, or the save fails naming it. The arrays are read in place (numpy arrays, CPU torch
    tensors, bfloat16 included).

    To load: ``saver.load(path, into={table: {slot: Chunk(buffer, offset=(row, col))}})`` fills
    ``buffer`` in place with the slot's values at that place, whatever split they were saved in.
    """

    def __init__(self, values: ArrayLike, offset: Optional[Sequence[int]] = None,
                 shape: Optional[Sequence[int]] = None):
        self.values = values
        self.offset = None if offset is None else tuple(int(o) for o in offset)
        self.shape = None if shape is None else tuple(int(d) for d in shape)

    def __repr__(self) -> str:
        shape = getattr(self.values, "shape", None)
        return f"Chunk(values of shape {tuple(shape) if shape is not None else '?'}, offset={self.offset}, shape={self.shape})"


def _is_row_range(columns) -> bool:
    """Whether a table's columns are chunks of a row-range table rather than hashed columns."""
    return "ids" not in columns and any(
        isinstance(v, Chunk) or (isinstance(v, (list, tuple)) and v and isinstance(v[0], Chunk))
        for v in columns.values()
    )


def _chunk_arguments(name, columns, staging):
    """The native arguments of a row-range table's chunks (a chunk in device memory staged)."""
    out = []
    for slot, given in columns.items():
        for c in given if isinstance(given, (list, tuple)) else [given]:
            what = f"row-range table {name!r} slot {slot!r}"
            if not isinstance(c, Chunk):
                raise InputError(f"{what}: give saver.Chunk values (a table without 'ids' is a row-range table), got {type(c).__name__}")
            a = _host.readable(c.values, what, staging)
            if a.ndim not in (1, 2):
                raise InputError(f"{what}: a chunk has one dimension (a value per row) or two (rows, columns), got shape {a.shape}")
            offset = c.offset if c.offset is not None else (0,) * a.ndim
            shape = c.shape if c.shape is not None else tuple(o + d for o, d in zip(offset, a.shape))
            if len(offset) != a.ndim or len(shape) != a.ndim:
                raise InputError(f"{what}: offset {offset} and shape {shape} need {a.ndim} entries, as the chunk {a.shape} has")
            for v, arg in ((offset, "offset"), (shape, "shape")):
                if any(x < 0 for x in v):
                    raise InputError(f"{what}: {arg} {v} has a negative entry")
            out.append((name, slot, _dtype_name(a, what), [int(d) for d in a.shape], list(offset), list(shape), _bytes(a)))
    return out


def _save_arguments(tables, dense, options, staging):
    """The arguments of the native save: tables and dense tensors as flat bytes with their dtype
    names and shapes, row-range chunks with their places, and the options as a dict. Dense
    tensors and chunks in device memory are added to ``staging``."""
    _counts(options)
    row_filter = options.get("row_filter")
    if row_filter is not None:
        tables = {name: _filtered(name, columns, row_filter) for name, columns in (tables or {}).items()}
    if options.get("compress") not in (None, "zstd"):
        raise InputError(f"compress: must be None or 'zstd', got {options['compress']!r}")
    if options.get("direct_io", "auto") not in ("auto", "on", "off"):
        raise InputError(f"direct_io: must be 'auto', 'on' or 'off', got {options['direct_io']!r}")
    wait = options.get("wait")
    # The bound is the library's (saver_io::SaveSettings, a week, as `saver save --wait-seconds`),
    # checked here first so that a wrong type or value is an InputError before any array is read.
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 7 * 86_400):
        raise InputError(f"wait: must be a number of seconds from 0 to a week (604800), or None, got {wait!r}")
    if options["foreign_rows"] not in ("error", "skip"):
        raise InputError(f"foreign_rows: must be 'error' or 'skip', got {options['foreign_rows']!r}")
    tables_in = []
    chunks_in = []
    for name, columns in (tables or {}).items():
        if _is_row_range(columns):
            if row_filter is not None:
                raise InputError(f"row-range table {name!r}: row_filter applies to tables with ids only")
            chunks_in.extend(_chunk_arguments(name, columns, staging))
            continue
        if "ids" not in columns:
            raise InputError(
                f"table {name!r}: no 'ids' array among its columns {sorted(columns)} (a table whose "
                f"ids are its row numbers is given as saver.Chunk values)"
            )
        ids = _host.readable(columns["ids"], f"table {name!r} ids")
        if ids.ndim != 1:
            raise InputError(f"table {name!r} ids: must be 1-D, got shape {ids.shape}")
        if ids.dtype == np.int64:
            key = "I64"
        elif ids.dtype == np.uint64:
            key = "U64"
        else:
            raise InputError(f"table {name!r} ids: must be int64 or uint64, got {ids.dtype}")
        slots = []
        for slot, value in columns.items():
            if slot == "ids":
                continue
            what = f"table {name!r} slot {slot!r}"
            a = _host.readable(value, what)
            if a.ndim == 0 or a.shape[0] != ids.shape[0]:
                rows = "a scalar" if a.ndim == 0 else f"{a.shape[0]} rows"
                raise InputError(f"{what}: {rows} for {ids.shape[0]} ids")
            slots.append((slot, _dtype_name(a, what), [int(d) for d in a.shape[1:]], _bytes(a)))
        tables_in.append((name, key, ids.view(np.uint64), slots))
    dense_in = []
    for name, value in (dense or {}).items():
        what = f"dense tensor {name!r}"
        a = _host.readable(value, what, staging)
        dense_in.append((name, _dtype_name(a, what), [int(d) for d in a.shape], _bytes(a)))
    args = dict(options)
    args.pop("row_filter", None)
    args.pop("staging_bytes", None)
    args.pop("device_copy", None)
    args["metadata"] = {str(k): str(v) for k, v in (args["metadata"] or {}).items()}
    for key in ("exclude_slots", "keep_rows"):
        given = args[key]
        args[key] = [given] if isinstance(given, str) else [str(g) for g in given]
    args["parent"] = None if args["parent"] is None else os.fspath(args["parent"])
    args["skip_foreign_rows"] = args.pop("foreign_rows") == "skip"
    return tables_in, dense_in, chunks_in, args


def _staged_arguments(tables, dense, options, background=False):
    """The native save's arguments of ``tables``, ``dense`` and ``options``, with the staging
    of their device tensors, started (for a background save: its moment taken)."""
    staging = _staging.Staging(options.get("staging_bytes"), options.get("device_copy") if background else None)
    arguments = _save_arguments(tables, dense, options, staging)
    staging.start(background)
    return arguments, staging


def _saved(call, tables, dense, options) -> SaveReport:
    """Runs the native save ``call`` on ``tables``, ``dense`` and ``options``; its report
    with the staging's."""
    arguments, staging = _staged_arguments(tables, dense, options)
    return SaveReport(**call(*arguments), **staging.report())


def save(
    path: PathLike,
    tables: Optional[Mapping[str, Mapping[str, ArrayLike]]] = None,
    dense: Optional[Mapping[str, ArrayLike]] = None,
    *,
    shards: int = 1,
    shard_index: Optional[int] = None,
    save_id: Optional[str] = None,
    parallel: Optional[int] = None,
    step: Optional[int] = None,
    metadata: Optional[Mapping[str, str]] = None,
    overwrite: bool = False,
    durable: bool = True,
    foreign_rows: str = "error",
    parent: Optional[PathLike] = None,
    exclude_slots: Union[str, Sequence[str]] = (),
    keep_rows: Union[str, Sequence[str]] = (),
    row_filter: Optional[Any] = None,
    compress: Optional[str] = None,
    direct_io: str = "auto",
    wait: Optional[float] = None,
    staging_bytes: Optional[int] = None,
) -> SaveReport:
    """Saves sparse tables and dense tensors as a checkpoint at ``path`` (a directory or an
    ``s3://bucket/prefix`` location), committed when this returns.

    ``tables`` maps a table name to its columns: ``"ids"``, a 1-D int64 or uint64 array of
    distinct ids, and one array per slot whose first dimension is the number of ids (row ``i`` of
    every slot belongs to ``ids[i]``). ``dense`` maps a tensor name to an array. Arrays may be
    numpy arrays, torch tensors (CPU or CUDA: see ``staging_bytes``) or anything
    ``numpy.asarray`` takes; a strided view is copied once, a contiguous array is not. A CUDA
    tensor among a hashed table's columns is copied to the host whole.

    ``shards``: the number of shards of the checkpoint; with ``shard_index``, this process writes
    only that shard (every process of a multi-process save passes the same ``save_id`` and every
    dense tensor; the last one to finish commits). ``parallel``: writer threads (default: the
    cores). ``step`` and ``metadata`` are stored in the manifest. An existing checkpoint at
    ``path`` is replaced only with ``overwrite=True``. ``durable=False`` leaves the data in the
    page cache (no fsync). ``foreign_rows``: what a process writing one shard does with rows of
    other shards: ``"error"`` (the default: they would be lost) or ``"skip"`` (right when every
    process holds the whole table). ``parent``: a committed checkpoint (or delta) this save is a
    delta of: only the rows changed or inserted since it, and the ids removed since it, are
    written. ``exclude_slots``: glob patterns of slots not to save (e.g. ``"adagrad*"`` for a
    serving copy). ``keep_rows``: conditions on a scalar slot, as the binary's ``--keep-rows``
    (``"freq>=3"``): only rows that meet all of them are saved. ``row_filter``: a vectorised
    predicate, called with each table's columns (``"ids"`` and every slot, a dict of arrays) a
    million rows at a time, returning a bool array: the rows it keeps are saved (copied out
    once), e.g. ``lambda c: (c["freq"] >= 3) & (np.abs(c["embedding"]).sum(axis=1) > 0)``.
    ``compress="zstd"`` compresses each tensor where it pays (ids, mostly-zero rows and
    low-precision values shrink; fp32 embeddings hardly do): the files stay safetensors, and
    every reader of this package reads them. ``direct_io``: ``"auto"`` (the default) writes a
    durable save on local ext4 and XFS around the page cache, through about 40 MiB of aligned
    staging buffers, the fastest here; ``"off"`` writes through the page cache straight from
    the arrays (no staging memory, slower); ``"on"`` wherever the filesystem takes it.
    ``wait``: with ``shard_index``, the seconds (0 to a week) this process waits for the other
    shards and the commit before it fails naming the missing shards (default: none, it returns
    once its shard is written and the last process commits; a :class:`Manager`'s saves wait
    600 s, so that every process decides the next save from the same committed steps).
    ``staging_bytes``: the host memory (pinned on CUDA) through which dense tensors and chunks
    in device memory are read, a writer's chunk at a time, while the writers write the chunks
    before (default: the smaller of 256 MiB and 1/8 of those tensors); the report's
    ``staged_bytes`` and ``staging_bytes`` say what it read and held. Its copies come after the
    work queued on the caller's current CUDA stream. A device tensor whose storage is freed
    (size 0) fails the save, naming it.

    Every array is read in place (no copy), so none may change until this returns; other Python
    threads run meanwhile. :func:`save_async` copies them instead, and returns.
    """
    options = dict(
        shards=shards,
        shard_index=shard_index,
        save_id=save_id,
        parallel=parallel,
        step=step,
        metadata=metadata,
        overwrite=overwrite,
        durable=durable,
        foreign_rows=foreign_rows,
        parent=parent,
        exclude_slots=exclude_slots,
        keep_rows=keep_rows,
        row_filter=row_filter,
        compress=compress,
        direct_io=direct_io,
        wait=wait,
        staging_bytes=staging_bytes,
    )
    return _saved(lambda *a: _saver.save(os.fspath(path), *a), tables, dense, options)


class SaveHandle:
    """A save running in the background (:func:`save_async`)."""

    def __init__(self, native, staging=None):
        self._native = native
        self._staging = staging

    def done(self) -> bool:
        """Whether the save has ended, committed or failed (``wait`` then returns at once)."""
        return self._native.done()

    @property
    def bytes_written(self) -> int:
        """Bytes written so far."""
        return self._native.bytes_written()

    def wait(self) -> SaveReport:
        """Waits for the save (other Python threads run meanwhile) and returns its report, or
        raises its error. Only once."""
        return SaveReport(**self._native.wait(), **(self._staging.report() if self._staging else {}))


def _started(call, tables, dense, options):
    """Starts the native background save ``call``: (its handle, the staging it copied
    through)."""
    arguments, staging = _staged_arguments(tables, dense, options, background=True)
    return call(*arguments), staging


def save_async(
    path: PathLike,
    tables: Optional[Mapping[str, Mapping[str, ArrayLike]]] = None,
    dense: Optional[Mapping[str, ArrayLike]] = None,
    **options: Any,
) -> SaveHandle:
    """:func:`save` in the background: returns once the save's moment is fixed, that is once
    every table's rows and every dense tensor are copied, so that training may change its arrays
    from then on; the checkpoint shows them as they were at the call. The moment is exact for
    arrays that nothing writes while the call runs: the copy is taken by several threads while it
    holds the GIL, but numpy and torch release the GIL inside their own large writes, so a write
    by another thread during the call may be in the copy or not, part by part (rows of two
    values). Call it where the training loop itself writes, between its steps, and let no other
    thread write the arrays until it returns. The save runs on threads of its own at a
    lower CPU priority. Options as :func:`save`. Errors found before the moment (bad arguments)
    are raised here; later ones by :meth:`SaveHandle.wait`. The copies' memory is kept for the
    next background save (:func:`background_memory`).

    Tensors in device memory: where every device has room for a copy of them (or with
    ``device_copy=True``), the moment is a copy on the device, taken after the work queued on
    the caller's current stream (which then waits for it, so the caller may write the tensors
    at once without the host waiting), and the save drains it through the staging ring as it
    writes, freeing it when it ends; otherwise (``device_copy=False``, or no room) they are
    copied through the ring into host memory during the call. The report's ``moment`` and
    ``device_copy_bytes`` say which, and what it used."""
    return SaveHandle(*_started(lambda *a: _saver.save_async(os.fspath(path), *a), tables, dense, _options(options)))


@dataclass
class Loaded:
    """What :func:`load` returns: per table its columns (``"ids"`` and one array per slot, row
    ``i`` of each belonging to ``ids[i]``, in checkpoint order), the dense tensors, and figures.
    Every array owns memory the core filled directly: ``torch.from_numpy`` takes it without a
    copy."""

    tables: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)


def _typed(data: np.ndarray, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """Loaded bytes as an array of ``shape``: of its numpy dtype, or, for bfloat16 and the
    8-bit floats, their bit patterns in a :class:`Bits` array; the raw bytes of any other."""
    numpy_dtype = _TO_NUMPY.get(dtype)
    if numpy_dtype is not None:
        return data.view(numpy_dtype).reshape(shape)
    bits = _PATTERN_BITS.get(dtype)
    if bits is not None:
        return Bits(data.view(_PATTERN_TYPE[bits]).reshape(shape), dtype)
    # A dtype without fixed-width elements numpy could hold (micro-scaling formats): its bytes.
    return data.reshape((shape[0], -1)) if len(shape) and shape[0] else data.reshape((0, 0))


def _rows(data: np.ndarray, dtype: str, shape: Sequence[int], rows: int) -> np.ndarray:
    return _typed(data, dtype, (rows, *shape))


def load(
    path: PathLike,
    *,
    shards: int = 1,
    shard_index: Optional[int] = None,
    tables: Optional[Sequence[str]] = None,
    exclude_slots: Union[str, Sequence[str]] = (),
    dense: bool = True,
    parallel: Optional[int] = None,
    into: Optional[Mapping[str, Mapping[str, "Chunk"]]] = None,
    staging_bytes: Optional[int] = None,
) -> Loaded:
    """Loads a checkpoint (or the newest link of a delta chain) at ``path`` into numpy arrays.

    With ``shard_index=j``, only the rows of shard ``j`` of ``shards`` (the partition rule's
    shards, whatever shard count the checkpoint was saved with); otherwise every row.
    ``tables``: the tables to load (default all; a named table that is missing is an error).
    ``exclude_slots``: glob patterns of slots not to load (``"adagrad*"`` for serving).
    ``dense=False`` leaves the dense tensors out.

    Row-range tables (saved as :class:`Chunk` values): ``into={table: {slot: Chunk(buffer,
    offset=(row, col))}}`` fills your buffers in place (a numpy array or a torch tensor,
    C-contiguous), reading only the bytes they take; those tables are then not returned. A
    tensor in device memory (CUDA) lands in rounds through two host buffers, pinned on CUDA, of
    ``staging_bytes`` together (default: the smaller of 256 MiB and 1/8 of the bytes it lands):
    each round is read and checked against its chunks' CRC32s, then copied to the device while
    the next is read (``report["landed_bytes"]``, ``["landing_rounds"]``, ``["landing_bytes"]``). Any
    other row-range table comes back whole, ``{slot: array}`` (with ``shard_index=j``: rows
    ``rows * j // shards`` to ``rows * (j + 1) // shards``, their first row in
    ``report["row_offsets"][table]``).

    ``path`` may be a :class:`Checkpoint` (:func:`open`): the load reads through that opening.
    Given a path, the load opens the checkpoint once and reads every table and tensor through
    that one opening; a checkpoint replaced by another save while it is read is opened again
    and the whole load starts over (up to 32 times), so that what comes back, ``into=``'s
    buffers included, is one save, never a mixture of two.
    """
    # The arguments are checked before the checkpoint is opened.
    shards = _int("shards", shards, 1, (1 << 32) - 1)
    options = dict(shards=shards, shard_index=_int("shard_index", shard_index, 0, shards - 1, optional=True),
                   tables=tables, exclude_slots=exclude_slots, dense=dense,
                   parallel=_int("parallel", parallel, 1, 4096, optional=True), into=into,
                   staging_bytes=staging_bytes)
    if isinstance(path, Checkpoint):
        return path.load(**options)
    for attempt in range(_REOPENS + 1):
        ck = Checkpoint(path)
        try:
            return ck.load(**options)
        except ReplacedError:
            if attempt == _REOPENS:
                raise


#: How many times a load by path opens again a checkpoint replaced while it was read (as the
#: library's own readers do).
_REOPENS = 32


def _load_opened(ck: "Checkpoint", shards, shard_index, tables, exclude_slots, dense, parallel, into, staging_bytes) -> Loaded:
    """:func:`load` through `ck`'s one opening."""
    path = ck.path
    shards = _int("shards", shards, 1, (1 << 32) - 1)
    shard_index = _int("shard_index", shard_index, 0, shards - 1, optional=True)
    parallel = _int("parallel", parallel, 1, 4096, optional=True)
    held = ck._info
    if tables is not None:
        tables = [str(t) for t in tables]
        for t in tables:
            if t not in held["tables"] and t not in held["row_tables"]:
                raise InputError(f"tables: {os.fspath(path)} holds no table {t!r} (it holds {sorted(held['tables']) + sorted(held['row_tables'])})")
    hashed = None if tables is None else [t for t in tables if t in held["tables"]]
    want_hashed = bool(held["tables"]) and (hashed is None or bool(hashed))
    out = Loaded(report={})
    landing = _staging.Landing(staging_bytes)
    requests = _row_requests(ck, held["row_tables"], out, shards, shard_index, tables, exclude_slots, into or {}, landing)
    excluded = [exclude_slots] if isinstance(exclude_slots, str) else [str(g) for g in exclude_slots]
    rows_read = {"bytes_wanted": 0, "bytes_read": 0, "chunks": 0}

    def read(pieces, first):
        # One request through the one opening: the hashed tables, the dense tensors, every
        # host row-range target and the device targets' first round, checked before the first
        # byte lands; then the device targets' other rounds, from the same save.
        if first:
            merged = {key: list(ts) for key, ts in requests.items()}
            for key, ts in pieces.items():
                merged.setdefault(key, []).extend(ts)
            if not (dense or want_hashed or merged):
                return None
            result = ck._native.load(shards, shard_index, hashed, excluded, dense, parallel, want_hashed,
                                     [(name, a, b, ts) for (name, (a, b)), ts in merged.items()])
        else:
            try:
                result = ck._native.load(shards, shard_index, None, excluded, False, parallel, False,
                                         [(name, a, b, ts) for (name, (a, b)), ts in pieces.items()])
            except InputError as e:
                raise SaverError(f"{e} (refused after {landing.landed_bytes} bytes had landed in device targets)") from e
        for k in rows_read:
            rows_read[k] += result[2]["row_tables"][k]
        return result

    first = landing.land(read)
    if first is not None:
        tables_out, dense_out, report = first
        out.report.update(report)
        for name, key, ids, slots in tables_out:
            columns = {"ids": ids.view(np.int64) if key == "I64" else ids}
            for slot, dtype, shape, data in slots:
                columns[slot] = _rows(data, dtype, shape, ids.shape[0])
            out.tables[name] = columns
        for name, dtype, shape, data in dense_out:
            out.dense[name] = (
                _typed(data, dtype, shape) if dtype in _TO_NUMPY or dtype in _PATTERN_BITS else data
            )
    out.report["row_tables"] = rows_read
    out.report["landed_bytes"] = landing.landed_bytes
    out.report["landing_rounds"] = landing.rounds
    out.report["landing_bytes"] = landing.host_bytes
    return out


def _row_requests(ck, held, out, shards, shard_index, tables, exclude_slots, into, landing) -> dict:
    """The row-range targets of a load: ``into``'s buffers, checked, and a buffer of its own for
    each other row-range table (``held``, from the manifest), put in ``out``. Returns them as
    ``{(table, (first row, end row)): [(slot, columns, the buffer's bytes)]}``, for the one
    native call of the load. A buffer in device memory is given to ``landing`` instead, which
    fills it in rounds."""
    import fnmatch

    path = ck.path
    for name in into:
        if name not in held:
            raise InputError(f"into: {path} holds no row-range table {name!r} (it holds {sorted(held)})")
    patterns = [exclude_slots] if isinstance(exclude_slots, str) else list(exclude_slots)
    offsets = out.report.setdefault("row_offsets", {})
    requests = {}

    def fill(name, slot, buffer, offset):
        what = f"into[{name!r}][{slot!r}]"
        spec = held[name]["slots"].get(slot)
        if spec is None:
            raise InputError(f"{what}: row-range table {name!r} has no slot {slot!r} (it has {sorted(held[name]['slots'])})")
        whole = tuple(spec[1])
        a = _host.writable(buffer, what, landing)
        on_device = isinstance(a, _staging.DeviceTarget)
        _check_target_dtype(a.like if on_device else a, spec[0], what)
        offset = tuple(_int(f"{what} offset", o, 0) for o in offset) if offset is not None else (0,) * len(whole)
        if a.ndim != len(whole) or len(offset) != len(whole):
            raise InputError(f"{what}: the slot has shape {whole}; give a buffer and an offset of {len(whole)} dimensions, got {a.shape} at {offset}")
        if any(o + n > w for o, n, w in zip(offset, a.shape, whole)):
            raise InputError(f"{what}: a buffer of shape {a.shape} at {offset} reaches past the slot's shape {whole} (rows {offset[0]}..{offset[0] + a.shape[0]} of {whole[0]})")
        cols = (offset[1], offset[1] + a.shape[1]) if len(whole) == 2 else None
        rows = (offset[0], offset[0] + a.shape[0])
        if on_device:
            landing.add(a, name, rows, slot, cols)
        else:
            requests.setdefault((name, rows), []).append((slot, cols, a.reshape(-1).view(np.uint8)))

    for name, slots in into.items():
        for slot, given in slots.items():
            for target in given if isinstance(given, (list, tuple)) else [given]:
                if not isinstance(target, Chunk):
                    raise InputError(f"into[{name!r}][{slot!r}]: give a saver.Chunk(buffer, offset=...) or a list of them, got {type(target).__name__}")
                fill(name, slot, target.values, target.offset)
    for name, info in held.items():
        if name in into or (tables is not None and name not in tables):
            continue
        rows = info["rows"]
        start, end = (0, rows) if shard_index is None else row_cut(rows, shards, shard_index)
        offsets[name] = start
        columns = {}
        for slot, (dtype, shape) in info["slots"].items():
            if any(fnmatch.fnmatchcase(slot, p) for p in patterns):
                continue
            numpy_dtype = _TO_NUMPY.get(dtype) or _PATTERN_TYPE.get(_PATTERN_BITS.get(dtype, 0))
            if numpy_dtype is None:
                raise InputError(f"row-range table {name!r} slot {slot!r}: dtype {dtype} has no numpy type")
            buffer = np.empty((end - start, *shape[1:]), dtype=numpy_dtype)
            fill(name, slot, buffer, (start, 0)[: len(shape)])
            columns[slot] = Bits(buffer, dtype) if dtype in _PATTERN_BITS else buffer
        out.tables[name] = columns
    return requests


def _check_target_dtype(a: np.ndarray, dtype: str, what: str) -> None:
    """Refuses a buffer of another dtype than the slot's, naming both: the bytes would land as
    they are, and mean other numbers (1.0 as F32 read by an int32 buffer is 1065353216). A dtype
    numpy has no type for is filled into its :class:`Bits`, a torch or ml_dtypes array of it, or
    a plain integer array of its width (bit patterns)."""
    if isinstance(a, Bits) and a.saver_dtype is not None:
        given = a.saver_dtype
    else:
        given = _TO_SAVER.get(a.dtype.newbyteorder("="), str(a.dtype))
        bits = _PATTERN_BITS.get(dtype)
        if bits is not None and a.dtype.kind in "ui" and a.dtype.itemsize * 8 == bits:
            return
    if given != dtype:
        patterns = f" (or uint{_PATTERN_BITS[dtype]} bit patterns)" if dtype in _PATTERN_BITS else ""
        raise InputError(f"{what}: the slot holds {dtype} values and the buffer is {given}; give a buffer of {dtype}{patterns}")


def shard_of(ids: ArrayLike, shards: int) -> np.ndarray:
    """The shard of ``shards`` that owns each id (a 1-D int64 or uint64 array, or a torch
    tensor): a uint32 array of shard indices, by the partition rule every save follows. A
    multi-process save of a hashed table wants each process to give the rows of its own shard
    (``shard_index``); route rows with this, for example in the all-to-all that exchanges them::

        owner = saver.shard_of(ids, world_size)
        mine = owner == rank
    """
    shards = _int("shards", shards, 1, (1 << 32) - 1)
    a = _host.readable(ids, "ids")
    if a.ndim != 1:
        raise InputError(f"ids: must be 1-D, got shape {a.shape}")
    if a.dtype == np.int64:
        a = a.view(np.uint64)
    elif a.dtype != np.uint64:
        raise InputError(f"ids: must be int64 or uint64 (the dtypes of a table's ids), got {a.dtype}")
    return _saver.shard_of(a, shards)


def row_cut(rows: int, shards: int, shard_index: int) -> tuple:
    """The rows ``(start, end)`` of a row-range table of ``rows`` rows that shard
    ``shard_index`` of ``shards`` holds: ``rows * j // shards`` to ``rows * (j + 1) // shards``,
    the partition rule's row cut, which every save and load of row-range tables uses (the
    counterpart of :func:`shard_of` for hashed tables)."""
    rows = _int("rows", rows, 0)
    shards = _int("shards", shards, 1, (1 << 32) - 1)
    return tuple(_saver.row_cut(rows, shards, _int("shard_index", shard_index, 0, shards - 1)))


def background_memory() -> int:
    """Bytes of memory kept for the next background save's copy of the model.

    A background save (:func:`save_async`, :func:`saver.torch.save_async`) copies the arrays it
    cannot keep before it returns, and the trainer waits for that copy. Into fresh memory the
    copy costs mostly the kernel's page faults (about 6 times the copy itself), so when a save
    ends the memory of its large copies (1 MiB and more) is kept, and the next save copies the
    same tensors into it, placed as their files place them so that they go to the disk straight
    from it. At most one save's copies are kept: memory that the copies of the last save did not
    use is freed when it ends. :func:`release_background_memory` frees it at once."""
    return _saver.background_memory()


def release_background_memory() -> None:
    """Frees the memory kept for the next background save's copy (:func:`background_memory`);
    a save under way gives its copies' memory back when it ends."""
    _saver.release_background_memory()


def verify(path: PathLike, *, parallel: Optional[int] = None) -> dict:
    """Reads every byte of the checkpoint at ``path`` and checks it against its CRCs. Returns
    ``{"status": "ok", "problems": []}`` or the problems found, each naming its file."""
    return _saver.verify(os.fspath(path), parallel or os.cpu_count() or 1)


def digest(path: PathLike, *, parallel: Optional[int] = None) -> str:
    """The content digest of a checkpoint or plain safetensors model, as ``saver digest`` prints
    it: equal for equal content, whatever the shard count, file layout or writer."""
    return _saver.digest(os.fspath(path), parallel or os.cpu_count() or 1)


class Checkpoint:
    """A committed checkpoint (or delta chain), opened once (:func:`open`): what it holds, from
    its manifest, and its loads, which all read through this one opening. They never move to
    a checkpoint that replaced this one: a load that fails because the checkpoint was
    replaced while it read raises :class:`ReplacedError` (open it again and start over;
    :func:`load` by path does so itself)."""

    def __init__(self, path: PathLike):
        self.path = os.fspath(path)
        self._native = _saver.open(self.path)
        self._info = self._native.inspect()

    def replaced(self) -> bool:
        """Whether another save has replaced this checkpoint since it was opened."""
        return self._native.replaced()

    @property
    def save_id(self) -> str:
        return self._info["save_id"]

    @property
    def shards(self) -> int:
        return self._info["shards"]

    @property
    def step(self) -> Optional[int]:
        return self._info["step"]

    @property
    def is_delta(self) -> bool:
        return self._info["delta"]

    @property
    def format_version(self) -> int:
        """The format version of docs/FORMAT.md it is written in."""
        return self._info["format_version"]

    @property
    def metadata(self) -> dict:
        return dict(self._info["metadata"])

    @property
    def tables(self) -> dict:
        """Per table: ``key_dtype``, ``rows`` and ``slots`` (name -> (dtype, row shape))."""
        return self._info["tables"]

    @property
    def dense(self) -> dict:
        """Per dense tensor: (dtype, shape)."""
        return self._info["dense"]

    @property
    def row_tables(self) -> dict:
        """Per row-range table: ``rows``, ``slots`` (name -> (dtype, whole shape)) and ``bytes``
        (what this checkpoint holds of it: a delta, only its changed rows)."""
        return self._info["row_tables"]

    def load(
        self,
        *,
        shards: int = 1,
        shard_index: Optional[int] = None,
        tables: Optional[Sequence[str]] = None,
        exclude_slots: Union[str, Sequence[str]] = (),
        dense: bool = True,
        parallel: Optional[int] = None,
        into: Optional[Mapping[str, Mapping[str, "Chunk"]]] = None,
        staging_bytes: Optional[int] = None,
    ) -> Loaded:
        """:func:`load` through this opening: every table and tensor of this one save. Raises
        :class:`ReplacedError` if the checkpoint was replaced and its read failed for it."""
        try:
            return _load_opened(self, shards, shard_index, tables, exclude_slots, dense, parallel, into, staging_bytes)
        except InputError:
            raise
        except SaverError as e:
            if self.replaced():
                raise ReplacedError(f"{e} ({self.path} was replaced by another save while it was read: open it again)") from e
            raise

    def verify(self, **kwargs: Any) -> dict:
        """:func:`verify` of this checkpoint."""
        return verify(self.path, **kwargs)

    def digest(self, **kwargs: Any) -> str:
        """:func:`digest` of this checkpoint."""
        return digest(self.path, **kwargs)

    def __repr__(self) -> str:
        return f"saver.Checkpoint({self.path!r}, save_id={self.save_id!r}, tables={sorted(self.tables)})"


class Manager:
    """The checkpoints of a training job under one root: ``<root>/step-<N>`` per saved step,
    full checkpoints every ``full_every`` saves and deltas in between (at most
    ``max_chain_links`` links a chain), and retention after every commit (the newest
    ``keep_latest`` steps, and every step that is a multiple of ``keep_every``), never breaking a
    chain a kept step needs. The policy is kept in the root, so every process of the job (and
    the ``saver`` binary) applies the same one.

    >>> m = saver.Manager("/ckpt/run7", full_every=4, keep_latest=3)
    >>> m.save_async(step, tables=..., dense=...)   # every K steps, in the background
    >>> latest = m.load_latest()                    # on restart: (step, Loaded) or None
    """

    def __init__(
        self,
        root: PathLike,
        *,
        every_steps: int = 1,
        full_every: int = 4,
        max_chain_links: int = 4,
        keep_latest: int = 3,
        keep_every: Optional[int] = None,
    ):
        self.root = os.fspath(root)
        self._native = _saver.Manager(
            self.root,
            _int("every_steps", every_steps, 1),
            _int("full_every", full_every, 1, (1 << 32) - 1),
            _int("max_chain_links", max_chain_links, 1, 1 << 16),
            _int("keep_latest", keep_latest, 1, 1 << 32),
            _int("keep_every", keep_every, 1, optional=True),
        )

    def is_due(self, step: int) -> bool:
        """Whether ``step`` is one the policy saves (a multiple of ``every_steps``)."""
        return self._native.is_due(_int("step", step, 0))

    def save(self, step: int, tables=None, dense=None, *, full: bool = False, **options: Any) -> SaveReport:
        """Saves ``step`` (after any background save ends), full or a delta by the policy, then
        applies retention. Options as :func:`save` (``save_id`` and ``step`` are the manager's).
        A model whose tables changed (a slot added, a dimension or dtype changed) is saved full;
        ``full=True`` saves this step full whatever the policy says. The report's
        ``full_because`` says why a save is full (``None`` for a delta)."""
        step = _int("step", step, 0)
        if full:
            self._native.force_full()
        return _saved(lambda *a: self._native.save(step, *a), tables, dense, _options(options))

    def save_async(
        self, step: int, tables=None, dense=None, *, full: bool = False, **options: Any
    ) -> "ManagedSaveHandle":
        """:meth:`save` in the background, as :func:`save_async`: returns once the arrays are
        copied, with a handle to poll or wait on. The next save (or :meth:`wait`) waits for it
        first; with ``when_busy="skip"`` kept in the root, a step that comes while one runs is
        skipped (:attr:`ManagedSaveHandle.skipped`)."""
        step = _int("step", step, 0)
        if full:
            self._native.force_full()
        running, _ = _started(lambda *a: self._native.save_async(step, *a), tables, dense, _options(options))
        return ManagedSaveHandle(self, step, skipped=running is not None)

    def prune(self, *, keep_latest: Optional[int] = None, dry_run: bool = False) -> dict:
        """Applies retention now (the root's, or with ``keep_latest`` instead of its own):
        ``{"removed": [...], "kept": [...]}``, steps removed newest first. Never removes the
        newest step nor a link a kept step needs."""
        if keep_latest is not None:
            keep_latest = _int("keep_latest", keep_latest, 1)
        removed, kept = self._native.prune(dry_run, keep_latest)
        return {"removed": removed, "kept": kept}

    def clean(self, *, dry_run: bool = False) -> dict:
        """Reclaims what crashed saves left in the root (only once their writers have provably
        ended): ``{"reclaimed": [steps], "left_alone": [(step, why), ...]}``."""
        reclaimed, left_alone = self._native.clean(dry_run)
        return {"reclaimed": reclaimed, "left_alone": left_alone}

    def wait(self) -> Optional[SaveReport]:
        """Waits for the background save, if one runs; its report, or raises its error."""
        report = self._native.wait()
        return None if report is None else SaveReport(**report)

    def steps(self) -> list:
        """The committed steps whose chains are whole, oldest first: dicts with ``step``,
        ``path``, ``save_id``, ``parent`` (the step a delta builds on), ``links``, ``bytes``,
        ``shards`` and ``metadata``."""
        return self._native.steps()

    def latest(self) -> Optional[dict]:
        """The newest committed step whose chain is whole (as :meth:`steps` lists it), or None."""
        return self._native.latest()

    def load_latest(self, *, fallback: bool = False, **kwargs: Any):
        """``(step, Loaded)`` of the newest committed step (options as :func:`load`), or None
        when the root has none: where a restarted job resumes. With ``fallback=True``, the
        newest step that verifies (every checksum of every link; each step tried is read
        whole): a newer one that does not is passed over with a :class:`SaverWarning` saying
        why."""
        if not fallback:
            latest = self.latest()
            return None if latest is None else (latest["step"], load(latest["path"], **kwargs))
        latest, passed_over = self._native.latest_verified()
        for step, why in passed_over:
            warnings.warn(f"step {step} does not verify ({why}); falling back", SaverWarning, stacklevel=2)
        # A step that verifies and still does not load (replaced meanwhile, a disk failing now)
        # is passed over too: fallback means the newest step that loads.
        while latest is not None:
            try:
                return latest["step"], load(latest["path"], **kwargs)
            except InputError:
                raise  # the arguments, not the step: an older step would be refused alike
            except SaverError as e:
                older = [s for s in self.steps() if s["step"] < latest["step"]]
                warnings.warn(f"step {latest['step']} does not load ({e}); falling back", SaverWarning, stacklevel=2)
                latest = older[-1] if older else None
        return None


class ManagedSaveHandle:
    """A background save of a :class:`Manager` (:meth:`Manager.save_async`)."""

    def __init__(self, manager: "Manager", step: int, skipped: bool):
        self._manager = manager
        self.step = step
        #: Whether the step was skipped because the previous save was still running.
        self.skipped = skipped
        self._report: Optional[SaveReport] = None

    def _mine(self):
        """The manager's save not yet waited for, if it is this one: ``(step, ended)``."""
        pending = self._manager._native.in_flight()
        return pending if pending is not None and pending[0] == self.step else None

    def done(self) -> bool:
        """Whether the save has ended (or was skipped): :meth:`wait` then returns at once."""
        mine = self._mine()
        return self.skipped or mine is None or mine[1]

    def wait(self) -> Optional[SaveReport]:
        """Waits for the save and returns its report, or raises its error; ``None`` if it was
        skipped, or if a later save of the manager already waited for it (which raised its
        error, had it failed)."""
        if not self.skipped and self._report is None and self._mine() is not None:
            self._report = self._manager.wait()
        return self._report


def _options(given: Mapping[str, Any]) -> dict:
    """:func:`save`'s options, defaults filled in; an unknown one is a ``TypeError``."""
    options = dict(
        shards=1,
        shard_index=None,
        save_id=None,
        parallel=None,
        step=None,
        metadata=None,
        overwrite=False,
        durable=True,
        foreign_rows="error",
        parent=None,
        exclude_slots=(),
        keep_rows=(),
        row_filter=None,
        compress=None,
        direct_io="auto",
        wait=None,
        staging_bytes=None,
        device_copy=None,
    )
    unknown = set(given) - set(options)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    options.update(given)
    return options


def __getattr__(name: str):
    # `saver.torch` without importing torch for those who do not use it.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'saver' has no attribute {name!r}")


def open(path: PathLike) -> Checkpoint:  # noqa: A001 - the package's verb, as in `saver.open`
    """Opens the committed checkpoint at ``path`` (refused, naming the file, if there is none or
    it is damaged): one opening, through which every load of the returned :class:`Checkpoint`
    reads the same save."""
    return Checkpoint(path)
