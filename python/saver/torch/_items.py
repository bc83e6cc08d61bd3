"""What of a model is a row-range table (its embeddings, and the 2-D parameters named), and what a
dense tensor."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

import saver as _s
from saver import _host


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
    for name, p in out.items():
        _host.on_host(p, f"parameter {name!r}", "saver.torch saves CPU tensors (move the model, or copy it, to the CPU)")
    return out
