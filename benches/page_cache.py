"""The files of a checkpoint and their pages in the page cache, for the Python benchmarks: what
makes a restore "warm" (every byte read once, untimed) or "cold" (evicted first)."""

import os

MIB = 1 << 20


def files_under(path):
    """Every file under `path` (itself if it is one)."""
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(paths):
    """Drops the files' pages from the page cache (made clean first). On a virtual machine the
    host's cache may still hold them."""
    for p in paths:
        for f in files_under(p):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(paths):
    """Reads every byte of the files once, so that a reader finds them in the page cache (a save
    with direct I/O leaves nothing there)."""
    for p in paths:
        for f in files_under(p):
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 * MIB):
                    pass
