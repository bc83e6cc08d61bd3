"""A torch optimizer's state and param groups: by parameter name when saved, checked before a load
and put back after it."""

from __future__ import annotations

import json

import numpy as np
import torch

import saver as _s
from saver import _host


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


def _updates(optimizer, p) -> bool:
    """Whether `optimizer` updates parameter `p`."""
    return any(q is p for g in optimizer.param_groups for q in g["params"])


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


def _groups(optimizer, meta, names):
    """The saved param groups and the optimizer's, by parameter name."""
    return meta["param_groups"], [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]


def _check_optimizer_class(optimizer, meta, path):
    """Refuses an optimizer of another class than the one whose state the checkpoint holds."""
    if optimizer is not None and meta["optimizer"] is not None and meta["optimizer"] != type(optimizer).__name__:
        raise _s.InputError(f"{path} holds the state of a {meta['optimizer']}, not of a {type(optimizer).__name__}")


def _check_optimizer(optimizer, meta, held_dense, by_name, names, tables_here, path):
    """What `_load_optimizer` needs of the checkpoint, checked before anything is read: the
    optimizer's class, its param groups, and a parameter for every dense state. A table another
    plan trains by the other optimizer (data-parallel: the dense one; sharded: the fused one)
    is in the param groups of one save and not of the other: groups are matched by their other
    parameters."""
    _check_optimizer_class(optimizer, meta, path)
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
        src = _host.tensor_of(value, p.dtype)
        t = st.get(state_key)
        if torch.is_tensor(t) and tuple(t.shape) == tuple(src.shape) and t.dtype == src.dtype:
            with torch.no_grad():
                t.copy_(src)
        else:
            st[state_key] = _host.copied_beside(src, p)
