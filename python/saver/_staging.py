"""The host seam's staging ring: how a tensor in device memory reaches the native writers.

A save does not copy a device tensor to the host whole. The tensor is handed to the native
module as a :class:`StagedTensor`, a source of bytes that the save's writer threads read a
writer's chunk at a time (``read_into``), as they write. Each read takes a buffer of the
process's :class:`Ring` (host memory allocated once and reused, pinned on CUDA; bounded: by
default the smaller of 256 MiB and 1/8 of the staged state), copies the range into it on a
stream of the ring's own with an event per chunk, waits for that event alone, and hands the bytes
to the writer, which checksums and writes them while other writers' chunks copy. A writer that
finds every buffer in use waits for one (without the GIL). The Rust crates link no CUDA: torch
owns device memory, streams and events.

The copies of a save run after the work already queued on the caller's current stream (the
ring's stream waits on it once per save), so a save started right after a training step saves
that step's values.

A load fills device tensors in rounds through two host buffers (pinned on CUDA), bounded as
the ring is (:class:`Landing`): each round is read and checked against the chunks' CRC32s into
one buffer, then copied to the device while the next round reads into the other. A load refused
by its checks (shapes, dtypes, slots) leaves the device tensors as they were, as it leaves host
buffers.

Without a GPU the same code runs with a CPU stand-in (``SAVER_STAND_IN_DEVICE=1``): CPU torch
tensors are then taken as device tensors, and their copies run on a worker thread of their own
into the ring's (pageable) buffers, each waited for by its future as a CUDA copy is by its
event. The tests run the package's saves through it."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any, Optional

from ._errors import InputError

#: The largest ring a save makes unless told (``staging_bytes``).
DEFAULT_RING_BYTES = 256 << 20
#: A buffer of the ring: a writer's chunk (the plan's default ``chunk_bytes``), so that one
#: read of a writer is one copy.
SLOT_BYTES = 8 << 20
#: The smallest buffer, for small states: below it a copy's fixed cost dominates.
MIN_SLOT_BYTES = 64 << 10


def stand_in() -> bool:
    """Whether CPU tensors are staged as device tensors (the CPU stand-in of the tests)."""
    return os.environ.get("SAVER_STAND_IN_DEVICE", "") not in ("", "0")


def is_staged(tensor: Any) -> bool:
    """Whether a save stages ``tensor`` through the ring rather than reading it in place."""
    device = getattr(tensor, "device", None)
    if device is None or not hasattr(tensor, "untyped_storage"):
        return False
    return device.type != "cpu" or stand_in()


def check_storage(tensor: Any, what: str) -> None:
    """Refuses a tensor whose storage is gone: TorchRec frees a table's device storage during
    a step (memory stashing), and a freed tensor read would save zeros or garbage."""
    if tensor.numel() == 0:
        return
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0 or tensor.data_ptr() == 0:
        raise InputError(f"{what}: its storage on {tensor.device} is freed or resized to 0 bytes (a table TorchRec stashed?); nothing was saved from it")
    needed = (tensor.storage_offset() + 1) * tensor.element_size()
    if storage.nbytes() < needed:
        raise InputError(f"{what}: its storage on {tensor.device} holds {storage.nbytes()} bytes, too few for the tensor; it was resized")


class _CudaCopies:
    """Device-to-host copies on a CUDA stream of their own, an event per chunk."""

    def __init__(self, device):
        import torch

        self._torch = torch
        self.stream = torch.cuda.Stream(device=device)
        # The save's moment: its copies come after the caller's queued work.
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def start(self, dst, src):
        torch = self._torch
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    @staticmethod
    def finish(event) -> None:
        event.synchronize()

    def room(self, device, nbytes: int) -> bool:
        """Whether the device has room for a copy of ``nbytes`` (and a tenth more)."""
        free, _ = self._torch.cuda.mem_get_info(device)
        return free >= nbytes + nbytes // 10

    def snapshot(self, tensors):
        """Device copies of ``tensors`` on the ring's stream, after the caller's queued work; the
        caller's stream then waits for them, so that its next writes come after the copies
        without the host waiting."""
        torch = self._torch
        with torch.cuda.stream(self.stream):
            copies = [t.clone() for t in tensors]
            done = torch.cuda.Event()
            done.record(self.stream)
        torch.cuda.current_stream(self.stream.device).wait_event(done)
        return copies


class _StandInCopies:
    """The CPU stand-in of :class:`_CudaCopies`: each copy runs on a worker thread of its own
    and is waited for by its future, as a CUDA copy is by its event. Each copy takes
    ``SAVER_STAND_IN_DEVICE_LATENCY`` seconds more (default 0), as a transfer over a bus would,
    so that the ring's overlap and backpressure can be seen on a CPU."""

    _pool = None
    _lock = threading.Lock()

    def __init__(self, device):
        with _StandInCopies._lock:
            if _StandInCopies._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                _StandInCopies._pool = ThreadPoolExecutor(1, thread_name_prefix="saver-stand-in-copy")

    def start(self, dst, src):
        latency = float(os.environ.get("SAVER_STAND_IN_DEVICE_LATENCY", "0") or 0)

        def transfer():
            if latency:
                time.sleep(latency)
            dst.copy_(src)

        return self._pool.submit(transfer)

    @staticmethod
    def finish(future) -> None:
        future.result()

    @staticmethod
    def room(device, nbytes: int) -> bool:
        # The stand-in's device memory: SAVER_STAND_IN_DEVICE_FREE bytes (unbounded if unset).
        free = os.environ.get("SAVER_STAND_IN_DEVICE_FREE")
        return free is None or int(free) >= nbytes + nbytes // 10

    @staticmethod
    def snapshot(tensors):
        return [t.clone() for t in tensors]


def _copies_for(device):
    return _StandInCopies(device) if device.type == "cpu" else _CudaCopies(device)


class Ring:
    """Host buffers a save's reads of device tensors copy through: ``slots`` buffers of
    ``slot_bytes``, allocated when first needed, kept for the next save of the same size."""

    def __init__(self, capacity: int, slot_bytes: int, pinned: bool):
        self.slot_bytes = slot_bytes
        self.slots = max(1, capacity // slot_bytes)
        self.pinned = pinned
        self._free = []
        self._made = 0
        self._cond = threading.Condition()
        #: Bytes copied through the ring, and the most buffers in use at once, since made.
        self.bytes_copied = 0
        self.most_in_use = 0
        self._in_use = 0

    @property
    def capacity(self) -> int:
        """The ring's host memory once every buffer is made."""
        return self.slots * self.slot_bytes

    @property
    def allocated(self) -> int:
        """The host memory its buffers hold now."""
        return self._made * self.slot_bytes

    def _take(self):
        with self._cond:
            while not self._free and self._made >= self.slots:
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
            else:
                import torch

                buf = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pinned)
                self._made += 1
            self._in_use += 1
            self.most_in_use = max(self.most_in_use, self._in_use)
            return buf

    def _give(self, buf) -> None:
        with self._cond:
            self._free.append(buf)
            self._in_use -= 1
            self._cond.notify()

    def copy(self, copies, flat, offset: int, address: int, length: int, check) -> None:
        """Copies bytes ``offset .. offset + length`` of ``flat`` (a device tensor's bytes) to
        host memory at ``address``, a buffer at a time."""
        done = 0
        while done < length:
            n = min(self.slot_bytes, length - done)
            buf = self._take()
            try:
                check()
                handle = copies.start(buf[:n], flat[offset + done : offset + done + n])
                copies.finish(handle)
                # Freed while it copied: what landed may be anything.
                check()
                ctypes.memmove(address + done, buf.data_ptr(), n)
            finally:
                self._give(buf)
            done += n
        with self._cond:
            self.bytes_copied += length


_ring: Optional[Ring] = None
_ring_lock = threading.Lock()


def ring_for(staged_bytes: int, staging_bytes: Optional[int]) -> Ring:
    """The process's ring for a save staging ``staged_bytes``: ``staging_bytes`` of buffers if
    given, else the smaller of :data:`DEFAULT_RING_BYTES` and 1/8 of the staged bytes. Reused
    while the size asked for is the same, so that pinned memory is allocated once."""
    global _ring
    if staging_bytes is not None:
        capacity = staging_bytes
    else:
        capacity = max(MIN_SLOT_BYTES, min(DEFAULT_RING_BYTES, staged_bytes // 8))
    # Two buffers at least where the bound allows, so that one copies while one is read out.
    slot = max(MIN_SLOT_BYTES, min(SLOT_BYTES, capacity // 2))
    pinned = not stand_in()
    with _ring_lock:
        if _ring is None or (_ring.slot_bytes, _ring.slots, _ring.pinned) != (slot, max(1, capacity // slot), pinned):
            _ring = Ring(capacity, slot, pinned)
        return _ring


class Staging:
    """The staging of one save: its ring and one copy engine per device, made on first use."""

    def __init__(self, staging_bytes: Optional[int] = None, device_copy: Optional[bool] = None):
        if device_copy is not None and not isinstance(device_copy, bool):
            raise InputError(f"device_copy: must be None (where the device has room), True or False, got {device_copy!r}")
        if staging_bytes is not None and (isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < MIN_SLOT_BYTES):
            raise InputError(f"staging_bytes: must be a number of bytes of at least {MIN_SLOT_BYTES}, got {staging_bytes!r}")
        self.staging_bytes = staging_bytes
        self.device_copy = device_copy
        #: How a background save took its moment of the staged tensors: "device copy" or
        #: "host copy" (None: a blocking save, or nothing staged).
        self.moment: Optional[str] = None
        self.device_copy_bytes = 0
        self.tensors = []
        self._copies = {}
        self._lock = threading.Lock()
        self.ring: Optional[Ring] = None
        self._copied_before = 0

    def add(self, tensor, what: str, dtype_name: str) -> "StagedTensor":
        """``tensor`` (in device memory) as a source of its bytes for the native save."""
        if tensor.device.type not in ("cuda", "cpu"):
            raise InputError(f"{what} is on {tensor.device}; saver stages CUDA tensors (move it to a CUDA device or the CPU)")
        check_storage(tensor, what)
        staged = StagedTensor(self, tensor, what, dtype_name)
        self.tensors.append(staged)
        return staged

    def start(self, background: bool = False) -> None:
        """Makes the ring once every tensor of the save is known (its default size is 1/8 of
        them), and fixes the save's moment on each device. For a background save, the moment
        is a copy of the staged tensors in device memory where every device has room for it
        (``device_copy``), which the save then drains through the ring while training goes on;
        otherwise the native module copies them to host memory through the ring during the
        call."""
        if not self.tensors:
            return
        self.ring = ring_for(sum(t.nbytes for t in self.tensors), self.staging_bytes)
        self._copied_before = self.ring.bytes_copied
        by_device = {}
        for t in self.tensors:
            self._engine(t.device)
            by_device.setdefault(str(t.device), []).append(t)
        if not background:
            return
        room = all(self._engine(ts[0].device).room(ts[0].device, sum(t.nbytes for t in ts)) for ts in by_device.values())
        if self.device_copy is False or (self.device_copy is None and not room):
            self.moment = "host copy"
            return
        for ts in by_device.values():
            copies = self._engine(ts[0].device).snapshot([t._flat for t in ts])
            for t, c in zip(ts, copies):
                t.hold(c)
                self.device_copy_bytes += t.nbytes
        self.moment = "device copy"

    def _engine(self, device):
        with self._lock:
            key = str(device)
            if key not in self._copies:
                self._copies[key] = _copies_for(device)
            return self._copies[key]

    def report(self) -> dict:
        """What the staging used, for the save's report."""
        if self.ring is None:
            return {"staged_bytes": 0, "staging_bytes": 0}
        return {"staged_bytes": self.ring.bytes_copied - self._copied_before, "staging_bytes": self.ring.capacity,
                "moment": self.moment, "device_copy_bytes": self.device_copy_bytes}


class StagedTensor:
    """A device tensor's bytes as the native save reads them: ``nbytes``, ``what`` (its name in
    errors) and ``read_into(offset, address, length)``; and ``shape``, ``ndim`` and
    ``saver_dtype`` for the Python half's checks."""

    def __init__(self, staging: Staging, tensor, what: str, dtype_name: str):
        import torch

        t = tensor.detach()
        # A strided device tensor is made contiguous on its device (a device copy): the ring
        # copies contiguous byte ranges.
        flat_source = t if t.is_contiguous() else t.contiguous()
        self._tensor = t
        self._flat = flat_source.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
        self._staging = staging
        self.device = t.device
        self.what = what
        self.saver_dtype = dtype_name
        self.shape = tuple(t.shape)
        self.ndim = t.dim()
        self.nbytes = int(t.numel() * t.element_size())
        #: Whether these bytes stay as they are once the save's call returns (a device copy of
        #: the moment): a background save then reads them as it writes.
        self.lasting = False

    def hold(self, copy) -> None:
        """Reads ``copy`` (the flat bytes of a device copy of the tensor, taken at the save's
        moment) from now on, for as long as the save runs."""
        self._flat = copy
        self._tensor = copy
        self.lasting = True

    def read_into(self, offset: int, address: int, length: int) -> None:
        """Fills the ``length`` bytes at ``address`` with this tensor's bytes from ``offset``."""
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise InputError(f"{self.what}: bytes {offset}..{offset + length} asked of {self.nbytes}")
        ring = self._staging.ring
        if ring is None:
            raise InputError(f"{self.what}: read before its save started")
        ring.copy(self._staging._engine(self.device), self._flat, offset, address, length, lambda: check_storage(self._tensor, self.what))


class DeviceTarget:
    """A device tensor a load fills (a row-range target), as the load's checks see it: its
    ``shape`` and ``ndim``, and ``like``, a zero-size host array of its dtype."""

    def __init__(self, tensor, what: str, like):
        import torch

        self.tensor = tensor
        self.what = what
        self.like = like
        self.shape = tuple(tensor.shape)
        self.ndim = tensor.dim()
        self.nbytes = int(tensor.numel() * tensor.element_size())
        self.flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else None


class Kept:
    """What a process keeps for the next operation of the same kind (a load's host buffers, a
    background save's staged copy), by key: taken by one operation at a time, at most two of a
    key (for operations beside each other), and only those of the newest key given back, so
    that a process whose sizes change keeps the newest rather than every one."""

    def __init__(self):
        self._free = {}
        self._lock = threading.Lock()

    def take(self, key):
        """A kept value of ``key``, now this caller's; None if none is free."""
        with self._lock:
            kept = self._free.get(key)
            return kept.pop() if kept else None

    def give(self, key, value) -> None:
        """Keeps ``value`` for the next :meth:`take` of ``key``."""
        with self._lock:
            if key not in self._free:
                self._free.clear()
            kept = self._free.setdefault(key, [])
            if len(kept) < 2:
                kept.append(value)

    def values(self) -> list:
        """Every value kept now."""
        with self._lock:
            return [v for vs in self._free.values() for v in vs]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


#: The host buffers of loads, by (bytes, pinned): a pair each.
_landing_buffers = Kept()


class Landing:
    """The device tensors a load fills, landed in rounds through two host buffers (pinned on
    CUDA) of half the load's bound each (``staging_bytes``: by default the smaller of 256 MiB and
    1/8 of the bytes landed). Each round is one native read of the checkpoint into one buffer,
    every chunk it touches checked against its CRC32s before the read returns; only then is the
    buffer copied to the device tensors, on a stream of the landing's own (after the work already
    queued on the caller's stream), while the next round reads into the other buffer. The first
    round is read with the rest of the load (its host targets, hashed tables and dense tensors),
    so that every check that needs no data runs before the first byte lands anywhere; a read that
    fails midway leaves the rounds before it landed, as it leaves a host target partly filled."""

    def __init__(self, staging_bytes: Optional[int] = None):
        if staging_bytes is not None and (isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < MIN_SLOT_BYTES):
            raise InputError(f"staging_bytes: must be a number of bytes of at least {MIN_SLOT_BYTES}, got {staging_bytes!r}")
        self.staging_bytes = staging_bytes
        self._targets = []
        #: What the landing did: bytes copied to device tensors, rounds read, host memory held.
        self.landed_bytes = 0
        self.rounds = 0
        self.host_bytes = 0

    def target(self, tensor, what: str, like) -> DeviceTarget:
        """``tensor`` (in device memory) as a target the load's checks can see."""
        if tensor.device.type not in ("cuda", "cpu"):
            raise InputError(f"{what} is on {tensor.device}; saver loads into CUDA tensors (or CPU ones)")
        check_storage(tensor, what)
        if not tensor.is_contiguous():
            raise InputError(f"{what}: a device tensor a load fills must be contiguous")
        return DeviceTarget(tensor, what, like)

    def add(self, target: DeviceTarget, table: str, rows: tuple, slot: str, cols) -> None:
        """Rows ``rows`` of ``table``'s ``slot`` (columns ``cols``, or all) land in ``target``."""
        if target.nbytes:
            self._targets.append((target, table, rows, slot, cols))

    def _rounds(self, buffer_bytes: int):
        """The pieces of the targets, packed into rounds of at most ``buffer_bytes`` (a piece
        is a run of whole rows): ``[[(target, table, slot, cols, first row, end row, its first
        row in the target, offset in the buffer, bytes)]]``."""
        rounds, current, used = [], [], 0
        for target, table, (start, end), slot, cols in self._targets:
            row_bytes = target.nbytes // (end - start)
            r = 0
            while r < end - start:
                room = (buffer_bytes - used) // row_bytes
                if room == 0:
                    rounds.append(current)
                    current, used = [], 0
                    continue
                n = min(room, end - start - r)
                current.append((target, table, slot, cols, start + r, start + r + n, r, used, n * row_bytes))
                # Pieces start 512-byte aligned, as a device copy likes them.
                used += -(-(n * row_bytes) // 512) * 512
                r += n
        if current:
            rounds.append(current)
        return rounds

    def land(self, read):
        """Reads the load in rounds, ``read(pieces, first)`` being one native read of the
        request's ``{(table, (first row, end row)): [(slot, cols, host bytes)]}`` (``first``: the
        load's first read, which takes its other targets too), and copies each round to its
        device tensors. Returns the first read's result."""
        if not self._targets:
            return read({}, True)
        total = sum(t.nbytes for t, *_ in self._targets)
        bound = self.staging_bytes if self.staging_bytes is not None else max(MIN_SLOT_BYTES, min(DEFAULT_RING_BYTES, total // 8))
        widest = max(t.nbytes // (e - s) for t, _, (s, e), _, _ in self._targets)
        # A buffer holds one row at least, however wide (the bound is then exceeded, and said).
        buffer_bytes = max(-(-widest // 512) * 512, (bound // 2) // 512 * 512)
        rounds = self._rounds(buffer_bytes)
        pinned = not stand_in()
        pair = _landing_buffers.take((buffer_bytes, pinned))
        if pair is None:
            import torch

            pair = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        engines = {}
        pending = [[], []]
        first = None
        try:
            for k, pieces in enumerate(rounds):
                buf = pair[k % 2]
                # The copies out of this buffer two rounds ago: done before it is read into.
                for engine, handle in pending[k % 2]:
                    engine.finish(handle)
                pending[k % 2] = []
                request = {}
                for target, table, slot, cols, a, b, _, offset, nbytes in pieces:
                    request.setdefault((table, (a, b)), []).append((slot, cols, buf[offset : offset + nbytes].numpy()))
                result = read(request, k == 0)
                if k == 0:
                    first = result
                for target, _, _, _, a, b, r, offset, nbytes in pieces:
                    check_storage(target.tensor, target.what)
                    key = str(target.tensor.device)
                    if key not in engines:
                        engines[key] = _copies_for(target.tensor.device)
                    at = r * (nbytes // (b - a))
                    handle = engines[key].start(target.flat[at : at + nbytes], buf[offset : offset + nbytes])
                    pending[k % 2].append((engines[key], handle))
                    self.landed_bytes += nbytes
                self.rounds += 1
        finally:
            # Every copy out of the buffers done before they go back to the pool (also when a
            # read failed), so that no later load reads into memory still being copied.
            failure = None
            for handles in pending:
                for engine, handle in handles:
                    try:
                        engine.finish(handle)
                    except Exception as e:  # the first failure is raised, once all are waited
                        failure = failure or e
            _landing_buffers.give((buffer_bytes, pinned), pair)
        self.host_bytes = 2 * buffer_bytes
        if failure is not None:
            raise failure
        return first
