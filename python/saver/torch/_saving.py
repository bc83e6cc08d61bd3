"""saver.torch.save and save_async: a model and its optimizer collected into tables, dense tensors
and metadata, and saved (under torch.distributed, each rank its share, committed once)."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Iterable, Optional, Union

import torch

import saver as _s

from ._forms import _chunks_of, _column_ranges, _is_sharded
from ._fused import _dense_part, _fused_state, _is_rowwise, _rowwise_chunks
from ._items import _table_params, chunk_items, dense_item, save_arguments, table_item
from ._metadata import META_KEY, META_VERSION, _jsonable
from ._optim import _optimizer_state
from ._ranks import RanksHandle, _agree, _agreed, _gathered, _world, on_group


def _collect(model, optimizer, tables, step, extra, rank, world):
    """The save's items (this rank's share of the tables, the dense tensors) and metadata."""
    model_state = model.state_dict()
    table_params = {
        k: p for k, p in _table_params(model, tables).items() if not _is_sharded(model_state.get(k))
    }
    states, groups = _optimizer_state(model, optimizer)
    by_table = {}
    dense = {}
    # Tables sharded by TorchRec: each rank's local shards at their global offsets, with the
    # fused optimizer's state of the same shapes as slots.
    sharded = {}
    rowwise = {}
    fused, fused_groups, _, _ = _fused_state(model)
    for name, t in model_state.items():
        if _is_sharded(t):
            slots = {"param": _chunks_of(t, name)}
            rows = tuple(t.size())[0]
            for key, st in fused.get(name, {}).items():
                if _is_rowwise(t, st):
                    # Row-wise (one value per row per column shard): a [rows, column shards]
                    # slot, the column ranges in the metadata; see `load` for another plan.
                    slots[f"state.{key}"] = _rowwise_chunks(st, rows, f"{name} {key}")
                    rowwise.setdefault(name, {})[key] = _column_ranges(t)
                elif _is_sharded(st) and tuple(st.size()) == tuple(t.size()):
                    slots[f"state.{key}"] = _chunks_of(st, f"{name} {key}")
                elif torch.is_tensor(st) and not _is_sharded(st):
                    dense[f"fused/{name}/{key}"] = st.detach()
                else:
                    raise _s.InputError(f"{name}: fused optimizer state {key!r} of shape {tuple(st.size())} is not one row per table row; not supported yet")
            sharded[name] = slots
            continue
        if name in table_params:
            continue
        dense[name] = t.detach()
    for name, p in table_params.items():
        by_table[name] = {"param": p.detach()}
    # Python numbers among the state (SparseAdam's integer `step`), by "<parameter>/<key>":
    # given back as the same type, since an optimizer computes with them differently than with
    # a 0-d tensor (SparseAdam's bias correction).
    scalars = {}
    for name, p, st in states:
        for key, value in st.items():
            if not torch.is_tensor(value):
                if not isinstance(value, (bool, int, float)):
                    raise _s.InputError(f"optimizer: state {key!r} of {name!r} is a {type(value).__name__}; saver.torch saves tensors and numbers")
                scalars[f"{name}/{key}"] = type(value).__name__
                value = torch.tensor(value)
            value = value.detach()
            rows_of_table = name in table_params and value.dim() >= 1 and value.shape[0] == p.shape[0] and value.dim() <= 2
            if rows_of_table:
                by_table[name][f"state.{key}"] = value
            else:
                dense[f"optimizer/{name}/{key}"] = value
    try:
        json.dumps(extra)
    except TypeError as e:
        raise _s.InputError(f"extra: must be what JSON holds (numbers, strings, lists, dicts): {e}") from None
    meta = {
        "version": META_VERSION,
        "optimizer": None if optimizer is None else type(optimizer).__name__,
        "param_groups": groups,
        "fused_param_groups": _jsonable(fused_groups),
        "tables": sorted(table_params),
        "sharded": sorted(sharded),
        "rowwise": rowwise,
        "scalars": scalars,
        "step": step,
        "extra": extra,
    }
    items = []
    for name, slots in by_table.items():
        rows = next(iter(slots.values())).shape[0]
        a, b = _s.row_cut(rows, world, rank)
        items += [table_item(name, slot, v[a:b], (a,) + (0,) * (v.dim() - 1), tuple(v.shape)) for slot, v in slots.items()]
    for name, slots in sharded.items():
        items += chunk_items(name, slots)
    # Dense tensors after the tables, as saver.save's arguments put them.
    items += [dense_item(k, v) for k, v in dense.items()]
    return items, meta


def _save(target, model, optimizer, step, extra, tables, background, options):
    optimizer = _dense_part(model, optimizer)
    # A blocking save writes the model's tensors whole from their own memory: through the page
    # cache that is one copy (the kernel's), as fast here as direct I/O, which copies them into
    # ~40 MiB of aligned staging buffers first. A background save writes its copy while the
    # trainer runs: there the kernel's writeback competes with training and took 1.5-10 s
    # where direct I/O took 0.8 s (benches/torch_peers.py; docs/BENCHMARKS.md).
    options.setdefault("direct_io", "auto" if background else "off")
    rank, world = _world()
    if world == 1:
        items, meta = _collect(model, optimizer, tables, step, extra, rank, world)
    else:
        # Each rank sees the row-wise state of the shards it holds: the metadata, which every
        # rank must give alike, takes them all. A rank that cannot give its share says so
        # here, and every rank raises (rather than wait for it).
        failure, rowwise = None, {}
        try:
            items, meta = _collect(model, optimizer, tables, step, extra, rank, world)
            rowwise = meta["rowwise"]
        except Exception as e:  # noqa: BLE001 - told to every rank, then raised
            failure = f"rank {rank}: {e}"
        seen = _gathered((failure, rowwise))
        failed = [f for f, _ in seen if f]
        if failed:
            raise _s.InputError("; ".join(failed))
        # The column ranges of each table's row-wise state: every rank's (a rank of TorchRec's
        # DTensor form knows only its own).
        merged = {}
        for _, r in seen:
            for table, keys in r.items():
                for key, ranges in keys.items():
                    merged.setdefault(table, {}).setdefault(key, set()).update(map(tuple, ranges))
        meta["rowwise"] = {t: {k: sorted(v) for k, v in keys.items()} for t, keys in sorted(merged.items())}
    out_tables, dense = save_arguments(items)
    metadata = {META_KEY: json.dumps(meta)}
    if "metadata" in options:
        metadata = {**options.pop("metadata"), **metadata}
    if world > 1:
        # One save of `world` shards: rank r writes shard r (its rows of every table and its
        # share of the dense tensors), under the save id rank 0 drew.
        save_id = _agreed(options.pop("save_id", None) or f"torch-{uuid.uuid4().hex[:16]}")
        options = {**options, "shards": world, "shard_index": rank, "save_id": save_id}
    if isinstance(target, _s.Manager):
        if step is None:
            raise _s.InputError("step: a Manager saves steps; give step=")
        if background:
            # The previous background save, waited for by every rank together, so that a rank
            # that died during it is learnt of here rather than by the next save's own wait.
            _agree(target.wait, rank, world)
            handle = target.save_async(step, tables=out_tables, dense=dense, metadata=metadata, **options)
            return handle if world == 1 else RanksHandle(handle, rank, world)
        return _agree(lambda: target.save(step, tables=out_tables, dense=dense, metadata=metadata, **options), rank, world)
    path = os.fspath(target)
    if background:
        handle = _s.save_async(path, tables=out_tables, dense=dense, step=step, metadata=metadata, **options)
        return handle if world == 1 else RanksHandle(handle, rank, world)
    return _agree(lambda: _s.save(path, tables=out_tables, dense=dense, step=step, metadata=metadata, **options), rank, world)


def save(target: Union[os.PathLike, str, "_s.Manager"], model: torch.nn.Module,
         optimizer: Optional[torch.optim.Optimizer] = None, *, step: Optional[int] = None,
         extra: Any = None, tables: Optional[Iterable[str]] = None, process_group: Any = None,
         **options: Any):
    """Saves ``model`` (its ``state_dict()``) and ``optimizer`` at ``target`` (a path, or a
    :class:`saver.Manager`, which needs ``step``), committed when this returns. ``extra``:
    anything JSON holds, given back by :func:`load`. ``tables``: parameter names of 2-D
    parameters to save as row-range tables beside the embeddings found. Other options as
    :func:`saver.save` (``compress``, ``parent``, ``durable``...; ``direct_io`` is ``"off"`` here:
    the tensors are written from their own memory through the page cache, with no staging
    buffers; :func:`save_async` keeps ``"auto"``). Tensors are read in place: none may change until this returns.
    CUDA tensors are read through the staging ring (:func:`saver.save`'s ``staging_bytes``).
    ``process_group``: the torch.distributed group saver's own agreement between ranks (save
    id, outcome) runs on, e.g. a gloo group made beside an NCCL one
    (``dist.new_group(backend="gloo")``); default: the default group."""
    with on_group(process_group):
        return _save(target, model, optimizer, step, extra, tables, False, options)


def save_async(target: Union[os.PathLike, str, "_s.Manager"], model: torch.nn.Module,
               optimizer: Optional[torch.optim.Optimizer] = None, *, step: Optional[int] = None,
               extra: Any = None, tables: Optional[Iterable[str]] = None, process_group: Any = None,
               **options: Any):
    """:func:`save` in the background: returns a handle once the model and optimizer state are
    copied (every core copies), so that training may go on at once; ``handle.wait()`` returns
    the report, or raises the save's error. Under ``torch.distributed`` every rank calls it at
    the same step (the ranks agree on the save id then) and gets a :class:`RanksHandle`: every
    rank calls its ``wait()``, which returns this rank's report once every rank's share has
    ended, and raises on every rank if any failed or died (learnt through the process group
    within a second, not when a Manager's wait for the commit ends); its ``done()`` is this
    rank's alone. The copy's memory is kept for the next
    background save, which copies into it at memory speed rather than the kernel's page-fault
    speed and writes it to the disk from there (:func:`saver.background_memory`).
    ``process_group`` as :func:`save` (the handle's ``wait()`` agrees on it too)."""
    with on_group(process_group):
        return _save(target, model, optimizer, step, extra, tables, True, options)
