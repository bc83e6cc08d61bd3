"""The limit of the Python benchmarks: the fastest plain way to do a save's or a restore's work
on this machine, for a list of CPU tensors (a model's, or one rank's shards of one).

- `write(tensors, path)`: the tensors' bytes written durably to one file, the faster of (a) each
  tensor written from its own memory through the page cache, by as many threads as cores, its
  writeback started as it goes, then fsync, and (b) as many bytes written with O_DIRECT from
  reused aligned buffers, one a thread; the file allocated at its length first (both timed on
  every call).
- `read(tensors, path)`: as many bytes read from that file into the tensors' own memory, by as
  many threads as cores.
"""

import ctypes
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

from page_cache import MIB

LIBC = ctypes.CDLL(None, use_errno=True)
SYNC_FILE_RANGE_WRITE = 2


def _pieces(tensors, threads):
    """(tensor bytes, file offset) of tensors laid out back to back, dealt to `threads` lists of
    about equal bytes."""
    out, at = [[] for _ in range(threads)], 0
    total = sum(t.numel() * t.element_size() for t in tensors)
    for t in tensors:
        view = memoryview(t.detach().numpy()).cast("B")
        out[min(threads - 1, at * threads // max(total, 1))].append((view, at))
        at += len(view)
    return out, total


def _parallel(work, lists):
    with ThreadPoolExecutor(len(lists)) as pool:
        list(pool.map(work, lists))


def write(tensors, path, ways=(True, False)):
    """Seconds of the faster plain durable write of `tensors` to `path` (see the module), of the
    ways given (`True`: with O_DIRECT, `False`: through the page cache)."""
    threads = os.cpu_count() or 1
    lists, total = _pieces(tensors, threads)
    times = []
    # O_DIRECT first, so that the file ends holding the tensors' bytes.
    for direct in ways:
        if os.path.exists(path):
            os.remove(path)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
        # Allocated at its length first, as saver allocates its files: the writeback then
        # finds its extents in place.
        os.posix_fallocate(fd, 0, total + (-total % 4096))
        if direct:
            span = -(-total // threads // 4096) * 4096

            def write(i):
                block, at, end = mmap.mmap(-1, 8 * MIB), i * span, min((i + 1) * span, total + (-total % 4096))
                while at < end:
                    at += os.pwrite(fd, memoryview(block)[: min(end - at, 8 * MIB)], at)

            _parallel(write, list(range(threads)))
        else:

            def write(pieces):
                # 8 MiB at a time, each handed to the disk at once (sync_file_range), as saver
                # does: the writeback runs beside the writing, not all at the fsync.
                for view, at in pieces:
                    while view:
                        n = os.pwrite(fd, view[: 8 * MIB], at)
                        LIBC.sync_file_range(fd, ctypes.c_int64(at), ctypes.c_int64(n), SYNC_FILE_RANGE_WRITE)
                        view, at = view[n:], at + n

            _parallel(write, lists)
        os.fsync(fd)
        os.close(fd)
        times.append(time.perf_counter() - t0)
    return min(times)


def read(tensors, path):
    """Seconds of a plain read of `path` into `tensors`' own memory (see the module)."""
    lists, _ = _pieces(tensors, os.cpu_count() or 1)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)

    def read(pieces):
        for view, at in pieces:
            while view:
                n = os.preadv(fd, [view], at)
                view, at = view[n:], at + n

    _parallel(read, lists)
    os.close(fd)
    return time.perf_counter() - t0
