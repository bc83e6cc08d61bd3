"""saver behind PyTorch's distributed checkpoint API (DCP): ``dcp.save(state_dict,
storage_writer=saver.dcp.StorageWriter(path))`` and ``dcp.load(state_dict,
storage_reader=saver.dcp.StorageReader(path))`` write and read saver checkpoints, with DCP's
planners unchanged.

What the writer makes is a saver checkpoint like any other (``saver verify``, ``inspect``,
``digest``, ``reshard``, ``export`` and :func:`saver.load` work on it):

- every tensor DCP writes is a row-range table of its fully qualified name (slot ``value``),
  and each chunk DCP hands a rank (a DTensor's or ShardedTensor's local shard, a whole tensor)
  a :class:`saver.Chunk` at its global offset, every block checked by its CRC32s on load. A
  tensor of three or more dimensions is stored as two, its first dimension by the product of
  the others (its chunks must then be cut along the first dimension only, as FSDP's ``Shard(0)``
  cuts them); a 0-d tensor as one value;
- a BYTE_IO item (a scheduler's or data loader's state) is a table of its bytes (slot
  ``bytes``);
- DCP's metadata (each tensor's dtype, global size and chunks, the default planners' flattening
  of nested state dicts) is JSON in the checkpoint's metadata (``dcp``), not a pickle: reading a
  checkpoint never runs code from it;
- every rank's share is one shard of one saver save, under the save id the coordinator draws,
  committed once by saver's own protocol when the last shard is durable, under new names: a
  re-save into the same path replaces the old checkpoint only at that commit, so a crash
  leaves the old one or the new one, never a mixture.

The reader opens the checkpoint once, and reads each of DCP's read items through that opening
(every rank checks the ranks opened the same save), only the rows its item overlaps, straight
into the target where it is a contiguous tensor (CUDA ones through saver's landing), else into
a buffer copied over. A corrupt block fails the load, naming the tensor.

A :class:`saver.Manager` may stand for the path (``StorageWriter(manager, step=1200)``,
``StorageReader(manager)`` for its newest step). Either way round, without saver on the other
side: :func:`import_dcp` turns a checkpoint of DCP's own files into a saver checkpoint, and
:func:`export_hf` writes a saver.dcp checkpoint as the sharded safetensors files that DCP's
stock ``HuggingFaceStorageReader`` loads; from a shell, ``python -m saver.dcp import DCP_DIR
OUT`` and ``python -m saver.dcp export-hf CHECKPOINT OUT``.

The writer is DCP's ``AsyncStager`` too: ``dcp.async_save(..., storage_writer=...)`` copies the
state into host memory kept from the previous background save of the same layout (DCP makes a
new stager and new memory for each call), released once the save's writes end; the process
keeps it until :func:`release_staged_memory`.

``dcp.save(..., use_collectives=False)``: the ranks share no plan, so the caller gives every
rank the same new ``save_id=`` (``StorageWriter(path, save_id=f"{job}-{step}")``), and each
rank writes each of its chunks as a table of its own, with its part of DCP's metadata; saver's
protocol still commits the save once, when the last rank's shard is durable (a rank's
``finish`` cannot know when that is: the checkpoint at the path is the old one until then). A
replicated tensor is then written by every rank that holds it, as DCP's own writer does in
that mode; the reader merges the ranks' metadata, so such a checkpoint loads at any number of
ranks too.

Not yet: the stock ``HuggingFaceStorageReader`` reading a saver checkpoint in place (its files name each tensor by
chunk, where that reader takes every file's names as the state dict's; :func:`export_hf` is the
way there), and ``saver save --from`` a ``.distcp`` directory in the binary (it names such a
directory and points here: ``python -m saver.dcp import``).
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import uuid
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint import StorageReader as _StorageReader
from torch.distributed.checkpoint import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult

import saver as _s
from saver import _host, _staging

#: The checkpoint metadata key that holds DCP's metadata, as JSON.
META_KEY = "dcp"
#: Its layout's version.
META_VERSION = 1
#: The table that holds rank ``r``'s part of DCP's metadata, in a save made without DCP's
#: collectives (``use_collectives=False``): ``RANK_META.format(r)``.
RANK_META = "__saver_dcp_metadata__.r{}"

#: The torch dtypes saver stores, by the names DCP's metadata gives them ("torch.float32").
_DTYPES = {str(t): t for t in _host.torch_dtypes().values()}


def _dtype(name: str, fqn: str):
    if name not in _DTYPES:
        raise _s.InputError(f"{fqn}: dtype {name} is not one saver.dcp stores")
    return _DTYPES[name]


def _stored(size):
    """The (rows, columns) shape a tensor of global ``size`` is stored as (or (rows,))."""
    size = tuple(size)
    if len(size) == 0:
        return (1,)
    if len(size) <= 2:
        return size
    return (size[0], math.prod(size[1:]))


def _stored_chunk(size, offsets, sizes, fqn: str):
    """The stored offset and shape of a DCP chunk ``offsets``/``sizes`` of a tensor of ``size``."""
    size, offsets, sizes = tuple(size), tuple(offsets), tuple(sizes)
    if len(size) == 0:
        return (0,), (1,)
    if len(size) <= 2:
        return offsets, sizes
    if any(o != 0 for o in offsets[1:]) or tuple(sizes[1:]) != size[1:]:
        raise _s.InputError(f"{fqn}: a chunk at {offsets} of {sizes} of a tensor of size {size} is cut along a dimension past the first; saver.dcp stores tensors of 3 or more dimensions cut along the first only (Shard(0))")
    return (offsets[0], 0), (sizes[0], math.prod(size[1:]))


def _meta_json(metadata: Metadata) -> str:
    """DCP's metadata as JSON: tensors, byte items and the planner's flattening."""
    tensors, blobs = {}, []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            blobs.append(fqn)
            continue
        tensors[fqn] = {"dtype": str(md.properties.dtype), "size": list(md.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
    planner_data = metadata.planner_data
    if planner_data is not None:
        # DCP's default planners' flattening: each flat key's path, of names and list indices.
        if not isinstance(planner_data, dict) or not all(
                isinstance(v, (tuple, list)) and all(isinstance(x, (str, int)) for x in v) for v in planner_data.values()):
            raise _s.InputError("saver.dcp stores the planner data of DCP's default planners (a state dict's flattening); this planner's is something else")
        planner_data = {k: list(v) for k, v in planner_data.items()}
    return json.dumps({"version": META_VERSION, "tensors": tensors, "bytes": blobs, "planner_data": planner_data})


def _metadata_of(text: str, path: str) -> Metadata:
    try:
        m = json.loads(text)
    except ValueError:
        raise _s.SaverError(f"{path}: its {META_KEY!r} metadata is not JSON") from None
    if m.get("version") != META_VERSION:
        raise _s.SaverError(f"{path}: saver.dcp metadata of version {m.get('version')}; this saver reads version {META_VERSION}")
    state = {}
    for fqn, t in m["tensors"].items():
        chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in t["chunks"]]
        state[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=_dtype(t["dtype"], fqn)), size=torch.Size(t["size"]), chunks=chunks)
    for fqn in m["bytes"]:
        state[fqn] = BytesStorageMetadata()
    planner_data = m["planner_data"]
    if planner_data is not None:
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    return Metadata(state_dict_metadata=state, planner_data=planner_data)


def _rank_table(fqn: str, rank: int, k: int) -> str:
    """The table of rank ``rank``'s ``k``-th chunk of ``fqn`` in a save made without DCP's
    collectives: names differ between ranks and chunks, since ranks that share no plan may
    hold the same chunk (a replicated tensor) and each writes its own."""
    return f"{fqn}@r{rank}.{k}"


def _merged_rank_metadata(parts, path: str):
    """DCP's metadata of a save made without collectives, from every rank's part (each a
    dict as :func:`_meta_json` writes, with its chunks' tables), and where each chunk and byte
    item is: ``(metadata JSON, {(fqn, offsets): (table, sizes)}, {fqn: table})``. A chunk several ranks
    wrote (a replicated tensor) is read from the lowest rank's table."""
    tensors, blobs, planner_data = {}, [], {}
    chunk_tables, byte_tables = {}, {}
    for part in parts:
        for fqn, t in part["tensors"].items():
            have = tensors.setdefault(fqn, {"dtype": t["dtype"], "size": t["size"], "chunks": []})
            if (have["dtype"], have["size"]) != (t["dtype"], t["size"]):
                raise _s.SaverError(f"{path}: ranks saved {fqn} as {have['dtype']} of {have['size']} and as {t['dtype']} of {t['size']}")
        for fqn, offsets, sizes, table in part["chunk_tables"]:
            key = (fqn, tuple(offsets))
            if key not in chunk_tables:
                chunk_tables[key] = (table, tuple(sizes))
                tensors[fqn]["chunks"].append([offsets, sizes])
        for fqn, table in part["byte_tables"].items():
            if fqn not in byte_tables:
                byte_tables[fqn] = table
                blobs.append(fqn)
        planner_data.update(part.get("planner_data") or {})
    text = json.dumps({"version": META_VERSION, "tensors": tensors, "bytes": blobs, "planner_data": planner_data or None})
    return text, chunk_tables, byte_tables


def _read_metadata(ck, path: str, otherwise: str, parallel: Optional[int] = None):
    """DCP's metadata of the saver.dcp checkpoint ``ck`` opened at ``path``, and, for a save
    made without collectives, where each chunk and byte item is (as
    :func:`_merged_rank_metadata`; else ``None, None``): each chunk is then a table of its own.
    ``otherwise`` says what to do with a checkpoint saver.dcp did not write."""
    text = ck.metadata.get(META_KEY)
    if text is None:
        raise _s.InputError(f"{path}: not a checkpoint saver.dcp wrote (its metadata has no {META_KEY!r}); {otherwise}")
    try:
        world = json.loads(text).get("per_rank")
    except (ValueError, AttributeError):
        world = None  # _metadata_of names what is wrong with it
    chunk_tables = byte_tables = None
    if world is not None:
        if not isinstance(world, int) or world < 1:
            raise _s.SaverError(f"{path}: its {META_KEY!r} metadata names {world!r} ranks")
        names = [RANK_META.format(r) for r in range(world)]
        got = ck.load(tables=names, dense=False, parallel=parallel).tables
        parts = []
        for n in names:
            try:
                parts.append(json.loads(got[n]["bytes"].tobytes()))
            except ValueError:
                raise _s.SaverError(f"{path}: table {n} is not JSON") from None
        text, chunk_tables, byte_tables = _merged_rank_metadata(parts, path)
    return _metadata_of(text, path), chunk_tables, byte_tables


def _tensors(value):
    """Every tensor in a nested state dict."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif torch.is_tensor(value):
        yield value


def _done(value):
    """A torch future already done with ``value`` (what DCP waits on)."""
    f = torch.futures.Future()
    f.set_result(value)
    return f


def _layout(value) -> tuple:
    """What a staged copy of ``value`` must match to be reused: its nesting, and each tensor's
    kind, local shape, dtype and device (a DTensor's or ShardedTensor's local part)."""
    if isinstance(value, dict):
        return ("dict", tuple((k, _layout(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_layout(v) for v in value))
    if torch.is_tensor(value):
        local = getattr(value, "_local_tensor", None)
        if local is not None:
            return ("dtensor", tuple(local.shape), str(local.dtype), _host.on_cuda(local), str(value.placements))
        shards = getattr(value, "local_shards", None)
        if callable(shards):
            return ("sharded", tuple((tuple(x.tensor.shape), str(x.tensor.dtype)) for x in shards()))
        return ("tensor", tuple(value.shape), str(value.dtype), _host.on_cuda(value))
    return ("object", type(value).__name__)


#: Host copies of state dicts that background saves staged into, by layout, kept for the next
#: ``dcp.async_save`` of the same layout: its copy then lands in memory already mapped (memory
#: speed) rather than in fresh pages (page-fault speed), where DCP makes a new stager, and new
#: memory, for each call. A copy is taken by one save from its staging to the end of its
#: writes; a save that finds none free makes its own.
_kept_copies = _staging.Kept()


def staged_memory() -> int:
    """Bytes of host memory kept for the next ``dcp.async_save`` through saver's stager."""
    return sum(t.numel() * t.element_size() for copy in _kept_copies.values() for t in _tensors(copy))


def release_staged_memory() -> None:
    """Frees the host copies kept for the next ``dcp.async_save`` (a save running now keeps
    its own until it ends)."""
    _kept_copies.clear()


class StorageWriter(_StorageWriter, AsyncStager):
    """DCP's ``StorageWriter`` writing a saver checkpoint at ``path``: give it to
    ``dcp.save(state_dict, storage_writer=saver.dcp.StorageWriter(path))`` (and
    ``checkpoint_id=`` may name the path instead). ``overwrite`` (default True, as DCP's
    ``FileSystemWriter``): a committed checkpoint at ``path`` is replaced, at the new one's
    commit. ``path`` may be a :class:`saver.Manager` instead, with ``step=``: the save is that
    step of the manager's root (a delta by its policy, retention applied). ``durable`` and other
    keyword options as :func:`saver.save`.

    ``save_id``: the save's id, new for every save; drawn by the coordinator when not given.
    ``dcp.save(..., use_collectives=False)`` needs it, the same on every rank (the ranks share
    no plan to agree on one), and then ``world_size`` unless ``torch.distributed`` is
    initialized."""

    def __init__(self, path: Union[str, os.PathLike, "_s.Manager", None] = None, *, step: Optional[int] = None,
                 overwrite: bool = True, save_id: Optional[str] = None, world_size: Optional[int] = None,
                 **options: Any):
        super().__init__()
        self.manager = path if isinstance(path, _s.Manager) else None
        if self.manager is not None and step is None:
            raise _s.InputError("step: a Manager saves steps; give saver.dcp.StorageWriter(manager, step=...)")
        if self.manager is None and step is not None:
            raise _s.InputError("step: give a saver.Manager to save a step (a path is one checkpoint)")
        self.step = step
        self.path = None if path is None or self.manager is not None else os.fspath(path)
        self.overwrite = overwrite
        self.options = options
        self._staged = None
        self.save_id, self.world_size = save_id, world_size
        self.rank, self.world, self.coordinator, self.collectives = 0, 1, True, True
        #: The report of this rank's save, once written.
        self.report: Optional[_s.SaveReport] = None

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.report = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.coordinator = is_coordinator
        self.collectives = kwargs.get("use_collectives", True) is not False
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        if initialized:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.rank = kwargs.get("rank", self.rank)
        if self.path is None and self.manager is None:
            raise _s.InputError("saver.dcp.StorageWriter: give a path (or dcp.save's checkpoint_id)")
        if not self.collectives:
            if self.save_id is None:
                raise _s.InputError("save_id: dcp.save(..., use_collectives=False) shares no plan between the ranks, so give "
                                    "saver.dcp.StorageWriter(..., save_id=...) the same id on every rank, new for every save")
            if self.world_size is not None:
                if initialized and self.world_size != self.world:
                    raise _s.InputError(f"world_size: {self.world_size}, but torch.distributed runs {self.world} ranks")
                self.world = self.world_size
            elif not initialized and self.rank:
                raise _s.InputError("world_size: without torch.distributed, give saver.dcp.StorageWriter(..., world_size=...) "
                                    "the number of ranks that save")

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path if self.manager is None else f"{self.manager.root} step {self.step}")

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        """The coordinator's: draws the save id and DCP's metadata of the whole save (as DCP's
        default planner makes it), given to every rank in its plan, so that every shard of
        the save records the same."""
        from dataclasses import replace

        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        _, metadata = create_default_global_save_plan([replace(p) for p in plans], rewrite_index_hints=False)
        merged = {}
        for p in plans:
            if isinstance(p.planner_data, dict):
                merged.update(p.planner_data)
        metadata = replace(metadata, planner_data=merged or None)
        save_id = self.save_id or f"dcp-{uuid.uuid4().hex[:16]}"
        if not self.collectives:
            # Called by each rank on its own plan alone: the metadata is this rank's part.
            shared = {"save_id": save_id, "meta": _meta_json(metadata), "world": self.world, "per_rank": True}
        else:
            shared = {"save_id": save_id, "meta": _meta_json(metadata), "world": len(plans)}
        return [replace(p, storage_data=shared) for p in plans]

    def write_data(self, plan, planner):
        shared = plan.storage_data
        if not isinstance(shared, dict) or "save_id" not in shared:
            raise _s.InputError("saver.dcp.StorageWriter: the plan carries no save id (was prepare_global_plan skipped?)")
        per_rank = shared.get("per_rank", False)
        tables, results = {}, []
        # Without collectives: each chunk a table of its own, and where each went.
        chunk_tables, byte_tables, counts = [], {}, {}
        for item in plan.items:
            fqn = item.index.fqn
            table = fqn
            if per_rank:
                k = counts[fqn] = counts.get(fqn, -1) + 1
                table = _rank_table(fqn, self.rank, k)
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                # One byte more than the item's: an empty item is still a table of one row.
                values = torch.frombuffer(bytearray(raw + b"\0"), dtype=torch.uint8)
                tables.setdefault(table, {}).setdefault("bytes", []).append(_s.Chunk(values))
                byte_tables[fqn] = table
                results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=None))
                continue
            td = item.tensor_data
            t = planner.resolve_data(item).detach()
            if per_rank:
                # The chunk is the whole table, so it may be cut along any dimension.
                shape = _stored(td.chunk.sizes)
                chunk = _s.Chunk(t.reshape(shape), offset=(0,) * len(shape))
                chunk_tables.append([fqn, list(td.chunk.offsets), list(td.chunk.sizes), table])
            else:
                offset, shape = _stored_chunk(td.size, td.chunk.offsets, td.chunk.sizes, fqn)
                values = t.reshape(shape) if t.dim() != len(shape) or tuple(t.shape) != tuple(shape) else t
                chunk = _s.Chunk(values, offset=offset, shape=_stored(td.size))
            tables.setdefault(table, {}).setdefault("value", []).append(chunk)
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(), storage_data=None))
        options = dict(self.options)
        if shared["world"] > 1:
            options.update(shards=shared["world"], shard_index=self.rank)
        if per_rank:
            part = dict(json.loads(shared["meta"]), rank=self.rank, chunk_tables=chunk_tables, byte_tables=byte_tables)
            raw = json.dumps(part).encode()
            tables[RANK_META.format(self.rank)] = {"bytes": [_s.Chunk(torch.frombuffer(bytearray(raw), dtype=torch.uint8))]}
            # What every shard records alike: the metadata is in the ranks' tables.
            metadata = {META_KEY: json.dumps({"version": META_VERSION, "per_rank": shared["world"]})}
        else:
            metadata = {META_KEY: shared["meta"]}
        try:
            if self.manager is not None:
                self.report = self.manager.save(self.step, tables=tables, save_id=shared["save_id"], metadata=metadata, **options)
            else:
                self.report = _s.save(self.path, tables=tables, save_id=shared["save_id"], metadata=metadata, overwrite=self.overwrite, **options)
        finally:
            # The staged copy's bytes are written (or the save failed): the next background
            # save may copy into it.
            self._release()
        self._save_id = shared["save_id"]
        return _done(results)

    # DCP's AsyncStager: `dcp.async_save(..., storage_writer=saver.dcp.StorageWriter(path))`
    # stages through the writer.
    _synchronize_after_execute = True

    def stage(self, state_dict):
        """The state dict copied to host memory (pinned where it holds CUDA tensors), into a
        copy kept from an earlier background save of the same layout where one is free: what
        ``dcp.async_save`` writes while training goes on."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        copy = _kept_copies.take(layout)
        if copy is None:
            copy = _create_cpu_state_dict(state_dict, pin_memory=_host.pin_host_copies(_tensors(state_dict)))
        staged = _copy_state_dict(state_dict, copy)
        self._staged = (layout, copy)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        """Gives back a staged copy no write used (a save that failed before its writes)."""
        self._release()

    def _release(self) -> None:
        if self._staged is not None:
            _kept_copies.give(*self._staged)
            self._staged = None

    def finish(self, metadata: Metadata, results) -> None:
        """The coordinator's, once every rank has written: the save must be the checkpoint at
        the path now (saver committed it when its last shard was durable). Without DCP's
        collectives every rank calls it after its own writes alone, while others may still
        write: nothing to check then."""
        if not self.collectives:
            return
        if self.manager is not None:
            held = [s for s in self.manager.steps() if s["step"] == self.step]
            if not held or held[-1]["save_id"] != self._save_id:
                raise _s.SaverError(f"{self.manager.root}: step {self.step} is not this save {self._save_id} once every rank wrote (another save replaced it, or its chain is not whole)")
            return
        ck = _s.open(self.path)
        if ck.save_id != self._save_id:
            raise _s.SaverError(f"{self.path}: holds save {ck.save_id}, not this save {self._save_id} (another save replaced it)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _step_path(path, step: Optional[int], verb: str):
    """The checkpoint a reader of ``path`` reads: ``path`` itself, or a :class:`saver.Manager`'s
    newest committed step (``step=`` for another)."""
    if isinstance(path, _s.Manager):
        steps = path.steps()
        chosen = [s for s in steps if step is None or s["step"] == step]
        if not chosen:
            raise _s.InputError(f"{path.root} holds no committed step{'' if step is None else f' {step}'} (it holds {[s['step'] for s in steps]})")
        return chosen[-1]["path"]
    if step is not None:
        raise _s.InputError(f"step: give a saver.Manager to {verb} a step (a path is one checkpoint)")
    return path


class StorageReader(_StorageReader):
    """DCP's ``StorageReader`` reading a saver checkpoint written by :class:`StorageWriter`:
    ``dcp.load(state_dict, storage_reader=saver.dcp.StorageReader(path))``, at any number of
    ranks, whatever number saved it. ``path`` may be a :class:`saver.Manager`: its newest
    committed step, or ``step=``."""

    def __init__(self, path: Union[str, os.PathLike, "_s.Manager", None] = None, *, step: Optional[int] = None,
                 parallel: Optional[int] = None):
        super().__init__()
        path = _step_path(path, step, "load")
        self.path = None if path is None else os.fspath(path)
        self.parallel = parallel
        self._ck = None
        self.report: Optional[dict] = None

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._ck = None

    def _opened(self):
        if self._ck is None:
            if self.path is None:
                raise _s.InputError("saver.dcp.StorageReader: give a path (or dcp.load's checkpoint_id)")
            self._ck = _s.open(self.path)
        return self._ck

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata, self._chunk_tables, self._byte_tables = _read_metadata(self._opened(), self.path, "load it with saver.load", self.parallel)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        """Every rank's plan carries the save the coordinator opened: a rank that opened
        another (the path replaced between their openings) refuses to read."""
        from dataclasses import replace

        save_id = self._opened().save_id
        return [replace(p, storage_data={"save_id": save_id}) for p in plans]

    def read_data(self, plan, planner):
        ck = self._opened()
        want = (plan.storage_data or {}).get("save_id")
        if want is not None and want != ck.save_id:
            raise _s.SaverError(f"{self.path} was replaced between the ranks' openings (this rank opened save {ck.save_id}, the coordinator {want}); load again")
        size_of = {fqn: tuple(md.size) for fqn, md in self._metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
        chunk_tables = getattr(self, "_chunk_tables", None)
        byte_table = (lambda fqn: fqn) if chunk_tables is None else self._byte_tables.__getitem__
        into, after, blobs, targets = {}, [], [], []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                blobs.append(item)
                continue
            if chunk_tables is None:
                table, size = fqn, size_of[fqn]
                start = [a + b for a, b in zip(item.storage_index.offset, item.storage_offsets)]
            else:
                # The stored chunk is a table of its own: the item's place is in the chunk.
                table, size = chunk_tables[(fqn, tuple(item.storage_index.offset))]
                start = list(item.storage_offsets)
            # The item's part of the target, already narrowed by DCP's planner.
            dest = planner.resolve_tensor(item).detach()
            targets.append((item, dest))
            slot = into.setdefault(table, {}).setdefault("value", [])
            if len(size) == 0:
                buf = _host.empty_beside(dest, (1,), dest.dtype)
                slot.append(_s.Chunk(buf, offset=(0,)))
                after.append((dest, buf.reshape(())))
            elif len(size) <= 2 and dest.is_contiguous():
                slot.append(_s.Chunk(dest, offset=tuple(start)))
            elif len(size) <= 2:
                buf = _host.empty_beside(dest, tuple(item.lengths), dest.dtype)
                slot.append(_s.Chunk(buf, offset=tuple(start)))
                after.append((dest, buf))
            else:
                # Whole stored rows (each a slab of the trailing dimensions), the item's part
                # of them copied over.
                rows = item.lengths[0]
                buf = _host.empty_beside(dest, (rows, math.prod(size[1:])), dest.dtype)
                slot.append(_s.Chunk(buf, offset=(start[0], 0)))
                part = buf.view((rows, *size[1:]))
                for d in range(1, len(size)):
                    part = part.narrow(d, start[d], item.lengths[d])
                after.append((dest, part))
        tables = sorted(set(into) | {byte_table(b.storage_index.fqn) for b in blobs})
        if not tables:
            return _done(None)
        loaded = ck.load(into=into, tables=tables, dense=False, parallel=self.parallel)
        self.report = loaded.report
        with torch.no_grad():
            for dest, buf in after:
                dest.copy_(buf)
        for item in blobs:
            raw = loaded.tables[byte_table(item.storage_index.fqn)]["bytes"]
            planner.load_bytes(item, io.BytesIO(raw[:-1].tobytes()))
        for item, dest in targets:
            planner.commit_tensor(item, dest)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def import_dcp(source: Union[str, os.PathLike], path: Union[str, os.PathLike, "_s.Manager"], *,
               step: Optional[int] = None, **options: Any) -> Optional[_s.SaveReport]:
    """Reads the checkpoint of DCP's own files at ``source`` (``FileSystemWriter``'s) whole, in
    this process, and saves it through :class:`StorageWriter` at ``path`` (a path, or a
    :class:`saver.Manager` with ``step``): every tensor and BYTE_IO item, under the same names,
    loadable with :class:`StorageReader` into any sharding. The whole state is held in memory
    once while it is copied."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(os.fspath(source)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    writer = StorageWriter(path, step=step, **options)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer.report


#: safetensors' dtype names (saver's are the same), by torch dtype name: what a header says.
_SAFETENSORS_DTYPES = {str(t): name for name, t in _host.torch_dtypes().items()}


def _pieces(fqn: str, md: TensorStorageMetadata, piece_bytes: int):
    """The (offsets, sizes, chunk's offsets) pieces of ``fqn``'s chunks, each cut along its first
    dimension into parts of at most ``piece_bytes`` (at least one row)."""
    width = md.properties.dtype.itemsize
    for c in md.chunks:
        offsets, sizes = list(c.offsets), list(c.sizes)
        if not sizes:
            yield offsets, sizes, offsets
            continue
        row = math.prod(sizes[1:]) * width
        step = max(1, piece_bytes // max(1, row))
        for start in range(0, max(1, sizes[0]), step):
            yield [offsets[0] + start, *offsets[1:]], [min(step, sizes[0] - start), *sizes[1:]], offsets


def export_hf(source: Union[str, os.PathLike, "_s.Manager"], out: Union[str, os.PathLike], *,
              step: Optional[int] = None, piece_bytes: int = 64 << 20) -> dict:
    """Writes the checkpoint at ``source`` that :class:`StorageWriter` saved (a path, or a
    :class:`saver.Manager`: its newest step, or ``step=``) into the new directory ``out`` as
    sharded safetensors files that PyTorch's own
    ``torch.distributed.checkpoint.HuggingFaceStorageReader(out)`` loads with ``dcp.load``
    into any sharding, with no saver installed: every tensor under its fully qualified name in
    its own dimensions, each of DCP's chunks cut along its first dimension into pieces of at
    most ``piece_bytes``, each file holding at most one piece of a tensor and naming their
    global offsets in its ``DCP_SHARDING_INFO``. BYTE_IO items have no place in that layout and
    are left out (the returned ``skipped`` names them).

    The checkpoint is opened once and each piece read through that opening, checked against
    its CRC32s, one piece at a time (memory: about ``piece_bytes``). The files are written
    under a temporary name beside ``out``, made durable, then renamed to ``out`` whole: a
    crash leaves no partial ``out``. ``out`` must not exist or be an empty directory.

    Returns ``{"files", "tensors", "bytes", "skipped"}``."""
    import shutil

    from saver._host import readable

    source = _step_path(source, step, "export")
    if not isinstance(piece_bytes, int) or piece_bytes <= 0:
        raise _s.InputError(f"piece_bytes: a positive number of bytes, got {piece_bytes!r}")
    source, out = os.fspath(source), os.fspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise _s.InputError(f"{out}: exists and is not an empty directory (export_hf writes a new one: DCP's reader takes every .safetensors file there)")
    ck = _s.open(source)
    meta, chunk_tables, _ = _read_metadata(ck, source, "export it with `saver export`")
    files: list = []  # file k: {fqn: (offsets, sizes, chunk offsets)}, the k-th piece of each tensor
    skipped = []
    for fqn, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            skipped.append(fqn)
            continue
        for k, piece in enumerate(_pieces(fqn, md, piece_bytes)):
            if k == len(files):
                files.append({})
            files[k][fqn] = piece
    parent = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    written = 0
    try:
        for k, pieces in enumerate(files):
            header, at = {}, 0
            for fqn, (offsets, sizes, _) in pieces.items():
                md = meta.state_dict_metadata[fqn]
                n = math.prod(sizes) * md.properties.dtype.itemsize
                header[fqn] = {"dtype": _SAFETENSORS_DTYPES[str(md.properties.dtype)], "shape": sizes, "data_offsets": [at, at + n]}
                at += n
            header["__metadata__"] = {"format": "pt", "DCP_SHARDING_INFO": json.dumps({f: {"saved_offsets": p[0]} for f, p in pieces.items()})}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            name = os.path.join(tmp, f"model-{k + 1:05}-of-{len(files):05}.safetensors")
            with open(name, "wb") as f:
                f.write(len(raw).to_bytes(8, "little"))
                f.write(raw)
                for fqn, (offsets, sizes, chunk) in pieces.items():
                    md = meta.state_dict_metadata[fqn]
                    if chunk_tables is None:
                        table = fqn
                        stored_offset, stored_shape = _stored_chunk(tuple(md.size), offsets, sizes, fqn)
                    else:
                        # The chunk is a table of its own; the piece is rows of it.
                        table, _ = chunk_tables[(fqn, tuple(chunk))]
                        stored_shape = _stored(sizes)
                        stored_offset = (offsets[0] - chunk[0], *[0] * (len(stored_shape) - 1)) if sizes else (0,)
                    buf = torch.empty(stored_shape, dtype=md.properties.dtype)
                    if buf.numel() == 0:
                        continue  # an empty chunk (an uneven cut's last rank): its place alone
                    ck.load(into={table: {"value": _s.Chunk(buf, offset=stored_offset)}}, tables=[table], dense=False)
                    f.write(memoryview(readable(buf, fqn)).cast("B"))
                    written += buf.numel() * buf.element_size()
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.isdir(out):
            os.rmdir(out)  # empty, as checked: the rename takes its place
        os.rename(tmp, out)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"files": len(files), "tensors": sum(1 for md in meta.state_dict_metadata.values() if not isinstance(md, BytesStorageMetadata)),
            "bytes": written, "skipped": skipped}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _main(argv=None) -> int:
    """``python -m saver.dcp import DCP_DIR OUT`` and ``python -m saver.dcp export-hf CHECKPOINT
    OUT``: the two ways across, from a shell."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m saver.dcp", description="Move checkpoints between DCP's layouts and saver's.")
    sub = ap.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a checkpoint of DCP's own files (.metadata, *.distcp) into a saver checkpoint")
    imp.add_argument("source")
    imp.add_argument("out")
    exp = sub.add_parser("export-hf", help="a saver.dcp checkpoint as the files DCP's HuggingFaceStorageReader loads")
    exp.add_argument("source")
    exp.add_argument("out")
    exp.add_argument("--piece-bytes", type=int, default=64 << 20)
    args = ap.parse_args(argv)
    try:
        if args.command == "import":
            report = import_dcp(args.source, args.out)
            print(f"{args.out}: saved {report.bytes_written} bytes from {args.source}")
        else:
            done = export_hf(args.source, args.out, piece_bytes=args.piece_bytes)
            skipped = f"; left out (not tensors): {', '.join(done['skipped'])}" if done["skipped"] else ""
            print(f"{args.out}: {done['tensors']} tensors, {done['bytes']} bytes in {done['files']} files{skipped}")
    except _s.SaverError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
