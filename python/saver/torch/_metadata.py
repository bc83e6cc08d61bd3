"""What saver.torch stores beside the tensors: its metadata, checked when read (a load trusts no
checkpoint's metadata)."""

from __future__ import annotations

import json
import os

import torch

import saver as _s


#: Metadata key of what this module stores beside the tensors.
META_KEY = "saver.torch"


#: Version of that metadata.
META_VERSION = 1


#: What each entry of the metadata must be: a load trusts no checkpoint's metadata.
_META_TYPES = {
    "version": int, "optimizer": (str, type(None)), "param_groups": list, "fused_param_groups": (list, type(None)),
    "tables": list, "sharded": list, "rowwise": dict, "scalars": dict, "step": (int, type(None)),
}


def _meta(path) -> dict:
    """The checkpoint at `path` opened (or `path` itself, an opened `saver.Checkpoint`) and its
    saver.torch metadata, checked: (metadata, checkpoint)."""
    ck = path if isinstance(path, _s.Checkpoint) else _s.Checkpoint(path)
    path = ck.path
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


def _jsonable(value):
    """`value` with what JSON cannot hold (tensors, tuples) turned into what it can."""
    if value is None:
        return None
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if torch.is_tensor(v) else str(v)))
