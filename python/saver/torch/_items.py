"""A model's state as items: named pieces, each a part of a row-range table's slot (at its offset
of the slot's whole shape) or a dense tensor, with the memory a save reads or a load fills. A
save collects its items and hands them to saver as tables and dense tensors; a load's request is
its items. What of a model is a row-range table (its embeddings, and the 2-D parameters named)
and what a dense tensor is decided here too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

import saver as _s


_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


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
    return out


#: An item's kinds: rows of a row-range table's slot, or a dense tensor.
TABLE, DENSE = "table", "dense"


@dataclass(frozen=True)
class Item:
    """One named piece of a model's state. ``kind`` TABLE: rows of slot ``slot`` of row-range
    table ``name``, at ``offset`` of the slot's whole ``shape``; DENSE: dense tensor ``name``,
    whole. ``tensor`` is its memory (host memory, as the host seam gives it): what a save
    reads, what a load fills."""

    kind: str
    name: str
    tensor: Any
    slot: Optional[str] = None
    offset: tuple = ()
    shape: tuple = ()


def table_item(name: str, slot: str, tensor, offset, shape) -> Item:
    """Rows of a row-range table's slot at `offset` of its whole `shape`."""
    return Item(TABLE, name, tensor, slot, tuple(offset), tuple(shape))


def dense_item(name: str, tensor) -> Item:
    return Item(DENSE, name, tensor, None, (0,) * tensor.dim(), tuple(tensor.shape))


def chunk_items(name: str, slots: dict, wholes: Optional[dict] = None) -> list:
    """The items of a table given as {slot: chunk or [chunks]} (`saver.Chunk`s, offsets and
    whole shapes set, or the chunk the whole slot); `wholes`, {slot: shape}, gives the whole
    shapes of chunks that do not say theirs (a load's targets)."""
    out = []
    for slot, given in slots.items():
        for c in given if isinstance(given, (list, tuple)) else [given]:
            offset = c.offset if c.offset is not None else (0,) * c.values.dim()
            shape = c.shape if c.shape is not None else (wholes or {}).get(slot)
            if shape is None:
                shape = tuple(o + d for o, d in zip(offset, c.values.shape))
            out.append(table_item(name, slot, c.values, offset, shape))
    return out


def save_arguments(items: list) -> tuple:
    """`saver.save`'s ``tables`` and ``dense`` of `items`: ({table: {slot: [Chunk]}},
    {name: tensor}), in the items' order."""
    tables, dense = {}, {}
    for it in items:
        if it.kind == DENSE:
            dense[it.name] = it.tensor
        else:
            tables.setdefault(it.name, {}).setdefault(it.slot, []).append(_s.Chunk(it.tensor, offset=it.offset, shape=it.shape))
    return tables, dense


def load_request(items: list) -> dict:
    """`saver.load`'s ``into`` of the TABLE `items`: {table: {slot: [Chunk]}}."""
    into = {}
    for it in items:
        if it.kind == TABLE:
            into.setdefault(it.name, {}).setdefault(it.slot, []).append(_s.Chunk(it.tensor, offset=it.offset))
    return into
