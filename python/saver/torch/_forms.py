"""The forms a sharded tensor takes: a ShardedTensor's local shards, a DTensor's local tensor, and
TorchRec's DTensor form (a `LocalShardsWrapper` of any number of shards per rank); each as
chunks at their global offsets."""

from __future__ import annotations


import saver as _s


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
