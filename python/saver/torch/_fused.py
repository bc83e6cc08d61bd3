"""TorchRec's fused optimizer: its state beside the tables, the row-wise rule (one value per row per
column shard, read into another column cut by the weighted mean of the saved shards), the
aliases of Adagrad's state and the conversions between row-wise and element-wise state, and
the dense part of the optimizers TorchRec's examples pass."""

from __future__ import annotations

import torch

import saver as _s

from ._forms import _column_ranges, _is_dtensor, _is_sharded, _local_parts, _shards_wrapper


#: Adagrad's accumulated squares go by two names: ``torch.optim.Adagrad`` calls them ``sum``,
#: TorchRec's fused Adagrad ``momentum1`` (its first state, whatever the optimizer). A table
#: whose plan moves it between the two (data-parallel, trained by the dense optimizer, and
#: sharded, trained by the fused one) keeps its state by reading the other name.
_ALIASES = {"sum": "momentum1", "momentum1": "sum"}


def _held_slot(held_slots, key, shape):
    """The checkpoint's slot of a table holding optimizer state `key` of `shape`: its own name,
    else its alias (see `_ALIASES`) when that is the table's only state of that shape; None."""
    if f"state.{key}" in held_slots:
        return f"state.{key}"
    alias = _ALIASES.get(key)
    same_shape = [s for s, (_, sh) in held_slots.items() if s.startswith("state.") and tuple(sh) == tuple(shape)]
    if alias is not None and same_shape == [f"state.{alias}"]:
        return same_shape[0]
    return None


def _rowwise_shards(st, rows, what):
    """The local shards of a row-wise state of a table cut into column ranges (TorchRec's: one
    value per row per column shard, a 1-D sharded tensor of rows·k values, column shard j's rows
    at j·rows): (tensor, rows n, column shard j, first row r) each."""
    for tensor, offset in _local_parts(st):
        o, n = offset[0], tensor.shape[0]
        j, r = divmod(o, rows)
        if r + n > rows:
            raise _s.InputError(f"{what}: a shard of the row-wise state crosses column shards; not supported")
        yield tensor, n, j, r


def _rowwise_chunks(st, rows, what):
    """A row-wise state (see `_rowwise_shards`) as chunks of a [rows, k] slot."""
    total = tuple(st.size())[0] // rows
    return [
        _s.Chunk(tensor.detach().reshape(n, 1), offset=(r, j), shape=(rows, total))
        for tensor, n, j, r in _rowwise_shards(st, rows, what)
    ]


def _rowwise_fill(tensor, n, r, cut, saved, after):
    """Chunks that fill `tensor`, rows r..r+n of a row-wise state for the table's columns `cut`
    = (a, b), from a [rows, k] slot saved for column ranges `saved`: a cut that was saved is
    read straight into; any other gets the mean of the saved ranges it overlaps, each weighted
    by the columns they share (buffers read here, the mean taken after the load: `after`)."""
    a, b = cut
    if (a, b) in saved:
        return [_s.Chunk(tensor.reshape(n, 1), offset=(r, saved.index((a, b))))]
    out, parts = [], []
    for k, (sa, sb) in enumerate(saved):
        w = min(b, sb) - max(a, sa)
        if w > 0:
            buf = torch.empty(n, 1, dtype=tensor.dtype)
            out.append(_s.Chunk(buf, offset=(r, k)))
            parts.append((w, buf))

    def mean():
        total = sum(w for w, _ in parts)
        tensor.copy_(sum(w * b for w, b in parts).reshape(tensor.shape) / total)

    after.append(mean)
    return out


def _column_mean_fill(tensor, n, r, cut, dtype, after):
    """Chunks that fill `tensor`, rows r..r+n of a row-wise state for the table's columns `cut`
    = (a, b), from an element-wise slot (one value per row and column, `dtype`): each row's mean
    over the columns of `cut` (the columns read here, the mean taken after the load)."""
    a, b = cut
    buf = torch.empty(n, b - a, dtype=dtype)
    after.append(lambda: tensor.copy_(buf.mean(1).reshape(tensor.shape)))
    return [_s.Chunk(buf, offset=(r, a))]


def _broadcast_fill(target, offset, saved, dtype, after):
    """Chunks that fill `target`, the part at `offset` (row, column) of an element-wise state
    (one value per row and column), from a row-wise [rows, k] slot (`dtype`) saved for column
    ranges `saved`: each range's value of a row, broadcast over the range's columns in
    `target` (the values read here, broadcast after the load)."""
    (r, c), (n, w) = offset, tuple(target.shape)
    out, parts = [], []
    for k, (a, b) in enumerate(saved):
        a, b = max(a, c), min(b, c + w)
        if a < b:
            buf = torch.empty(n, 1, dtype=dtype)
            out.append(_s.Chunk(buf, offset=(r, k)))
            parts.append((a - c, b - c, buf))

    def broadcast():
        for a, b, buf in parts:
            target[:, a:b] = buf

    after.append(broadcast)
    return out


def _rowwise_targets(st, t, what, fill):
    """Chunks that fill the local shards of row-wise state `st` of table `t`: `fill(tensor, n,
    r, cut)` of each (rows r..r+n of the shard of the table's columns `cut`)."""
    shards = list(_rowwise_shards(st, tuple(t.size())[0], what))
    ranges = _column_ranges(t)
    if _is_dtensor(t):
        # This rank's column shards, in column order, are the column shards it holds state of,
        # in order (TorchRec keeps a column shard's state with its rows).
        held = sorted({j for _, _, j, _ in shards})
        if len(held) != len(ranges):
            raise _s.InputError(f"{what}: this rank holds state of {len(held)} column shards and rows of {len(ranges)}")
        ranges = dict(zip(held, ranges))
    out = []
    for tensor, n, j, r in shards:
        out += fill(tensor, n, r, ranges[j])
    return out


def _is_rowwise(t, st) -> bool:
    """Whether fused state `st` of sharded table `t` is row-wise: one value per row per column
    shard (TorchRec's 1-D ShardedTensor, or DTensor holding its shards, of rows·k values)."""
    if not (_is_sharded(st) and st.dim() == 1 and len(tuple(t.size())) == 2):
        return False
    rows, values = tuple(t.size())[0], tuple(st.size())[0]
    if _is_dtensor(t) or _is_dtensor(st):
        return (_shards_wrapper(t) is not None and _shards_wrapper(st) is not None
                and rows > 0 and values % rows == 0)
    return values == rows * len(_column_ranges(t))


def _saved_rowwise(meta, held_slots, name, key, cols):
    """(slot, column ranges) of the checkpoint's row-wise state of table `name` that state `key`
    reads, by its name or its alias: a [rows, k] slot whose ranges the metadata holds (a fused
    optimizer's), or a [rows, 1] slot (a plain optimizer's, `torchrec.optim.RowWiseAdagrad`'s
    `sum`: one range, all `cols` columns); None."""
    rowwise = meta.get("rowwise", {}).get(name, {})
    for k in (key, _ALIASES.get(key)):
        if k is None or f"state.{k}" not in held_slots:
            continue
        shape = tuple(held_slots[f"state.{k}"][1])
        if k in rowwise:
            ranges = rowwise[k]
            if len(shape) != 2 or not isinstance(ranges, list) or shape[1] != len(ranges):
                raise _s.InputError(f"{name}: the checkpoint's row-wise state {k!r} of shape {shape} has {len(ranges)} column ranges in its metadata")
            return f"state.{k}", _column_cut(ranges, cols, f"{name}: the checkpoint's row-wise state {k!r}")
        if len(shape) == 2 and shape[1] == 1 and cols > 1:
            return f"state.{k}", [(0, cols)]
    return None


def _column_cut(ranges, cols, what):
    """The column ranges of a row-wise state's metadata as [(a, b)], refused unless they cut the
    table's `cols` columns into consecutive ranges from the first column to the last (a mean
    over ranges that overlap no column would divide by nothing)."""
    out, at = [], 0
    for x in ranges:
        ok = isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x)
        if not ok or x[0] != at or x[1] <= x[0]:
            raise _s.InputError(f"{what}: its column ranges {ranges} in the metadata do not cut columns 0..{cols} in order")
        out.append((x[0], x[1]))
        at = x[1]
    if at != cols:
        raise _s.InputError(f"{what}: its column ranges {ranges} in the metadata do not cut columns 0..{cols} in order")
    return out


def _fused_state(model):
    """TorchRec's fused optimizer state (a DistributedModelParallel's `fused_optimizer`):
    {table parameter: {state name: tensor}} (the tensors of the state dict returned last), its
    param groups, the optimizer and that state dict; ({}, None, None, None) without one."""
    fused = getattr(model, "fused_optimizer", None)
    if fused is None:
        return {}, None, None, None
    sd = fused.state_dict()
    out = {}
    for param, states in sd.get("state", {}).items():
        table = param.split(".")[-2] if param.endswith(".weight") else param
        out[param] = {k[len(table) + 1:] if k.startswith(table + ".") else k: v for k, v in states.items()}
    return out, sd.get("param_groups"), fused, sd


def _dense_part(model, optimizer):
    """What of `optimizer` trains the model's dense parameters, as a torch optimizer: TorchRec's
    own examples pass the model's fused optimizer (`dmp.fused_optimizer`), or a
    `CombinedOptimizer` of it and a `KeyedOptimizerWrapper` of a torch optimizer. The fused part
    is always taken from the model; None when nothing else is left."""
    fused = _parts(getattr(model, "fused_optimizer", None))
    if optimizer is None or id(optimizer) in fused:
        return None
    if _is_combined(optimizer):
        rest = [_dense_part(model, o) for _, o in _children(optimizer)]
        rest = [o for o in rest if o is not None]
        if len(rest) > 1:
            raise _s.InputError(f"optimizer: a CombinedOptimizer of {len(rest)} optimizers besides the model's fused one; give the one of the dense parameters")
        return rest[0] if rest else None
    inner = getattr(optimizer, "_optimizer", None)
    if type(optimizer).__name__ == "KeyedOptimizerWrapper" and isinstance(inner, torch.optim.Optimizer):
        return inner
    return optimizer


def _is_combined(optimizer) -> bool:
    return type(optimizer).__name__ == "CombinedOptimizer" and hasattr(optimizer, "optimizers")


def _children(optimizer) -> list:
    """A CombinedOptimizer's (key, optimizer) pairs (a property in TorchRec, a method in some
    releases)."""
    parts = optimizer.optimizers
    return list(parts() if callable(parts) else parts)


def _parts(optimizer) -> set:
    """The ids of `optimizer` and, for a TorchRec CombinedOptimizer (which takes the parts of
    one it is given as its own), of every optimizer within it."""
    if optimizer is None:
        return set()
    out = {id(optimizer)}
    if _is_combined(optimizer):
        for _, o in _children(optimizer):
            out |= _parts(o)
    return out


#: How a state of one kind reads into the other (see `_convert`).
_CONVERSIONS = {
    "row-wise": ("one value per row per column shard, as RowWiseAdagrad keeps it",
                 "one value per row and column, as Adagrad keeps it",
                 "each row's value broadcast over the columns it was kept for"),
    "element-wise": ("one value per row and column, as Adagrad keeps it",
                     "one value per row per column shard, as RowWiseAdagrad keeps it",
                     "each row's mean over the columns of the shard"),
}


def _convert(path, table, slot, key, saved_kind, strict):
    """A table's optimizer state saved `saved_kind` ("row-wise" or "element-wise"), read into
    a state `key` the model's optimizer keeps the other way: the documented conversion (the mean
    over a column shard's columns one way, the broadcast the other way), which keeps the
    meaning of Adagrad's accumulated squares but not their every value. Refused under `strict`;
    otherwise done, with a warning."""
    held, wanted, rule = _CONVERSIONS[saved_kind]
    saved = slot[len("state."):]
    message = (f"{path}: table {table!r}: the checkpoint holds {saved!r} {saved_kind} ({held}), not as "
               f"the model's optimizer keeps it ({key!r}: {wanted}): another optimizer saved it")
    if strict:
        raise _s.InputError(f"{message}; strict=False converts it ({rule})")
    import warnings

    warnings.warn(f"{message}; converted ({rule})", _s.SaverWarning, stacklevel=4)


def _missing_state(path, table, held_slots, key, strict):
    """A fused optimizer state the checkpoint does not hold for `table`. Saved by another
    optimizer (the table holds other state): an error when strict. Saved without one (weights
    only): the state keeps its value, and a warning says so."""
    message = f"{path} holds no optimizer state {key!r} of table {table!r}"
    others = sorted(s[len("state."):] for s in held_slots if s.startswith("state."))
    if f"state.{key}" in held_slots:
        # Held, but not as the model's optimizer keeps it: another optimizer saved it.
        message = (f"{path} holds optimizer state {key!r} of table {table!r} of shape "
                   f"{tuple(held_slots[f'state.{key}'][1])}, not as the model's optimizer keeps it (another "
                   "optimizer saved it: RowWiseAdagrad keeps one value per row, Adagrad one per element)")
    if strict and others:
        held = "" if f"state.{key}" in held_slots else f", only {others}"
        raise _s.InputError(f"{message}{held} (load with strict=False to keep the optimizer's own)")
    import warnings

    warnings.warn(message + "; it keeps the optimizer's own", stacklevel=3)
