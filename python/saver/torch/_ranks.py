"""The ranks' agreement under torch.distributed: the save id, the outcome of every rank's share of a
save (a dead rank learnt of within a tick), the checkpoint every rank opened."""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager

import saver as _s

#: The process group saver's own agreement runs on (`process_group=`; None: the default group).
_GROUP = contextvars.ContextVar("saver_process_group", default=None)


@contextmanager
def on_group(group):
    """Runs the body's agreement between ranks on `group` (a gloo group beside NCCL, so that it
    never needs device memory); None keeps the default group."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def _group():
    return _GROUP.get()


def _world():
    """(rank, world size) under an initialized torch.distributed of more than one rank (in the
    group given), else (0, 1)."""
    import torch.distributed as dist

    group = _group()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _gathered(value):
    """Every rank's `value`, in rank order, on every rank."""
    import torch.distributed as dist

    seen = [None] * _world()[1]
    dist.all_gather_object(seen, value, group=_group())
    return seen


def _agreed(value):
    """Rank 0's `value`, on every rank."""
    import torch.distributed as dist

    group = _group()
    box = [value]
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return box[0]


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
        try:
            seen = _gathered(mine)
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
        self._group = _group()

    def done(self) -> bool:
        """Whether **this rank's** share has ended: another rank's may end a step earlier or
        later, so a trainer that branches on it can split its ranks' collectives; branch on
        :meth:`wait`, which the ranks agree on."""
        return self._handle.done()

    def wait(self):
        """Waits for every rank's share, agreed through the process group: this rank's report,
        or, on every rank, the error of any rank that failed or died."""
        with on_group(self._group):
            return _agree(self._handle.wait, self._rank, self._world)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _same_checkpoint(ck, path):
    """Under torch.distributed, fails on every rank unless every rank opened the same save (a
    rank given another path, or a path replaced between the ranks' opens, would load another
    step silently)."""
    rank, world = _world()
    if world == 1:
        return
    seen = _gathered((ck.save_id, os.fspath(path)))
    if len({s for s, _ in seen}) > 1:
        raise _s.InputError("the ranks opened different checkpoints: " + ", ".join(f"rank {r} {p} (save {s})" for r, (s, p) in enumerate(seen)))
