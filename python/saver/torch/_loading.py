"""saver.torch.load and load_latest: every check that needs no data first, then one read through
one opening of the checkpoint into the model's and the optimizer's own memory."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

import saver as _s
from saver import _host

from ._forms import _chunks_of, _is_dtensor, _is_sharded, _local_parts, _shards_wrapper
from ._fused import _broadcast_fill, _column_mean_fill, _convert, _dense_part, _fused_state, _held_slot, _is_rowwise, _missing_state, _rowwise_fill, _rowwise_targets, _saved_rowwise
from ._items import _table_params, chunk_items, load_request
from ._metadata import _meta
from ._optim import _check_hyper, _check_optimizer, _check_optimizer_class, _load_optimizer, _param_names, _updates
from ._ranks import _agreed, _gathered, _same_checkpoint, _world, on_group


def load(source: Union[os.PathLike, str, "_s.Manager"], model: torch.nn.Module,
         optimizer: Optional[torch.optim.Optimizer] = None, *, strict: bool = True,
         fallback: bool = False, process_group: Any = None, staging_bytes: Optional[int] = None) -> Any:
    """Fills ``model``'s parameters and buffers and ``optimizer``'s state and hyperparameters in
    place from the checkpoint at ``source`` (a path, or a :class:`saver.Manager`: its newest
    committed step), and returns the ``extra`` saved with them. Row-range tables are read
    straight into the parameters and states, whatever split they were saved by. ``strict``: a
    tensor or table of the model the checkpoint lacks, or one it holds the model lacks, is an
    error (a shape or dtype that differs always is).

    Every check that needs no data (shapes, dtypes, strictness, the optimizer's class and param
    groups) runs before the first byte lands: a load refused by one leaves the model and the
    optimizer as they were. A read that fails midway (a checksum) says which tables may already
    hold part of the checkpoint; with a Manager and ``fallback=True`` the next older committed
    step is then loaded into the same model and optimizer (a :class:`saver.SaverWarning` names
    the step passed over), so that training never goes on from a mixture. CUDA tables are
    filled in bounded rounds through two pinned host buffers, each round checked before it is
    copied to the device (``staging_bytes`` of them together, by default the smaller of 256 MiB
    and 1/8 of the bytes landed, as :func:`saver.load`'s).
    ``process_group``: the group saver's agreement between ranks runs on (as
    :func:`save`)."""
    with on_group(process_group):
        return _load_from(source, model, optimizer, strict, fallback, staging_bytes)


def _load_from(source, model, optimizer, strict, fallback, staging_bytes):
    if isinstance(source, _s.Manager):
        latest = _load_newest(source, model, optimizer, strict, fallback, staging_bytes)
        if latest is None:
            raise _s.InputError(f"{source.root} holds no committed step")
        return latest[1]
    if fallback:
        raise _s.InputError("fallback: a path is one checkpoint; give a saver.Manager to fall back to older steps")
    return _load(os.fspath(source), model, optimizer, strict, staging_bytes)


def load_latest(manager: "_s.Manager", model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                *, strict: bool = True, fallback: bool = False, process_group: Any = None,
                staging_bytes: Optional[int] = None):
    """:func:`load` of ``manager``'s newest committed step (with ``fallback``, the newest that
    loads): ``(step, extra)``, the step read and the ``extra`` saved with it, or ``None`` when
    the root holds no step. Where a restarted job resumes, as :meth:`saver.Manager.load_latest`;
    ``staging_bytes`` as :func:`load`'s."""
    if not isinstance(manager, _s.Manager):
        raise _s.InputError(f"manager: give a saver.Manager, got {type(manager).__name__}")
    with on_group(process_group):
        return _load_newest(manager, model, optimizer, strict, fallback, staging_bytes)


def _load_newest(manager, model, optimizer, strict, fallback, staging_bytes=None):
    """`(step, extra)` of a Manager's newest committed step loaded, or, with `fallback`, of the
    newest one that loads; None if it holds none. Every rank tries the same steps (rank 0's
    listing) and moves on together."""
    import warnings

    world = _world()[1]
    steps = [(s["step"], s["path"]) for s in reversed(manager.steps())] if fallback else None
    if not fallback:
        latest = manager.latest()
        steps = [] if latest is None else [(latest["step"], latest["path"])]
    if world > 1:
        # Every rank reads the steps rank 0 found, whatever commits meanwhile.
        steps = _agreed(steps)
    if not steps:
        return None
    for k, (step, path) in enumerate(steps):
        last = k + 1 == len(steps)
        if not fallback or last:
            return step, _load(path, model, optimizer, strict, staging_bytes)
        failure = None
        try:
            extra = _load(path, model, optimizer, strict, staging_bytes)
        except _s.InputError:
            raise  # the model does not fit the checkpoint: an older step would not fit either
        except _s.SaverError as e:
            failure = f"rank {_world()[0]}: {e}"
        failures = [failure]
        if world > 1:
            failures = _gathered(failure)
        failed = [f for f in failures if f]
        if not failed:
            return step, extra
        warnings.warn(f"step {step} does not load ({'; '.join(failed)}); falling back to step {steps[k + 1][0]}", _s.SaverWarning, stacklevel=3)


def _load(path, model, optimizer, strict, staging_bytes=None):
    """`_load_once`, started over on a checkpoint that replaced the one it opened while it read
    (one process; ranks, which agreed on the save they opened, raise instead): every byte it
    had put into the model is then overwritten from the new one."""
    for attempt in range(_s._REOPENS + 1):
        try:
            return _load_once(path, model, optimizer, strict, staging_bytes)
        except _s.ReplacedError:
            if _world()[1] > 1 or attempt == _s._REOPENS:
                raise


def _load_once(path, model, optimizer, strict, staging_bytes=None):
    """Loads the checkpoint at `path` into `model` and `optimizer` through one opening."""
    optimizer = _dense_part(model, optimizer)
    failure = None
    try:
        meta, ck = _meta(path)
    except _s.SaverError as e:
        if _world()[1] == 1:
            raise
        failure = e
    if _world()[1] > 1:
        # Every rank learns whether every rank opened one and the same save.
        seen = _gathered(None if failure is None else f"rank {_world()[0]}: {failure}")
        failed = [f for f in seen if f]
        if failed:
            raise (failure if failure is not None else _s.SaverError("; ".join(failed)))
        _same_checkpoint(ck, path)
    _check_hyper(meta, optimizer, path)
    by_name = dict(model.named_parameters())
    # The model's embeddings, and the 2-D parameters the save was told to take as tables; not
    # those TorchRec shards (read below, by their shards), whatever plan saved them.
    # One state dict, whose sharded tensors are filled below and handed back (each call of a
    # DistributedModelParallel's builds them anew).
    state_sd = model.state_dict()
    sharded = {k: t for k, t in state_sd.items() if _is_sharded(t)}
    table_params = _table_params(model, [t for t in meta["tables"] if t in by_name and by_name[t].dim() == 2])
    table_params = {k: p for k, p in table_params.items() if k not in sharded}
    names = _param_names(model)
    # The optimizer's class first: a state of the tables below that does not fit is then one
    # of the same class's.
    _check_optimizer_class(optimizer, meta, path)
    held_tables = ck.row_tables
    # The load's request: every piece of a table to fill, as items.
    request = []

    def to_fill(name, slots):
        whole = {slot: shape for slot, (_, shape) in held_tables[name]["slots"].items()}
        request.extend(chunk_items(name, slots, whole))

    # What is done once the bytes are in: row-wise state read into buffers and converted to
    # another column cut, or between row-wise and element-wise state.
    after = []
    # Optimizer state of tables: existing tensors filled in place, missing ones made.
    made = {}
    for name, p in table_params.items():
        held = held_tables.get(name)
        if held is None:
            if strict:
                raise _s.InputError(f"{path} holds no table {name!r} (it holds {sorted(held_tables)})")
            continue
        dtype, shape = held["slots"].get("param", (None, None))
        if shape is None or tuple(shape) != tuple(p.shape) or _host.torch_dtype(dtype, name) != p.dtype:
            raise _s.InputError(f"{name}: the checkpoint holds {dtype} of shape {None if shape is None else tuple(shape)}, the model {p.dtype} of shape {tuple(p.shape)}")
        slots = {"param": _s.Chunk(p.data)}
        if optimizer is not None and _updates(optimizer, p):
            st = optimizer.state.setdefault(p, {})
            # The state the optimizer has (Adagrad makes its own at once) is filled by its
            # names or their aliases; an optimizer that makes it at its first step gets the
            # checkpoint's by their names.
            have = {k: t for k, t in st.items() if torch.is_tensor(t) and t.dim() >= 1}
            if have:
                wanted = {}
                for k, t in have.items():
                    # A row-wise state ([rows, 1]: `torchrec.optim.RowWiseAdagrad`'s `sum`) of a
                    # checkpoint's state kept by column shard: by the rule of `_rowwise_fill`.
                    found = _saved_rowwise(meta, held["slots"], name, k, p.shape[1]) if t.dim() == 2 and t.shape[1] == 1 and p.shape[1] > 1 else None
                    if found is not None and tuple(held["slots"][found[0]][1]) != tuple(t.shape):
                        slots.setdefault(found[0], []).extend(_rowwise_fill(t, t.shape[0], 0, (0, p.shape[1]), found[1], after))
                        continue
                    slot = _held_slot(held["slots"], k, t.shape)
                    if slot is not None:
                        wanted[slot] = k
                        continue
                    # An element-wise state (the dense Adagrad's `sum` of a table TorchRec now
                    # keeps data-parallel) of a checkpoint's row-wise one (the fused
                    # RowWiseAdagrad's `momentum1`, saved while the table was sharded).
                    found = _saved_rowwise(meta, held["slots"], name, k, p.shape[1]) if tuple(t.shape) == tuple(p.shape) else None
                    if found is not None:
                        _convert(path, name, found[0], k, "row-wise", strict)
                        dtype = _host.torch_dtype(held["slots"][found[0]][0], f"{name}/{found[0]}")
                        slots.setdefault(found[0], []).extend(_broadcast_fill(t, (0, 0), found[1], dtype, after))
                        continue
                    _missing_state(path, name, held["slots"], k, strict)
            else:
                wanted = {slot: slot[len("state."):] for slot in held["slots"] if slot.startswith("state.")}
            for slot, key in wanted.items():
                dtype, shape = held["slots"][slot]
                t = st.get(key)
                if not (torch.is_tensor(t) and tuple(t.shape) == tuple(shape)):
                    t = _host.empty_beside(p, shape, _host.torch_dtype(dtype, f"{name}/{slot}"))
                    made[(name, key)] = t
                slots[slot] = _s.Chunk(t)
        to_fill(name, slots)
    # Tables sharded by TorchRec: each local shard (and each of its fused optimizer state)
    # filled from whatever split saved it; then given back to the model and the fused
    # optimizer through their own load_state_dict.
    fused, _, fused_opt, fused_sd = _fused_state(model)
    for name, t in sharded.items():
        held = held_tables.get(name)
        if held is None:
            raise _s.InputError(f"{path} holds no table {name!r} (it holds {sorted(held_tables)})")
        dtype, shape = held["slots"]["param"]
        if tuple(shape) != tuple(t.size()):
            raise _s.InputError(f"{name}: the checkpoint holds shape {tuple(shape)}, the model {tuple(t.size())}")
        slots = {"param": _chunks_of(t, name, reading=True)}
        for key, st in fused.get(name, {}).items():
            if not _is_sharded(st):
                continue
            if _is_rowwise(t, st):
                found = _saved_rowwise(meta, held["slots"], name, key, tuple(t.size())[1])
                if found is not None:
                    slots[found[0]] = _rowwise_targets(st, t, f"{name} {key}", lambda x, n, r, cut, saved=found[1]: _rowwise_fill(x, n, r, cut, saved, after))
                    continue
                # A row-wise state (the fused RowWiseAdagrad's) of a checkpoint's element-wise
                # one (the dense Adagrad's `sum`, saved while the table was data-parallel).
                slot = _held_slot(held["slots"], key, tuple(t.size()))
                if slot is None or tuple(held["slots"][slot][1]) != tuple(t.size()):
                    _missing_state(path, name, held["slots"], key, strict)
                    continue
                _convert(path, name, slot, key, "element-wise", strict)
                dtype = _host.torch_dtype(held["slots"][slot][0], f"{name}/{slot}")
                slots[slot] = _rowwise_targets(st, t, f"{name} {key}", lambda x, n, r, cut, dtype=dtype: _column_mean_fill(x, n, r, cut, dtype, after))
                continue
            found = _saved_rowwise(meta, held["slots"], name, key, tuple(t.size())[1])
            if found is not None:
                # An element-wise fused state (fused Adagrad's) of a checkpoint's row-wise one.
                if _is_dtensor(st) and _shards_wrapper(st) is None:
                    raise _s.InputError(f"{name}: the checkpoint holds row-wise state {key!r} by column shards; reading it into a DTensor other than TorchRec's form is not supported")
                if tuple(st.size()) != tuple(t.size()):
                    raise _s.InputError(f"{name}: the checkpoint holds {key!r} row-wise, the model's fused optimizer keeps it of shape {tuple(st.size())}: load it with the optimizer it was saved with")
                _convert(path, name, found[0], key, "row-wise", strict)
                dtype = _host.torch_dtype(held["slots"][found[0]][0], f"{name}/{found[0]}")
                slots[found[0]] = [c for x, o in _local_parts(st) for c in _broadcast_fill(x, o, found[1], dtype, after)]
                continue
            slot = _held_slot(held["slots"], key, tuple(st.size()))
            if slot is None:
                _missing_state(path, name, held["slots"], key, strict)
                continue
            slots[slot] = _chunks_of(st, f"{name} {key}", reading=True)
        slots = {k: v for k, v in slots.items() if v}
        if slots:
            to_fill(name, slots)
    # Everything that needs no data, checked before the first byte lands in the model.
    dense_wanted = {k: t for k, t in model.state_dict(keep_vars=True).items() if k not in table_params and k not in sharded}
    held_dense = {k: v for k, v in ck.dense.items() if not k.startswith(("optimizer/", "fused/"))}
    if strict:
        missing, unexpected = sorted(set(dense_wanted) - set(held_dense)), sorted(set(held_dense) - set(dense_wanted))
        missing_tables = sorted((set(table_params) | set(sharded)) - set(held_tables))
        unexpected_tables = sorted(set(held_tables) - set(table_params) - set(sharded))
        if missing or unexpected or missing_tables or unexpected_tables:
            raise _s.InputError(f"{path}: the model's tensors and the checkpoint's differ: missing {missing + missing_tables}, unexpected {unexpected + unexpected_tables} (strict=False loads what both hold)")
    for k in sorted(set(dense_wanted) & set(held_dense)):
        _check_dense(dense_wanted[k], *held_dense[k], k)
    if optimizer is not None:
        _check_optimizer(optimizer, meta, ck.dense, by_name, names, set(table_params) | set(sharded), path)
    filled = sorted({it.name for it in request})
    try:
        loaded = ck.load(into=load_request(request), tables=filled or None, staging_bytes=staging_bytes)
    except _s.InputError:
        raise  # refused before any byte was read into the model
    except _s.ReplacedError:
        if _world()[1] == 1:
            raise  # read again, whole, from the checkpoint there now (`_load`)
        raise _s.SaverError(f"{path} was replaced by another save while the ranks read it: {filled} (with their optimizer state) may hold part of it; load again") from None
    except _s.SaverError as e:
        raise _s.SaverError(
            f"{e}; the load stopped while reading: {filled} (with their optimizer state) may hold "
            "part of this checkpoint, and the rest of the model and optimizer is as it was: load "
            "a good checkpoint before training (a Manager's older step: saver.torch.load(manager, "
            "..., fallback=True))"
        ) from e
    with torch.no_grad():
        for finish in after:
            finish()
    if sharded:
        model.load_state_dict(state_sd, strict=False)
    if fused_sd is not None:
        for param, states in fused_sd.get("state", {}).items():
            table = param.split(".")[-2] if param.endswith(".weight") else param
            for k in states:
                short = k[len(table) + 1:] if k.startswith(table + ".") else k
                key = f"fused/{param}/{short}"
                if key in loaded.dense and not _is_sharded(states[k]):
                    states[k] = _host.tensor_of(loaded.dense[key], states[k].dtype)
        fused_opt.load_state_dict(fused_sd)
    for (name, key), t in made.items():
        optimizer.state[by_name[name]][key] = t
    state = model.state_dict(keep_vars=True)
    wanted = {k for k in state if k not in table_params and k not in sharded}
    for k in wanted & set(held_dense):
        _host.copy_into(state[k], loaded.dense[k], k)
    if optimizer is not None:
        _load_optimizer(optimizer, meta, loaded.dense, by_name, names, path)
    return meta["extra"]


def _check_dense(target, dtype, shape, name):
    """Refuses a tensor of the checkpoint (`dtype`, `shape` from its manifest) that does not fit
    `target`, before anything is read."""
    held = _host.known_torch_dtype(dtype)
    if tuple(shape) != tuple(target.shape) or (held is not None and held != target.dtype):
        raise _s.InputError(f"{name}: the checkpoint holds {dtype} of shape {tuple(shape)}, the model {target.dtype} of shape {tuple(target.shape)}")
