"""PyTorch models and optimizers in three lines.

>>> import saver.torch
>>> saver.torch.save("/ckpt/step-100", model, optimizer, step=100, extra={"epoch": 3})
>>> extra = saver.torch.load("/ckpt/step-100", model, optimizer)   # fills them in place

What goes where (names follow the model, so a checkpoint reads into any split of it):

- every ``nn.Embedding`` / ``nn.EmbeddingBag`` weight (and any 2-D parameter named in
  ``tables=``) is a **row-range table** named by its parameter (``"emb.weight"``): slot
  ``"param"`` holds its values, and each optimizer state of its shape, or of one value per row,
  is a slot of the same table (``"state.sum"`` for Adagrad, ``"state.exp_avg"`` and
  ``"state.exp_avg_sq"`` for Adam), so that it is saved, loaded and resharded with its rows;
- every other parameter and buffer of ``model.state_dict()`` is a **dense tensor** of its name,
  and its optimizer state is ``"optimizer/<parameter>/<state>"`` (a scalar state of a table,
  Adam's ``step``, too);
- the optimizer's param groups (hyperparameters, with parameters by name), its class, ``step``
  and ``extra`` (anything JSON can hold) are in the checkpoint's metadata.

TorchRec: under ``DistributedModelParallel`` a sharded table is a ShardedTensor (or, with
``output_dtensor``, a DTensor holding the rank's shards); each rank gives
its local shards at their global offsets (table-wise, row-wise, column-wise, grid alike) and a
load fills the local shards of whatever plan and world size the model has now, then hands them
to the model's and the fused optimizer's ``load_state_dict``. The fused optimizer's state of the
table's shape is a slot of the table. A row-wise state (row-wise Adagrad's ``momentum1``: one
value per row per column shard) is a ``[rows, column shards]`` slot with the column ranges in the
metadata; loaded into the same column cut it is exact, and a column shard of another cut gets
the mean of the saved shards it overlaps, each weighted by the columns they share (a table-wise
plan: the mean over all of them).

Under ``torch.distributed`` (initialized, world size above 1) every rank calls the same function
with its own replica: rank ``r`` writes rows ``rows·r/W .. rows·(r+1)/W`` of every table and the
ranks share the dense tensors, one save id agreed through the process group and one commit; a
load fills every rank's replica whole. The same with a :class:`saver.Manager` in place of the
path: the step is saved (a delta of the step before when its policy says so) and ``load`` reads
the newest committed step.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Iterable, Optional, Union

import numpy as np
import torch

import saver as _s

#: Metadata key of what this module stores beside the tensors.
META_KEY = "saver.torch"
#: Version of that metadata.
META_VERSION = 1

_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)

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


def _table_params(model: torch.nn.Module, tables: Optional[Iterable[str]]) -> dict:
    """{parameter name: parameter} of the parameters saved as row-range tables."""
    named = dict(model.named_parameters())
    out = {}
    for mod_name, m in model.named_modules():
        if isinstance(m, _EMBEDDINGS) and m.weight is not None:
            out[f"{mod_name}.weight" if mod_name else "weight"] = m.weight
    # A table TorchRec holds in a batched kernel is a slice of it: whole on every rank when its
    # plan is data-parallel (sharded ones are read by their shards, elsewhere).
    for name, p in named.items():
        if type(p).__name__ == "TableBatchedEmbeddingSlice" and p.dim() == 2:
            out[name] = p
    for name in tables or ():
        if name not in named:
            raise _s.InputError(f"tables: the model has no parameter {name!r}")
        if named[name].dim() != 2:
            raise _s.InputError(f"tables: parameter {name!r} has shape {tuple(named[name].shape)}; a table has rows and columns")
        out[name] = named[name]
    for name, p in out.items():
        if p.device.type != "cpu":
            raise _s.InputError(f"parameter {name!r} is on {p.device}; saver.torch saves CPU tensors (move the model, or copy it, to the CPU)")
    return out


def _param_names(model: torch.nn.Module) -> dict:
    """{id(parameter): name}, shared parameters under their first name."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def _optimizer_state(model, optimizer):
    """[(parameter name, parameter, {state key: value})] and the param groups by name."""
    if optimizer is None:
        return [], []
    names = _param_names(model)
    groups, states = [], []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        params = []
        for p in g["params"]:
            name = names.get(id(p))
            if name is None:
                raise _s.InputError("optimizer: it updates a parameter the model does not have")
            params.append(name)
            st = optimizer.state.get(p)
            if st:
                states.append((name, p, st))
        try:
            json.dumps(hyper)
        except TypeError as e:
            raise _s.InputError(f"optimizer: a param group's hyperparameters are not JSON ({e})") from None
        groups.append({"hyper": hyper, "params": params})
    return states, groups


def _sharded_types():
    """torch's classes of a tensor sharded over ranks: ShardedTensor (what TorchRec's
    DistributedModelParallel gives for a sharded table) and DTensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return ShardedTensor, DTensor


def _is_sharded(t) -> bool:
    return isinstance(t, _sharded_types())


def _is_dtensor(t) -> bool:
    return isinstance(t, _sharded_types()[1])


def _shards_wrapper(t):
    """The local shards of DTensor `t` when it holds them as TorchRec's DTensor form does (a
    `LocalShardsWrapper`, TorchRec's class or torch's: any number of shards per rank, each at
    its own offset, a table-wise table's on its one rank only, whatever its placements say),
    else None."""
    if not _is_dtensor(t):
        return None
    local = t.to_local()
    return local if hasattr(local, "local_shards") and hasattr(local, "local_offsets") else None


def _local_parts(t):
    """[(tensor, global offset)] of the part of sharded tensor `t` this rank writes and reads:
    a ShardedTensor's local shards, or a DTensor's held as TorchRec holds them; another
    DTensor's local tensor, unless it is a replica another rank writes (a DTensor replicated
    over a mesh dimension is written by that dimension's first rank, and read by every rank)."""
    if not _is_dtensor(t):
        return [(shard.tensor, tuple(shard.metadata.shard_offsets)) for shard in t.local_shards()]
    wrapped = _shards_wrapper(t)
    if wrapped is not None:
        return [(x, tuple(o)) for x, o in zip(wrapped.local_shards(), wrapped.local_offsets())]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    if local.numel() == 0:
        return []
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [(local, tuple(offset))]


def _chunks_of(t, what, reading=False):
    """The local shards of sharded tensor `t` as chunks at their global offsets: [] when this
    rank holds none of it. A DTensor replica is written once (`_local_parts`) and read by all
    (`reading`)."""
    shape = tuple(t.size())
    if len(shape) not in (1, 2):
        raise _s.InputError(f"{what}: a sharded tensor of shape {shape}; a table has rows, and columns")
    out = []
    for tensor, offset in _local_parts(t):
        if tensor.device.type != "cpu":
            raise _s.InputError(f"{what}: a shard on {tensor.device}; saver.torch saves CPU tensors")
        out.append(_s.Chunk(tensor.detach(), offset=offset, shape=shape))
    if not reading and _is_dtensor(t) and out and _shards_wrapper(t) is None:
        from torch.distributed.tensor import Replicate

        coordinate = t.device_mesh.get_coordinate() or []
        if any(isinstance(p, Replicate) and c != 0 for p, c in zip(t.placements, coordinate)):
            return []
    return out


def _column_ranges(t):
    """The column ranges [a, b) a 2-D ShardedTensor is cut into, in order (one for a table
    sharded by rows or whole); of TorchRec's DTensor form, which knows only its own shards,
    those of this rank's shards."""
    shape = tuple(t.size())
    if len(shape) != 2:
        return [(0, 1)]
    if _is_dtensor(t):
        return sorted({(o[1], o[1] + x.shape[1]) for x, o in _local_parts(t)})
    ranges = {(m.shard_offsets[1], m.shard_offsets[1] + m.shard_sizes[1]) for m in t.metadata().shards_metadata}
    return sorted(ranges)


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


def _rowwise_fill(tensor, n, r, cut, saved, means):
    """Chunks that fill `tensor`, rows r..r+n of a row-wise state for the table's columns `cut`
    = (a, b), from a [rows, k] slot saved for column ranges `saved`: a cut that was saved is
    read straight into; any other gets the mean of the saved ranges it overlaps, each weighted
    by the columns they share (buffers read here, the mean taken after the load: `means`)."""
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
    means.append((tensor, parts))
    return out


def _rowwise_targets(st, t, saved, what, means):
    """Chunks that fill the local shards of row-wise state `st` of table `t` (see
    `_rowwise_fill`)."""
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
        out += _rowwise_fill(tensor, n, r, ranges[j], saved, means)
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
            ranges = [tuple(x) for x in rowwise[k]]
            if len(shape) != 2 or shape[1] != len(ranges):
                raise _s.InputError(f"{name}: the checkpoint's row-wise state {k!r} of shape {shape} has {len(ranges)} column ranges in its metadata")
            return f"state.{k}", ranges
        if len(shape) == 2 and shape[1] == 1 and cols > 1:
            return f"state.{k}", [(0, cols)]
    return None


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


def _world():
    """(rank, world size) under an initialized torch.distributed of more than one rank, else
    (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agreed(value):
    """Rank 0's `value`, on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _collect(model, optimizer, tables, step, extra, rank, world):
    """The save's tables, dense tensors and metadata for this rank."""
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
        if t.device.type != "cpu":
            raise _s.InputError(f"state {name!r} is on {t.device}; saver.torch saves CPU tensors")
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
    out_tables = {}
    for name, slots in by_table.items():
        rows = next(iter(slots.values())).shape[0]
        a, b = rows * rank // world, rows * (rank + 1) // world
        out_tables[name] = {
            slot: _s.Chunk(v[a:b], offset=(a,) + (0,) * (v.dim() - 1), shape=tuple(v.shape))
            for slot, v in slots.items()
        }
    for name, slots in sharded.items():
        held = {slot: chunks for slot, chunks in slots.items() if chunks}
        if held:
            out_tables[name] = held
    return out_tables, dense, meta


def _jsonable(value):
    """`value` with what JSON cannot hold (tensors, tuples) turned into what it can."""
    if value is None:
        return None
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if torch.is_tensor(v) else str(v)))


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
        out_tables, dense, meta = _collect(model, optimizer, tables, step, extra, rank, world)
    else:
        # Each rank sees the row-wise state of the shards it holds: the metadata, which every
        # rank must give alike, takes them all. A rank that cannot give its share says so
        # here, and every rank raises (rather than wait for it).
        import torch.distributed as dist

        failure, rowwise = None, {}
        try:
            out_tables, dense, meta = _collect(model, optimizer, tables, step, extra, rank, world)
            rowwise = meta["rowwise"]
        except Exception as e:  # noqa: BLE001 - told to every rank, then raised
            failure = f"rank {rank}: {e}"
        seen = [None] * world
        dist.all_gather_object(seen, (failure, rowwise))
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


#: How often the ranks of a save tell each other how their shares go, in seconds.
_TICK = 0.5


def _agree(call, rank, world):
    """`call()` (one rank's share of a save, or its wait), then, under torch.distributed, the
    ranks' outcome agreed: every rank raises if one failed, and returns once every rank's call
    returned. The call runs on a thread of its own while the ranks tell each other through the
    process group, every `_TICK`, whether theirs has ended: a rank that dies (whose share never
    comes, so that the others' calls would wait for it until their timeout) breaks the next
    round, and every survivor raises within a tick."""
    if world == 1:
        return call()
    import threading

    import torch.distributed as dist

    box = {}

    def share():
        try:
            box["report"] = call()
        except BaseException as e:  # noqa: BLE001 - told to every rank, then raised
            box["failure"] = f"rank {rank}: {type(e).__name__ if not str(e) else e}"

    worker = threading.Thread(target=share, name="saver-rank-share", daemon=True)
    worker.start()
    while True:
        worker.join(_TICK)
        mine = "running" if worker.is_alive() else box.get("failure", "done")
        seen = [None] * world
        try:
            dist.all_gather_object(seen, mine)
        except Exception as e:  # noqa: BLE001 - a peer gone: this rank's error, whatever it was
            raise _s.SaverError(f"rank {rank}: another rank left the save (died, or its process group ended): {e}") from e
        failed = [f for f in seen if f not in ("running", "done")]
        if failed:
            raise _s.SaverError("; ".join(failed))
        if all(f == "done" for f in seen):
            return box["report"]


class RanksHandle:
    """A background save of every rank under torch.distributed (:func:`save_async`): each rank
    holds one, and every rank calls :meth:`wait`."""

    def __init__(self, handle, rank, world):
        self._handle, self._rank, self._world = handle, rank, world

    def done(self) -> bool:
        """Whether **this rank's** share has ended: another rank's may end a step earlier or
        later, so a trainer that branches on it can split its ranks' collectives; branch on
        :meth:`wait`, which the ranks agree on."""
        return self._handle.done()

    def wait(self):
        """Waits for every rank's share, agreed through the process group: this rank's report,
        or, on every rank, the error of any rank that failed or died."""
        return _agree(self._handle.wait, self._rank, self._world)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def save(target: Union[os.PathLike, str, "_s.Manager"], model: torch.nn.Module,
         optimizer: Optional[torch.optim.Optimizer] = None, *, step: Optional[int] = None,
         extra: Any = None, tables: Optional[Iterable[str]] = None, **options: Any):
    """Saves ``model`` (its ``state_dict()``) and ``optimizer`` at ``target`` (a path, or a
    :class:`saver.Manager`, which needs ``step``), committed when this returns. ``extra``:
    anything JSON holds, given back by :func:`load`. ``tables``: parameter names of 2-D
    parameters to save as row-range tables beside the embeddings found. Other options as
    :func:`saver.save` (``compress``, ``parent``, ``durable``...; ``direct_io`` is ``"off"`` here:
    the tensors are written from their own memory through the page cache, with no staging
    buffers; :func:`save_async` keeps ``"auto"``). Tensors are read in place: none may change until this returns."""
    return _save(target, model, optimizer, step, extra, tables, False, options)


def save_async(target: Union[os.PathLike, str, "_s.Manager"], model: torch.nn.Module,
               optimizer: Optional[torch.optim.Optimizer] = None, *, step: Optional[int] = None,
               extra: Any = None, tables: Optional[Iterable[str]] = None, **options: Any):
    """:func:`save` in the background: returns a handle once the model and optimizer state are
    copied (every core copies), so that training may go on at once; ``handle.wait()`` returns
    the report, or raises the save's error. Under ``torch.distributed`` every rank calls it at
    the same step (the ranks agree on the save id then) and gets a :class:`RanksHandle`: every
    rank calls its ``wait()``, which returns this rank's report once every rank's share has
    ended, and raises on every rank if any failed or died (learnt through the process group
    within a second, not when a Manager's wait for the commit ends); its ``done()`` is this
    rank's alone. The copy's memory is kept for the next
    background save, which copies into it at memory speed rather than the kernel's page-fault
    speed and writes it to the disk from there (:func:`saver.background_memory`)."""
    return _save(target, model, optimizer, step, extra, tables, True, options)


#: What each entry of the metadata must be: a load trusts no checkpoint's metadata.
_META_TYPES = {
    "version": int, "optimizer": (str, type(None)), "param_groups": list, "fused_param_groups": (list, type(None)),
    "tables": list, "sharded": list, "rowwise": dict, "scalars": dict, "step": (int, type(None)),
}


def _meta(path) -> dict:
    ck = _s.Checkpoint(path)
    raw = ck.metadata.get(META_KEY)
    where = f"{os.fspath(path)}: the {META_KEY!r} metadata"
    if raw is None:
        raise _s.InputError(f"{os.fspath(path)} was not saved by saver.torch (no {META_KEY!r} metadata)")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise _s.InputError(f"{where} is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise _s.InputError(f"{where} is not an object")
    if meta.get("version") != META_VERSION:
        raise _s.InputError(f"{os.fspath(path)}: saver.torch metadata version {meta.get('version')}, this package reads {META_VERSION}")
    # Entries later saves added: what a checkpoint without them meant.
    meta.setdefault("scalars", {})
    meta.setdefault("rowwise", {})
    meta.setdefault("fused_param_groups", None)
    for key, kind in _META_TYPES.items():
        if key not in meta or not isinstance(meta[key], kind) or (isinstance(meta[key], bool) and kind is int):
            raise _s.InputError(f"{where}: {key!r} is missing or not a {getattr(kind, '__name__', kind)}")
    for g in meta["param_groups"]:
        if not (isinstance(g, dict) and isinstance(g.get("hyper"), dict) and isinstance(g.get("params"), list)
                and all(isinstance(n, str) for n in g["params"])):
            raise _s.InputError(f"{where}: a param group is not {{'hyper': {{...}}, 'params': [names]}}")
    for key in ("tables", "sharded"):
        if not all(isinstance(n, str) for n in meta[key]):
            raise _s.InputError(f"{where}: {key!r} is not a list of names")
    if "extra" not in meta:
        raise _s.InputError(f"{where}: 'extra' is missing")
    return meta, ck


def _same_checkpoint(ck, path):
    """Under torch.distributed, fails on every rank unless every rank opened the same save (a
    rank given another path, or a path replaced between the ranks' opens, would load another
    step silently)."""
    rank, world = _world()
    if world == 1:
        return
    import torch.distributed as dist

    seen = [None] * world
    dist.all_gather_object(seen, (ck.save_id, os.fspath(path)))
    if len({s for s, _ in seen}) > 1:
        raise _s.InputError("the ranks opened different checkpoints: " + ", ".join(f"rank {r} {p} (save {s})" for r, (s, p) in enumerate(seen)))


def load(source: Union[os.PathLike, str, "_s.Manager"], model: torch.nn.Module,
         optimizer: Optional[torch.optim.Optimizer] = None, *, strict: bool = True,
         fallback: bool = False) -> Any:
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
    the step passed over), so that training never goes on from a mixture."""
    if isinstance(source, _s.Manager):
        latest = _load_newest(source, model, optimizer, strict, fallback)
        if latest is None:
            raise _s.InputError(f"{source.root} holds no committed step")
        return latest[1]
    if fallback:
        raise _s.InputError("fallback: a path is one checkpoint; give a saver.Manager to fall back to older steps")
    return _load(os.fspath(source), model, optimizer, strict)


def load_latest(manager: "_s.Manager", model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                *, strict: bool = True, fallback: bool = False):
    """:func:`load` of ``manager``'s newest committed step (with ``fallback``, the newest that
    loads): ``(step, extra)``, the step read and the ``extra`` saved with it, or ``None`` when
    the root holds no step. Where a restarted job resumes, as :meth:`saver.Manager.load_latest`."""
    if not isinstance(manager, _s.Manager):
        raise _s.InputError(f"manager: give a saver.Manager, got {type(manager).__name__}")
    return _load_newest(manager, model, optimizer, strict, fallback)


def _load_newest(manager, model, optimizer, strict, fallback):
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
            return step, _load(path, model, optimizer, strict)
        failure = None
        try:
            extra = _load(path, model, optimizer, strict)
        except _s.InputError:
            raise  # the model does not fit the checkpoint: an older step would not fit either
        except _s.SaverError as e:
            failure = f"rank {_world()[0]}: {e}"
        failures = [failure]
        if world > 1:
            import torch.distributed as dist

            failures = [None] * world
            dist.all_gather_object(failures, failure)
        failed = [f for f in failures if f]
        if not failed:
            return step, extra
        warnings.warn(f"step {step} does not load ({'; '.join(failed)}); falling back to step {steps[k + 1][0]}", _s.SaverWarning, stacklevel=3)


def _load(path, model, optimizer, strict):
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
        import torch.distributed as dist

        seen = [None] * _world()[1]
        dist.all_gather_object(seen, None if failure is None else f"rank {_world()[0]}: {failure}")
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
    held_tables = ck.row_tables
    into = {}
    means = []  # (target, [(weight, buffer)]): row-wise state converted to another column cut
    # Optimizer state of tables: existing tensors filled in place, missing ones made.
    made = {}
    for name, p in table_params.items():
        held = held_tables.get(name)
        if held is None:
            if strict:
                raise _s.InputError(f"{path} holds no table {name!r} (it holds {sorted(held_tables)})")
            continue
        dtype, shape = held["slots"].get("param", (None, None))
        if shape is None or tuple(shape) != tuple(p.shape) or _torch_dtype(dtype, name) != p.dtype:
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
                        slots.setdefault(found[0], []).extend(_rowwise_fill(t, t.shape[0], 0, (0, p.shape[1]), found[1], means))
                        continue
                    wanted[_held_slot(held["slots"], k, t.shape)] = k
                wanted.pop(None, None)
            else:
                wanted = {slot: slot[len("state."):] for slot in held["slots"] if slot.startswith("state.")}
            for slot, key in wanted.items():
                dtype, shape = held["slots"][slot]
                t = st.get(key)
                if not (torch.is_tensor(t) and tuple(t.shape) == tuple(shape)):
                    t = torch.empty(tuple(shape), dtype=_torch_dtype(dtype, f"{name}/{slot}"))
                    made[(name, key)] = t
                slots[slot] = _s.Chunk(t)
        into[name] = slots
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
                if found is None:
                    _missing_state(path, name, held["slots"], key, strict)
                    continue
                slots[found[0]] = _rowwise_targets(st, t, found[1], f"{name} {key}", means)
                continue
            if meta.get("rowwise", {}).get(name, {}).get(key) is not None:
                if _is_dtensor(st) and _shards_wrapper(st) is None:
                    raise _s.InputError(f"{name}: the checkpoint holds row-wise state {key!r} by column shards; reading it into a DTensor other than TorchRec's form is not supported")
                raise _s.InputError(
                    f"{name}: the checkpoint holds {key!r} row-wise (one value per row per column shard, as "
                    f"RowWiseAdagrad keeps it), the model's fused optimizer of the table's shape {tuple(st.size())} "
                    "(another optimizer): load it with the optimizer it was saved with")
            slot = _held_slot(held["slots"], key, tuple(st.size()))
            if slot is None:
                _missing_state(path, name, held["slots"], key, strict)
                continue
            slots[slot] = _chunks_of(st, f"{name} {key}", reading=True)
        slots = {k: v for k, v in slots.items() if v}
        if slots:
            into[name] = slots
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
    try:
        loaded = _s.load(path, into=into, tables=list(into) or None)
    except _s.InputError:
        raise  # refused before any byte was read into the model
    except _s.SaverError as e:
        filled = sorted(into)
        raise _s.SaverError(
            f"{e}; the load stopped while reading: {filled} (with their optimizer state) may hold "
            "part of this checkpoint, and the rest of the model and optimizer is as it was: load "
            "a good checkpoint before training (a Manager's older step: saver.torch.load(manager, "
            "..., fallback=True))"
        ) from e
    for target, parts in means:
        total = sum(w for w, _ in parts)
        with torch.no_grad():
            target.copy_(sum(w * b for w, b in parts).reshape(target.shape) / total)
    if sharded:
        model.load_state_dict(state_sd, strict=False)
    if fused_sd is not None:
        for param, states in fused_sd.get("state", {}).items():
            table = param.split(".")[-2] if param.endswith(".weight") else param
            for k in states:
                short = k[len(table) + 1:] if k.startswith(table + ".") else k
                key = f"fused/{param}/{short}"
                if key in loaded.dense and not _is_sharded(states[k]):
                    states[k] = _as_tensor(loaded.dense[key], states[k].dtype)
        fused_opt.load_state_dict(fused_sd)
    for (name, key), t in made.items():
        optimizer.state[by_name[name]][key] = t
    state = model.state_dict(keep_vars=True)
    wanted = {k for k in state if k not in table_params and k not in sharded}
    for k in wanted & set(held_dense):
        _copy_into(state[k], loaded.dense[k], k)
    if optimizer is not None:
        _load_optimizer(optimizer, meta, loaded.dense, by_name, names, path)
    return meta["extra"]


def _updates(optimizer, p) -> bool:
    """Whether `optimizer` updates parameter `p`."""
    return any(q is p for g in optimizer.param_groups for q in g["params"])


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


#: The torch dtype of each saver dtype a model's tensors are read into.
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                 "U8": torch.uint8, "BOOL": torch.bool}


def _torch_dtype(name: str, what: str):
    if name not in _TORCH_DTYPES:
        raise _s.InputError(f"{what}: dtype {name} has no torch type here")
    return _TORCH_DTYPES[name]


def _as_tensor(array, dtype=None):
    """A loaded array as a tensor over its memory (16-bit and 8-bit float patterns viewed as
    `dtype`). A 0-d array stays 0-d (numpy's ascontiguousarray would make it 1-d)."""
    a = np.asarray(array)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a).reshape(array.shape)
    if isinstance(array, _s.Bits):
        raw = torch.from_numpy(a.view(np.uint8).reshape(-1))
        return raw.view(dtype).reshape(array.shape) if dtype is not None else raw
    return torch.from_numpy(a).reshape(array.shape)


def _check_hyper(meta, optimizer, path):
    """A saved hyperparameter the optimizer holds as a number must be a number (`lr: "fast"`
    would load as a string and fail at the first step)."""
    if optimizer is None:
        return
    current = {k: v for g in optimizer.param_groups for k, v in g.items() if k != "params"}
    for g in meta["param_groups"]:
        for k, v in g["hyper"].items():
            now = current.get(k)
            number = (int, float)
            if isinstance(now, number) and not isinstance(now, bool) and (not isinstance(v, number) or isinstance(v, bool)):
                raise _s.InputError(f"{path}: hyperparameter {k!r} is {v!r} in the checkpoint, a number in the optimizer")


def _check_dense(target, dtype, shape, name):
    """Refuses a tensor of the checkpoint (`dtype`, `shape` from its manifest) that does not fit
    `target`, before anything is read."""
    held = _TORCH_DTYPES.get(dtype)
    if tuple(shape) != tuple(target.shape) or (held is not None and held != target.dtype):
        raise _s.InputError(f"{name}: the checkpoint holds {dtype} of shape {tuple(shape)}, the model {target.dtype} of shape {tuple(target.shape)}")


def _copy_into(target, array, name):
    """Copies a loaded array into `target` (a tensor of the model), shape and dtype checked."""
    src = _as_tensor(array, target.dtype)
    if tuple(src.shape) != tuple(target.shape) or src.dtype != target.dtype:
        raise _s.InputError(f"{name}: the checkpoint holds {src.dtype} of shape {tuple(src.shape)}, the model {target.dtype} of shape {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(src)


def _groups(optimizer, meta, names):
    """The saved param groups and the optimizer's, by parameter name."""
    return meta["param_groups"], [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]


def _check_optimizer(optimizer, meta, held_dense, by_name, names, tables_here, path):
    """What `_load_optimizer` needs of the checkpoint, checked before anything is read: the
    optimizer's class, its param groups, and a parameter for every dense state. A table another
    plan trains by the other optimizer (data-parallel: the dense one; sharded: the fused one)
    is in the param groups of one save and not of the other: groups are matched by their other
    parameters."""
    if meta["optimizer"] is not None and meta["optimizer"] != type(optimizer).__name__:
        raise _s.InputError(f"{path} holds the state of a {meta['optimizer']}, not of a {type(optimizer).__name__}")
    tables = set(meta["tables"]) | set(meta["sharded"]) | set(tables_here)

    def others(params):
        return [n for n in params if n not in tables]

    saved_groups, mine_groups = _groups(optimizer, meta, names)
    saved_others = [others(g["params"]) for g in saved_groups if others(g["params"])]
    mine_others = [others(g) for g in mine_groups if others(g)]
    if saved_others != mine_others:
        if meta["optimizer"] is None:
            raise _s.InputError(f"{path} holds no optimizer state (it was saved without an optimizer): load it without one")
        raise _s.InputError(f"{path}: the param groups hold {[g['params'] for g in saved_groups]}, the optimizer's {mine_groups}")
    for key in held_dense:
        if key.startswith("optimizer/"):
            name = key[len("optimizer/"):].rpartition("/")[0]
            if name not in by_name:
                raise _s.InputError(f"{path}: optimizer state {key!r} of a parameter the model does not have")


def _load_optimizer(optimizer, meta, dense, by_name, names, path):
    """Hyperparameters by param group, and the dense optimizer state, put back (after
    `_check_optimizer`). A group whose tables differ from the saved one's keeps the
    hyperparameters it was built with."""
    saved_groups, mine_groups = _groups(optimizer, meta, names)
    for mine, group in zip(mine_groups, optimizer.param_groups):
        saved = next((g for g in saved_groups if g["params"] == mine), None)
        for k, v in (saved or {}).get("hyper", {}).items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    for key, value in dense.items():
        if not key.startswith("optimizer/"):
            continue
        name, _, state_key = key[len("optimizer/"):].rpartition("/")
        p = by_name[name]
        if not _updates(optimizer, p):
            continue  # trained by another optimizer in this plan (a table TorchRec shards)
        st = optimizer.state.setdefault(p, {})
        number = meta.get("scalars", {}).get(f"{name}/{state_key}")
        if number is not None:
            kind = {"bool": bool, "int": int, "float": float}.get(number)
            if kind is None:
                raise _s.InputError(f"{path}: optimizer state {key!r} is of type {number!r} in the metadata, not a number")
            st[state_key] = kind(np.asarray(value).item())
            continue
        src = _as_tensor(value, p.dtype)
        t = st.get(state_key)
        if torch.is_tensor(t) and tuple(t.shape) == tuple(src.shape) and t.dtype == src.dtype:
            with torch.no_grad():
                t.copy_(src)
        else:
            st[state_key] = src.clone()
