"""How a test's gloo rank leaves its process group."""

import os
import sys
from contextlib import contextmanager

import torch.distributed as dist


def leave(ok):
    """Meets the other ranks, tears the group down, and, if the rank's work succeeded, ends the
    process at once (`os._exit(0)`, the streams flushed). A rank that tears its group down while
    another still finishes a collective aborts the other in gloo, hence the meeting first; and
    torch 2.14's gloo aborts about one process exit in five at interpreter shutdown after
    `destroy_process_group` ("terminate called without an active exception"), with nothing of
    saver's in the process (torch collectives alone), hence the exit before shutdown. A rank
    that failed exits the normal way, its exception reported."""
    dist.barrier()
    dist.destroy_process_group()
    if ok:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@contextmanager
def group(rank, world, port):
    """Rank `rank` of a gloo group of `world` on the loopback at `port`, for the body of the
    `with`; then `leave`s it (exiting the process if the body succeeded)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ok = False
    try:
        yield
        ok = True
    finally:
        leave(ok)
