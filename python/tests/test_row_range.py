"""Row-range tables from Python: a model's embedding tables (a tensor whose row number is the
id) saved as chunks at their global offsets, by one process or several, and loaded for any split
straight into the caller's arrays and tensors."""

import os

import numpy as np
import pytest
import torch

import saver


def values(rows, cols, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, cols)).astype(np.float32)


def test_row_and_column_chunks_from_two_writers_load_into_three_buffers_in_place(tmp_path):
    rows, cols = 1000, 16
    weight = values(rows, cols, 1)
    momentum = np.arange(rows, dtype=np.float32)
    # Two processes: one holds columns 0..8 of every row, the other columns 8..16; the row-wise
    # state is cut by rows.
    halves = [
        {"weight": saver.Chunk(weight[:, :8].copy(), offset=(0, 0), shape=(rows, cols)),
         "momentum": saver.Chunk(momentum[:400], offset=(0,), shape=(rows,))},
        {"weight": saver.Chunk(weight[:, 8:].copy(), offset=(0, 8), shape=(rows, cols)),
         "momentum": saver.Chunk(momentum[400:], offset=(400,), shape=(rows,))},
    ]
    for j, mine in enumerate(halves):
        saver.save(tmp_path / "c", tables={"item": mine}, shards=2, shard_index=j, save_id="rr-1")
    # Three workers, row-wise: each fills its own preallocated arrays (a torch tensor included).
    for j in range(3):
        a, b = rows * j // 3, rows * (j + 1) // 3
        w = torch.empty((b - a, cols), dtype=torch.float32)
        m = np.empty(b - a, dtype=np.float32)
        loaded = saver.load(tmp_path / "c", into={"item": {
            "weight": saver.Chunk(w, offset=(a, 0)),
            "momentum": saver.Chunk(m, offset=(a,)),
        }})
        np.testing.assert_array_equal(w.numpy(), weight[a:b])
        np.testing.assert_array_equal(m, momentum[a:b])
        assert "item" not in loaded.tables
        assert loaded.report["row_tables"]["bytes_wanted"] == (b - a) * (cols + 1) * 4
    # Without into: the whole table, as arrays.
    whole = saver.load(tmp_path / "c").tables["item"]
    np.testing.assert_array_equal(whole["weight"], weight)
    np.testing.assert_array_equal(whole["momentum"], momentum)
    assert saver.verify(tmp_path / "c")["status"] == "ok"


def test_a_bf16_embedding_round_trips_and_a_sharded_load_gets_its_rows(tmp_path):
    emb = torch.randn(301, 8).to(torch.bfloat16)
    saver.save(tmp_path / "c", tables={"e": {"weight": saver.Chunk(emb)}})
    got = saver.load(tmp_path / "c").tables["e"]["weight"]
    assert isinstance(got, saver.Bits) and got.saver_dtype == "BF16"
    assert torch.equal(torch.from_numpy(np.asarray(got)).view(torch.bfloat16), emb)
    part = saver.load(tmp_path / "c", shards=3, shard_index=2)
    start = part.report["row_offsets"]["e"]
    assert start == 301 * 2 // 3
    assert torch.equal(torch.from_numpy(np.asarray(part.tables["e"]["weight"])).view(torch.bfloat16), emb[start:])
    # Into a bf16 tensor of ours, in place.
    mine = torch.zeros(10, 8, dtype=torch.bfloat16)
    saver.load(tmp_path / "c", into={"e": {"weight": saver.Chunk(mine, offset=(100, 0))}})
    assert torch.equal(mine, emb[100:110])


def test_chunks_that_do_not_cover_the_table_or_bad_buffers_are_refused_by_name(tmp_path):
    w = values(100, 4, 2)
    with pytest.raises(saver.SaverError, match='"weight".*overlap'):
        saver.save(tmp_path / "o", tables={"t": {"weight": [
            saver.Chunk(w[:60], offset=(0, 0), shape=(100, 4)),
            saver.Chunk(w[50:], offset=(50, 0), shape=(100, 4)),
        ]}})
    with pytest.raises(saver.SaverError, match="cover"):
        saver.save(tmp_path / "g", tables={"t": {"weight": saver.Chunk(w[:60], offset=(0, 0), shape=(100, 4))}})
    saver.save(tmp_path / "c", tables={"t": {"weight": saver.Chunk(w)}})
    with pytest.raises(saver.InputError, match="no slot 'bias'"):
        saver.load(tmp_path / "c", into={"t": {"bias": saver.Chunk(np.empty((1, 4), np.float32))}})
    with pytest.raises(saver.InputError, match="C-contiguous"):
        saver.load(tmp_path / "c", into={"t": {"weight": saver.Chunk(np.empty((4, 10), np.float32).T)}})
    with pytest.raises(saver.SaverError, match="rows"):
        saver.load(tmp_path / "c", into={"t": {"weight": saver.Chunk(np.empty((10, 4), np.float32), offset=(95, 0))}})
    # The digest covers them: one content, one digest, whatever the split.
    saver.save(tmp_path / "d", tables={"t": {"weight": [saver.Chunk(w[:, :1].copy(), offset=(0, 0), shape=(100, 4)),
                                                       saver.Chunk(w[:, 1:].copy(), offset=(0, 1), shape=(100, 4))]}})
    assert saver.digest(tmp_path / "c") == saver.digest(tmp_path / "d")


def test_a_background_save_of_a_row_range_table_holds_its_moment_and_a_manager_keeps_it(tmp_path):
    w = torch.arange(4000, dtype=torch.float32).reshape(1000, 4)
    h = saver.save_async(tmp_path / "bg", tables={"e": {"weight": saver.Chunk(w)}})
    w.fill_(-1.0)  # the save copied the moment before it returned
    h.wait()
    got = saver.load(tmp_path / "bg").tables["e"]["weight"]
    np.testing.assert_array_equal(got, np.arange(4000, dtype=np.float32).reshape(1000, 4))

    m = saver.Manager(tmp_path / "run")
    for step in (10, 20):
        m.save(step, tables={"e": {"weight": saver.Chunk(torch.full((100, 4), float(step)))}})
    step, loaded = m.load_latest()
    assert step == 20
    np.testing.assert_array_equal(loaded.tables["e"]["weight"], np.full((100, 4), 20.0, np.float32))


def test_a_delta_of_a_row_range_table_holds_the_changed_rows_and_loads_in_place(tmp_path):
    w = torch.tensor(values(20000, 16, 5))
    state = torch.zeros(20000)
    tables = lambda: {"e": {"weight": saver.Chunk(w), "state": saver.Chunk(state)}}
    saver.save(tmp_path / "base", tables=tables())
    # A step of training touches a few rows.
    touched = torch.tensor([3, 17, 4096, 19999])
    w[touched] += 1.0
    state[touched] += 0.5
    saver.save(tmp_path / "delta", tables=tables(), parent=tmp_path / "base")
    info = saver.Checkpoint(tmp_path / "delta")
    assert info.is_delta and info.format_version == 6
    # Four rows of each slot, with their row numbers: not the table.
    assert info.row_tables["e"]["bytes"] == 4 * (16 * 4 + 8) + 4 * (4 + 8)
    w_back, state_back = torch.empty_like(w), torch.empty_like(state)
    saver.load(tmp_path / "delta", into={"e": {"weight": saver.Chunk(w_back), "state": saver.Chunk(state_back)}})
    assert torch.equal(w_back, w) and torch.equal(state_back, state)

    # A manager saves the next steps as deltas of the first.
    m = saver.Manager(tmp_path / "run")
    for step in (1, 2, 3):
        w[step * 100] = float(step)
        m.save(step, tables=tables())
    assert [s["links"] for s in m.steps()] == [1, 2, 3]
    back = torch.empty_like(w)
    step, _ = m.load_latest(into={"e": {"weight": saver.Chunk(back)}})
    assert step == 3 and torch.equal(back, w)


def test_targets_of_another_dtype_or_over_shared_memory_are_refused_before_any_byte_lands(tmp_path):
    rows, cols = 40, 4
    weight = values(rows, cols, 5)
    emb = torch.randn(rows, cols).to(torch.bfloat16)
    saver.save(tmp_path / "c", tables={"t": {"w": saver.Chunk(weight)}, "e": {"w": saver.Chunk(emb)}})
    # A buffer of another dtype of the same width: refused naming both, left as it was (before,
    # an int32 buffer got 1065353216 for 1.0, and float16 1.875 for bfloat16's 1.0).
    for wrong, name in [(np.zeros((rows, cols), np.int32), "I32"), (torch.zeros(rows, cols, dtype=torch.float16), "F16")]:
        with pytest.raises(saver.InputError, match=f"holds F32 values and the buffer is {name}"):
            saver.load(tmp_path / "c", into={"t": {"w": saver.Chunk(wrong)}})
        assert not np.asarray(wrong).any()
    with pytest.raises(saver.InputError, match="holds BF16 values and the buffer is F16"):
        saver.load(tmp_path / "c", into={"e": {"w": saver.Chunk(torch.zeros(rows, cols, dtype=torch.float16))}})
    # The slot's own dtype, and BF16's bit patterns as a plain 16-bit integer array, are filled.
    into_bf16 = torch.zeros(rows, cols, dtype=torch.bfloat16)
    bits = np.zeros((rows, cols), np.uint16)
    saver.load(tmp_path / "c", into={"e": {"w": saver.Chunk(into_bf16)}})
    saver.load(tmp_path / "c", into={"e": {"w": saver.Chunk(bits)}})
    assert torch.equal(into_bf16, emb) and torch.equal(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), emb)
    # Two targets over one memory: a SaverError naming the target (before, a Rust panic that
    # `except Exception` did not catch), and nothing written.
    buffer = np.zeros((rows, cols), np.float32)
    for targets in (
        [saver.Chunk(buffer[:24], offset=(0, 0)), saver.Chunk(buffer[16:], offset=(16, 0))],
        [saver.Chunk(buffer, offset=(0, 0)), saver.Chunk(buffer, offset=(0, 0))],
    ):
        try:
            saver.load(tmp_path / "c", into={"t": {"w": targets}})
        except Exception as e:  # what a trainer catches
            assert isinstance(e, saver.SaverError) and "shares memory with another target" in str(e), e
        else:
            raise AssertionError("targets over one memory were filled")
        assert not buffer.any()
    # Views of one buffer that do not overlap are two targets.
    saver.load(tmp_path / "c", into={"t": {"w": [saver.Chunk(buffer[:20], offset=(0, 0)), saver.Chunk(buffer[20:], offset=(20, 0))]}})
    np.testing.assert_array_equal(buffer, weight)


def test_a_managers_fallback_passes_over_a_delta_whose_changed_rows_every_read_refuses(tmp_path):
    import json
    import warnings
    import zlib

    m = saver.Manager(tmp_path / "run", full_every=2)
    w = values(100, 4, 7)
    m.save(1, tables={"emb": {"weight": saver.Chunk(w)}})
    w2 = w.copy()
    w2[[3, 10, 40]] += 1
    m.save(2, tables={"emb": {"weight": saver.Chunk(w2)}})
    step2 = m.latest()["path"]
    assert saver.Checkpoint(step2).is_delta
    # The delta's changed-row numbers rewritten out of order, their CRC resealed.
    index_path = os.path.join(step2, "model.safetensors.index.json")
    index = json.load(open(index_path))
    manifest_path = os.path.join(step2, index["metadata"]["saver_manifest"])
    manifest = json.load(open(manifest_path))
    rows = manifest["row_tables"][0]["slots"][0]["patches"][0]["changed"]["rows"]
    patterns = np.array([10, 3, 40], dtype="<u8").tobytes()
    with open(os.path.join(step2, rows["file"]), "r+b") as f:
        f.seek(rows["offset"])
        f.write(patterns)
    rows["crc32"] = zlib.crc32(patterns)
    body = json.dumps(manifest).encode()
    open(manifest_path, "wb").write(body)
    index["metadata"]["saver_manifest_crc32"] = zlib.crc32(body)
    open(index_path, "w").write(json.dumps(index, separators=(",", ":")))
    with pytest.raises(saver.SaverError, match="not increasing row numbers"):
        m.load_latest()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, loaded = m.load_latest(fallback=True)
    assert step == 1
    np.testing.assert_array_equal(loaded.tables["emb"]["weight"], w)
    assert any("step 2 does not verify" in str(c.message) for c in caught), [str(c.message) for c in caught]


def test_offsets_out_of_range_are_refused_by_name(tmp_path):
    saver.save(tmp_path / "c", tables={"t": {"w": saver.Chunk(values(10, 4, 1))}})
    for offset, said in [((-1, 0), "offset: must be from 0"), ((1 << 64, 0), "offset: must be from 0"),
                         (((1 << 64) - 1, 0), "reaches past the slot's shape"), ((8, 0), "reaches past the slot's shape")]:
        with pytest.raises(saver.InputError, match=said):
            saver.load(tmp_path / "c", into={"t": {"w": saver.Chunk(np.zeros((4, 4), np.float32), offset=offset)}})
