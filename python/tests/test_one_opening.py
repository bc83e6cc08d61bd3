"""One opening per load: `saver.load`, `saver.Checkpoint`'s loads and `saver.torch.load` read a
checkpoint holding hashed and row-range tables and dense tensors through one opening, so that a
checkpoint replaced while it is read hands back one save, never a mixture of two. Raced here for
real against a process that overwrites the checkpoint as fast as it can, many rounds, on a local
directory and on an S3-compatible store (where a removed object is gone for every reader)."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import saver

# Big enough that a load's hashed part takes a while, so that the writer commits between it and
# the row-range part of loads that open the checkpoint more than once.
HASHED_ROWS, ROW_TABLE_ROWS = 60_000, 20_000

WRITER = r"""
import os, sys
import numpy as np
import saver

path, stop, hashed_rows, row_rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ids = np.arange(hashed_rows, dtype=np.int64)
v = 1
while not os.path.exists(stop):
    v += 1
    saver.save(path, tables={
        "h": {"ids": ids, "emb": np.full((hashed_rows, 8), v, np.float32)},
        "r": {"param": saver.Chunk(np.full((row_rows, 16), v, np.float32))},
    }, dense={"d": np.full(64, v, np.float32)}, step=v, overwrite=True, durable=False)
    print(v, flush=True)
"""


def _first_save(path):
    saver.save(path, tables={
        "h": {"ids": np.arange(HASHED_ROWS, dtype=np.int64), "emb": np.full((HASHED_ROWS, 8), 1, np.float32)},
        "r": {"param": saver.Chunk(np.full((ROW_TABLE_ROWS, 16), 1, np.float32))},
    }, dense={"d": np.full(64, 1, np.float32)}, step=1, durable=False)


def _values(loaded, into=None):
    """The distinct values of every part of a load: one save gives one."""
    parts = [loaded.tables["h"]["emb"], loaded.dense["d"], into if into is not None else loaded.tables["r"]["param"]]
    seen = {float(x) for p in parts for x in np.unique(p)}
    return seen | {float(loaded.report["step"])}


def _race(path, seconds, load):
    """Loads `path` with `load` (a function returning the set of values it saw) while another
    process overwrites it: [(values seen)] of every load, and how many saves committed."""
    stop = f"{path}.stop" if "://" not in path else os.path.join(os.environ["SAVER_TEST_TMP"], "stop")
    if os.path.exists(stop):
        os.remove(stop)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path, stop, str(HASHED_ROWS), str(ROW_TABLE_ROWS)],
                              stdout=subprocess.PIPE, text=True)
    seen = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            seen.append(load(path))
    finally:
        open(stop, "w").close()
        out, _ = writer.communicate(timeout=60)
    assert writer.returncode == 0, "the writer failed"
    return seen, len(out.split())


def _load_by_path(path):
    return _values(saver.load(path))


def _load_into(path):
    buffer = np.zeros((ROW_TABLE_ROWS, 16), np.float32)
    loaded = saver.load(path, into={"r": {"param": saver.Chunk(buffer)}})
    return _values(loaded, into=buffer)


def _load_opened(path):
    """A load through a handle opened first, while the writer goes on: one save, or the
    handle's own error saying it was replaced."""
    ck = saver.open(path)
    try:
        loaded = ck.load()
    except saver.ReplacedError:
        return {"replaced"}
    values = _values(loaded)
    assert values == {float(ck.step)}, (values, ck.step)
    return values


@pytest.mark.parametrize("load", [_load_by_path, _load_into, _load_opened], ids=["path", "into", "opened"])
def test_loads_racing_overwrites_never_see_a_mixture_of_two_saves(tmp_path, load):
    path = str(tmp_path / "ck")
    _first_save(path)
    seen, saves = _race(path, 6, load)
    mixtures = [s for s in seen if len(s) != 1]
    assert not mixtures, f"{len(mixtures)} of {len(seen)} loads mixed saves: {mixtures[:5]}"
    assert saves >= 10 and len(seen) >= 10, (saves, len(seen))
    # The loads saw the checkpoint change under them: the race was run.
    assert len({next(iter(s)) for s in seen}) > 3, seen


def test_loads_racing_overwrites_on_an_object_store_never_see_a_mixture(garage, tmp_path, monkeypatch):
    monkeypatch.setenv("SAVER_TEST_TMP", str(tmp_path))
    url = f"{garage}/race/ck"
    _first_save(url)
    for load in (_load_by_path, _load_into):
        seen, saves = _race(url, 6, load)
        mixtures = [s for s in seen if len(s) != 1]
        assert not mixtures, f"{load.__name__}: {len(mixtures)} of {len(seen)} loads mixed saves: {mixtures[:5]}"
        assert saves >= 3 and len({next(iter(s)) for s in seen}) > 1, (saves, seen)


def test_a_handle_reads_the_save_it_opened_or_says_it_was_replaced(tmp_path):
    """Opened, then overwritten: its loads give the save it opened, whole, or raise
    ReplacedError; never the new save's rows."""
    path = str(tmp_path / "ck")
    _first_save(path)
    ck = saver.open(path)
    assert not ck.replaced()
    saver.save(path, tables={
        "h": {"ids": np.arange(HASHED_ROWS, dtype=np.int64), "emb": np.full((HASHED_ROWS, 8), 7, np.float32)},
        "r": {"param": saver.Chunk(np.full((ROW_TABLE_ROWS, 16), 7, np.float32))},
    }, dense={"d": np.full(64, 7, np.float32)}, step=7, overwrite=True)
    assert ck.replaced()
    try:
        assert _values(ck.load()) == {1.0}
    except saver.ReplacedError as e:
        assert "replaced by another save" in str(e) and "open it again" in str(e)
    assert _values(saver.load(path)) == {7.0}
