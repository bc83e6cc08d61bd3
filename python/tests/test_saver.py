"""The saver Python package, through its public API and against the `saver` binary."""

import glob
import os
import subprocess
import threading

import numpy as np
import pytest
import safetensors.numpy

import saver

NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
]


def saver_bin():
    path = os.environ.get("SAVER_BIN")
    # The test script builds the binary: without it the digest checks cannot run, and must fail.
    assert path and os.path.exists(path), "SAVER_BIN must name the saver binary (python/tests/run.sh sets it)"
    return path


def values(rng, dtype, shape):
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(size=shape).astype(dtype)


def by_id(columns):
    """A table's columns sorted by id (loads return rows in checkpoint order)."""
    order = np.argsort(columns["ids"], kind="stable")
    return {k: v[order] for k, v in columns.items()}


def test_every_dtype_and_shape_round_trips(tmp_path):
    rng = np.random.default_rng(1)
    n = 5000
    ids = rng.permutation(np.arange(-n // 2, n - n // 2, dtype=np.int64) * 7919)
    columns = {"ids": ids}
    dense = {}
    for k, dt in enumerate(NUMPY_DTYPES):
        columns[f"s{k}"] = values(rng, dt, (n, 3))
        dense[f"d{k}"] = values(rng, dt, (2, 3, 4))
    columns["scalar"] = values(rng, np.float32, (n,))
    columns["matrix"] = values(rng, np.float32, (n, 2, 5))
    dense["zero_d"] = np.float64(3.5)
    dense["empty"] = np.zeros((0, 4), dtype=np.float32)
    report = saver.save(tmp_path / "ckpt", tables={"t": columns}, dense=dense, shards=3)
    assert report.committed and report.rows == n and sorted(report.shards) == [0, 1, 2]

    loaded = saver.load(tmp_path / "ckpt")
    got, want = by_id(loaded.tables["t"]), by_id(columns)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for k, v in dense.items():
        a = np.asarray(v)
        assert loaded.dense[k].dtype == a.dtype and loaded.dense[k].shape == a.shape, k
        np.testing.assert_array_equal(loaded.dense[k], a, err_msg=k)


def test_uint64_ids_keep_all_64_bits(tmp_path):
    ids = np.array([0, 1, 2**63, 2**64 - 1, 12345678901234567890], dtype=np.uint64)
    emb = np.arange(10, dtype=np.float32).reshape(5, 2)
    saver.save(tmp_path / "c", tables={"t": {"ids": ids, "emb": emb}})
    got = by_id(saver.load(tmp_path / "c").tables["t"])
    assert got["ids"].dtype == np.uint64
    np.testing.assert_array_equal(got["ids"], np.sort(ids))
    np.testing.assert_array_equal(got["emb"], emb[np.argsort(ids)])


def test_a_resharding_load_gives_every_row_to_exactly_one_shard(tmp_path):
    rng = np.random.default_rng(2)
    ids = rng.choice(2**40, size=20000, replace=False).astype(np.int64)
    emb = rng.standard_normal((20000, 8)).astype(np.float32)
    saver.save(tmp_path / "c", tables={"t": {"ids": ids, "emb": emb}}, shards=4)
    parts = [saver.load(tmp_path / "c", shards=3, shard_index=j).tables["t"] for j in range(3)]
    assert all(0 < len(p["ids"]) < 20000 for p in parts)
    whole = by_id({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    want = by_id({"ids": ids, "emb": emb})
    np.testing.assert_array_equal(whole["ids"], want["ids"])
    np.testing.assert_array_equal(whole["emb"], want["emb"])


def test_a_multi_process_save_commits_when_its_last_shard_is_written(tmp_path):
    with pytest.raises(saver.SaverError, match="belong to other shards"):
        saver.save(tmp_path / "x", tables={"t": {"ids": np.arange(100, dtype=np.int64)}}, shards=3, shard_index=0, save_id="r")
    with pytest.raises(saver.SaverError, match="needs an explicit save id"):
        saver.save(tmp_path / "x", tables={"t": {"ids": np.arange(100, dtype=np.int64)}}, shards=3, shard_index=0, foreign_rows="skip")
    ids = np.arange(3000, dtype=np.int64)
    emb = np.repeat(ids[:, None], 4, axis=1).astype(np.float32)
    owner = saver.shard_of(ids, 3)
    assert owner.dtype == np.uint32 and set(owner.tolist()) == {0, 1, 2}
    np.testing.assert_array_equal(saver.shard_of(torch_like(ids), 3), owner)
    for j in range(3):
        # Every process holds the whole table here, and writes its shard's rows: the others'
        # are left out, and the report counts them.
        report = saver.save(
            tmp_path / "c",
            tables={"t": {"ids": ids, "emb": emb}},
            shards=3,
            shard_index=j,
            save_id="run1",
            foreign_rows="skip",
        )
        assert report.rows == int((owner == j).sum()) and report.skipped_rows == int((owner != j).sum())
        # Routed by shard_of, a process's rows are its shard's: nothing is foreign.
        mine = owner == j
        routed = saver.save(tmp_path / "r", tables={"t": {"ids": ids[mine], "emb": emb[mine]}},
                            shards=3, shard_index=j, save_id="run2")
        assert routed.rows == int(mine.sum()) and routed.skipped_rows == 0
        if j < 2:
            with pytest.raises(saver.SaverError):
                saver.open(tmp_path / "c")  # not committed before its last shard
    for c in ("c", "r"):
        got = by_id(saver.load(tmp_path / c).tables["t"])
        np.testing.assert_array_equal(got["emb"], emb)
        for j in range(3):
            part = saver.load(tmp_path / c, shards=3, shard_index=j).tables["t"]["ids"]
            np.testing.assert_array_equal(np.sort(part), ids[owner == j])
    with pytest.raises(saver.InputError, match="shards"):
        saver.shard_of(ids, 0)
    with pytest.raises(saver.InputError, match="int64 or uint64"):
        saver.shard_of(ids.astype(np.int32), 2)


def torch_like(ids):
    """`ids` as a torch tensor when torch is installed (saver.shard_of takes tensors too)."""
    import torch

    return torch.from_numpy(ids)


def test_digests_equal_the_binarys_save_of_the_same_arrays(tmp_path):
    rng = np.random.default_rng(3)
    ids = rng.choice(2**50, size=4000, replace=False).astype(np.int64)
    emb = rng.standard_normal((4000, 16)).astype(np.float32)
    freq = rng.integers(0, 100, size=4000).astype(np.int64)
    w = rng.standard_normal((32, 8)).astype(np.float32)
    plain = tmp_path / "plain"
    plain.mkdir()
    safetensors.numpy.save_file(
        {"user/ids": ids, "user/embedding": emb, "user/freq": freq, "mlp.w": w}, str(plain / "model.safetensors")
    )
    subprocess.run([saver_bin(), "save", "--out", str(tmp_path / "cli"), "--from", str(plain), "--shards", "2"], check=True, capture_output=True)
    saver.save(tmp_path / "py", tables={"user": {"ids": ids, "embedding": emb, "freq": freq}}, dense={"mlp.w": w}, shards=3)
    cli = subprocess.run([saver_bin(), "digest", str(tmp_path / "cli")], check=True, capture_output=True, text=True).stdout.strip()
    py_by_cli = subprocess.run([saver_bin(), "digest", str(tmp_path / "py")], check=True, capture_output=True, text=True).stdout.strip()
    assert len(cli) == 64
    assert saver.digest(tmp_path / "py") == py_by_cli == cli == saver.digest(plain)


def test_data_files_open_in_safetensors_own_reader(tmp_path):
    ids = np.arange(100, dtype=np.int64)
    emb = np.ones((100, 4), dtype=np.float32)
    saver.save(tmp_path / "c", tables={"t": {"ids": ids, "emb": emb}}, dense={"w": np.eye(3, dtype=np.float64)}, shards=2)
    files = glob.glob(str(tmp_path / "c" / "**" / "*.safetensors"), recursive=True)
    assert files
    seen = {}
    for f in files:
        seen.update(safetensors.numpy.load_file(f))
    assert any(np.array_equal(v, np.eye(3)) for v in seen.values())
    rows = sum(len(v) for k, v in seen.items() if k.startswith("t/ids"))
    assert rows == 100


def test_inspect_verify_step_and_metadata(tmp_path):
    ids = np.arange(10, dtype=np.int64)
    saver.save(tmp_path / "c", tables={"t": {"ids": ids, "emb": np.zeros((10, 2), np.float16)}}, step=42, metadata={"lr": "0.1"})
    c = saver.open(tmp_path / "c")
    assert c.step == 42 and c.metadata == {"lr": "0.1"} and not c.is_delta
    assert c.tables["t"]["rows"] == 10 and c.tables["t"]["key_dtype"] == "I64"
    assert c.tables["t"]["slots"]["emb"] == ("F16", [2])
    assert c.verify() == {"status": "ok", "problems": []}
    # A flipped byte in a data file is found and named.
    f = sorted(glob.glob(str(tmp_path / "c" / "**" / "*.safetensors"), recursive=True))[0]
    data = bytearray(open(f, "rb").read())
    data[-1] ^= 0xFF
    open(f, "wb").write(bytes(data))
    report = saver.verify(tmp_path / "c")
    assert report["status"] != "ok" and any(os.path.basename(f) in p for p in report["problems"])


def test_strided_arrays_and_array_likes_are_taken(tmp_path):
    base = np.arange(400, dtype=np.float32).reshape(100, 4)

    class TensorLike:
        """An object numpy converts through `__array__`, as torch tensors are."""

        def __array__(self, dtype=None, copy=None):
            return base[:, 1]

    ids = np.arange(100, dtype=np.int64)[::-1]  # a view with a negative stride
    saver.save(tmp_path / "c", tables={"t": {"ids": ids, "every_other": base[:, ::2], "col": TensorLike()}})
    got = by_id(saver.load(tmp_path / "c").tables["t"])
    # Row i belongs to id 99 - i: sorted by id, the rows come in reverse.
    np.testing.assert_array_equal(got["every_other"], base[::-1, ::2])
    np.testing.assert_array_equal(got["col"], base[::-1, 1])


@pytest.mark.parametrize(
    "tables, message",
    [
        ({"t": {"emb": np.zeros((3, 2))}}, "no 'ids' array"),
        ({"t": {"ids": np.zeros(3, dtype=np.float32)}}, "must be int64 or uint64"),
        ({"t": {"ids": np.arange(3, dtype=np.int32)}}, "must be int64 or uint64"),
        ({"t": {"ids": np.zeros((3, 2), dtype=np.int64)}}, "must be 1-D"),
        ({"t": {"ids": np.arange(3, dtype=np.int64), "emb": np.zeros((4, 2))}}, "4 rows for 3 ids"),
        ({"t": {"ids": np.arange(3, dtype=np.int64), "emb": np.zeros(3, dtype=np.complex64)}}, "complex64 is not supported"),
        ({"t": {"ids": np.arange(3, dtype=np.int64), "emb": np.float32(1)}}, "a scalar for 3 ids"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, tables, message):
    with pytest.raises(saver.InputError, match=message) as e:
        saver.save(tmp_path / "c", tables=tables)
    assert isinstance(e.value, ValueError) and isinstance(e.value, saver.SaverError)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p, t: saver.save(p, tables=t, shards=-1), "shards: must be from 1"),
        (lambda p, t: saver.save(p, tables=t, shards=0), "shards: must be from 1"),
        (lambda p, t: saver.save(p, tables=t, shards=2, shard_index=2), "shard_index: must be from 0 to 1"),
        (lambda p, t: saver.save(p, tables=t, step=-1), "step: must be from 0"),
        (lambda p, t: saver.save(p, tables=t, step=1.5), "step: must be an int"),
        (lambda p, t: saver.save(p, tables=t, parallel=0), "parallel: must be from 1"),
        (lambda p, t: saver.save_async(p, tables=t, shards="2"), "shards: must be an int"),
        (lambda p, t: saver.load(p, shards=-1), "shards: must be from 1"),
        (lambda p, t: saver.load(p, shards=3, shard_index=-1), "shard_index: must be from 0"),
        (lambda p, t: saver.Manager(p, keep_latest=0), "keep_latest: must be from 1"),
        (lambda p, t: saver.Manager(p, full_every=-1), "full_every: must be from 1"),
        (lambda p, t: saver.Manager(p).save(-1, tables=t), "step: must be from 0"),
        (lambda p, t: saver.Manager(p).save_async(-5, tables=t), "step: must be from 0"),
        (lambda p, t: saver.Manager(p).save(3, tables=t, shards=-2), "shards: must be from 1"),
    ],
)
def test_bad_numbers_are_input_errors_naming_the_argument(tmp_path, call, message):
    tables = {"t": {"ids": np.arange(3, dtype=np.int64), "emb": np.zeros((3, 2), dtype=np.float32)}}
    with pytest.raises(saver.InputError, match=message):
        call(tmp_path / "c", tables)
    assert not (tmp_path / "c" / "model.safetensors.index.json").exists()


def test_the_cores_errors_name_what_is_wrong(tmp_path):
    ids = np.array([1, 2, 2], dtype=np.int64)
    with pytest.raises(saver.SaverError, match="appears more than once"):
        saver.save(tmp_path / "c", tables={"user": {"ids": ids, "emb": np.zeros((3, 2), np.float32)}})
    with pytest.raises(saver.SaverError, match="table"):
        saver.save(tmp_path / "d", tables={"bad/name": {"ids": np.arange(2, dtype=np.int64)}})
    with pytest.raises(saver.SaverError):
        saver.load(tmp_path / "nothing-here")
    good = {"t": {"ids": np.arange(2, dtype=np.int64), "emb": np.zeros((2, 2), np.float32)}}
    saver.save(tmp_path / "e", tables=good)
    with pytest.raises(saver.SaverError, match="missing"):
        saver.load(tmp_path / "e", tables=["missing"])
    # An existing checkpoint is replaced only when asked.
    with pytest.raises(saver.SaverError):
        saver.save(tmp_path / "e", tables=good)
    saver.save(tmp_path / "e", tables=good, overwrite=True)


def test_other_threads_run_while_a_save_and_a_load_run(tmp_path):
    # The GIL is released: a Python thread counting meanwhile keeps most of its pace during the
    # calls (holding the GIL, it would count only in the calls' few Python steps).
    import time

    ids = np.arange(2_000_000, dtype=np.int64)
    emb = np.ones((2_000_000, 32), dtype=np.float32)
    counted, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1

    t = threading.Thread(target=count)
    t.start()
    pace = {}
    try:
        start, before = time.perf_counter(), counted[0]
        time.sleep(0.3)
        alone = (counted[0] - before) / (time.perf_counter() - start)
        for op, call in [
            ("save", lambda: saver.save(tmp_path / "c", tables={"t": {"ids": ids, "emb": emb}}, durable=False)),
            ("load", lambda: saver.load(tmp_path / "c")),
            ("verify", lambda: saver.verify(tmp_path / "c")),
        ]:
            start, before = time.perf_counter(), counted[0]
            call()
            pace[op] = (counted[0] - before) / (time.perf_counter() - start) / alone
    finally:
        stop.set()
        t.join()
    assert all(p > 0.3 for p in pace.values()), pace


def test_loaded_arrays_own_their_memory(tmp_path):
    ids = np.arange(1000, dtype=np.int64)
    emb = np.ones((1000, 8), dtype=np.float32)
    saver.save(tmp_path / "c", tables={"t": {"ids": ids, "emb": emb}})
    got = saver.load(tmp_path / "c").tables["t"]
    # A view of the core's buffer, not a copy: writable, and its base owns the memory.
    assert got["emb"].flags.writeable and got["emb"].base is not None
    got["emb"][0, 0] = 5.0
    assert got["emb"][0, 0] == 5.0


def test_a_background_save_shows_the_arrays_as_they_were_at_the_call(tmp_path):
    rng = np.random.default_rng(5)
    ids = np.arange(200_000, dtype=np.int64)
    emb = rng.standard_normal((200_000, 16)).astype(np.float32)
    w = np.ones((64, 64), dtype=np.float32)
    then_emb, then_w = emb.copy(), w.copy()
    stop = threading.Event()

    def train():
        # A training thread keeps changing the arrays while the save runs.
        k = 0
        while not stop.is_set():
            emb[k % len(emb)] += 1.0
            w[k % 64] -= 1.0
            k += 1

    h = saver.save_async(tmp_path / "c", tables={"t": {"ids": ids, "emb": emb}}, dense={"w": w}, step=3)
    t = threading.Thread(target=train)
    t.start()
    try:
        report = h.wait()
    finally:
        stop.set()
        t.join()
    assert report.committed and h.done()
    assert not np.array_equal(emb, then_emb), "the trainer ran during the save"
    loaded = saver.load(tmp_path / "c")
    got = by_id(loaded.tables["t"])
    np.testing.assert_array_equal(got["emb"], then_emb)
    np.testing.assert_array_equal(loaded.dense["w"], then_w)
    with pytest.raises(saver.SaverError, match="already waited"):
        h.wait()
    with pytest.raises(TypeError):
        saver.save_async(tmp_path / "d", shardz=2)


def test_a_manager_keeps_the_latest_steps_and_chains_whole_and_restarts_from_the_newest(tmp_path):
    root = tmp_path / "run"
    m = saver.Manager(root, full_every=3, keep_latest=2)
    assert m.latest() is None and m.load_latest() is None
    ids = np.arange(5000, dtype=np.int64)
    emb = np.zeros((5000, 8), dtype=np.float32)
    w = np.zeros(16, dtype=np.float32)
    for step in range(1, 8):
        emb[step * 100 : step * 100 + 50] += step  # a few rows change each step
        w += 1
        if step % 2:
            m.save_async(step, tables={"t": {"ids": ids, "emb": emb}}, dense={"w": w})
        else:
            m.save(step, tables={"t": {"ids": ids, "emb": emb}}, dense={"w": w})
    m.wait()
    steps = m.steps()
    assert [s["step"] for s in steps][-2:] == [6, 7]
    # Deltas were written, and every kept step's chain is whole.
    assert any(s["parent"] is not None for s in steps)
    kept = {s["step"] for s in steps}
    assert all(s["parent"] is None or s["parent"] in kept for s in steps)
    step, loaded = saver.Manager(root).load_latest()
    assert step == 7
    np.testing.assert_array_equal(by_id(loaded.tables["t"])["emb"], emb)
    np.testing.assert_array_equal(loaded.dense["w"], w)
    with pytest.raises(TypeError):
        m.save(8, tables={}, stepz=1)


def test_a_loads_memory_is_the_arrays_it_returns(tmp_path):
    # Peak RSS of a fresh process that loads a 260 MB checkpoint, against the bytes of the
    # arrays it gets: the core fills the arrays' own memory, with no second copy.
    import sys

    ids = np.arange(1_000_000, dtype=np.int64)
    emb = np.ones((1_000_000, 64), dtype=np.float32)
    saver.save(tmp_path / "c", tables={"t": {"ids": ids, "emb": emb}}, dense={"w": np.ones(1 << 20, np.float32)}, durable=False)
    code = (
        "import resource, sys, numpy, saver\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "l = saver.load(sys.argv[1])\n"
        "n = sum(a.nbytes for t in l.tables.values() for a in t.values()) + sum(a.nbytes for a in l.dense.values())\n"
        "print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True, capture_output=True, text=True)
    arrays, grew = map(int, out.stdout.split())
    assert arrays == ids.nbytes + emb.nbytes + 4 * (1 << 20)
    assert grew <= 1.15 * arrays + (32 << 20), f"peak RSS grew {grew >> 20} MiB for {arrays >> 20} MiB of arrays"


def test_deltas_filters_and_excluded_slots(tmp_path):
    ids = np.arange(1000, dtype=np.int64)
    emb = np.zeros((1000, 4), dtype=np.float32)
    freq = (ids % 10).astype(np.int64)
    saver.save(tmp_path / "full", tables={"t": {"ids": ids, "emb": emb, "freq": freq}})
    emb2 = emb.copy()
    emb2[:7] = 1.0
    r = saver.save(tmp_path / "delta", tables={"t": {"ids": ids, "emb": emb2, "freq": freq}}, parent=tmp_path / "full")
    assert r.rows == 7 and saver.open(tmp_path / "delta").is_delta
    got = by_id(saver.load(tmp_path / "delta").tables["t"])
    np.testing.assert_array_equal(got["emb"], emb2)
    # Only rows with freq >= 3, without the embedding slot.
    saver.save(tmp_path / "f", tables={"t": {"ids": ids, "emb": emb, "freq": freq}}, keep_rows="freq>=3", exclude_slots=["emb"])
    got = by_id(saver.load(tmp_path / "f").tables["t"])
    assert set(got) == {"ids", "freq"}
    np.testing.assert_array_equal(got["ids"], ids[freq >= 3])
    # Loaded without a slot, and without the dense tensors.
    got = saver.load(tmp_path / "full", exclude_slots="em*", dense=False)
    assert set(got.tables["t"]) == {"ids", "freq"} and got.dense == {}
    with pytest.raises(saver.SaverError, match="keep_rows"):
        saver.save(tmp_path / "g", tables={"t": {"ids": ids, "freq": freq}}, keep_rows="freq=>3")


@pytest.mark.parametrize("given, named", [(dict(wait=-1.0), "wait: "), (dict(wait=float("nan")), "wait: "),
                                          (dict(wait=8 * 24 * 3600.0), "wait: "), (dict(direct_io="sometimes"), "direct_io: "),
                                          (dict(compress="gzip"), "compress: ")])
def test_a_save_option_out_of_bounds_is_refused_by_name_as_the_command_line_refuses_it(tmp_path, given, named):
    # One mapping of save options (saver_io::SaveSettings) serves the package and `saver save`.
    ids = np.arange(10, dtype=np.int64)
    with pytest.raises(saver.SaverError, match=named):
        saver.save(tmp_path / "x", tables={"t": {"ids": ids, "e": np.zeros((10, 2), np.float32)}}, **given)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_s3_locations_work_as_directories_do(garage, tmp_path):
    rng = np.random.default_rng(9)
    ids = rng.choice(2**40, size=20000, replace=False).astype(np.int64)
    emb = rng.standard_normal((20000, 8)).astype(np.float32)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    url = f"{garage}/py/a"
    report = saver.save(url, tables={"t": {"ids": ids, "emb": emb}}, dense={"w": w}, shards=4, step=5)
    assert report.committed
    c = saver.open(url)
    assert c.step == 5 and c.tables["t"]["rows"] == 20000
    assert c.verify()["status"] == "ok"
    parts = [saver.load(url, shards=3, shard_index=j).tables["t"] for j in range(3)]
    whole = by_id({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    np.testing.assert_array_equal(whole["emb"], by_id({"ids": ids, "emb": emb})["emb"])
    np.testing.assert_array_equal(saver.load(url).dense["w"], w)
    # The same arrays saved locally have the same digest.
    saver.save(tmp_path / "local", tables={"t": {"ids": ids, "emb": emb}}, dense={"w": w})
    assert saver.digest(url) == saver.digest(tmp_path / "local")
    h = saver.save_async(f"{garage}/py/b", tables={"t": {"ids": ids, "emb": emb}})
    assert h.wait().committed
    with pytest.raises(saver.SaverError):
        saver.load(f"{garage}/py/nothing")


def test_a_vectorised_row_filter_is_called_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(saver, "_FILTER_ROWS", 1000)
    ids = np.arange(5000, dtype=np.int64)
    freq = ids % 7
    emb = np.repeat(ids[:, None], 3, axis=1).astype(np.float32)
    calls = []

    def keep(c):
        calls.append(len(c["ids"]))
        return (c["freq"] >= 3) & (c["emb"][:, 0] < 4000)

    saver.save(tmp_path / "c", tables={"t": {"ids": ids, "emb": emb, "freq": freq}}, row_filter=keep)
    assert calls == [1000] * 5
    got = by_id(saver.load(tmp_path / "c").tables["t"])
    want = (freq >= 3) & (ids < 4000)
    np.testing.assert_array_equal(got["ids"], ids[want])
    np.testing.assert_array_equal(got["emb"], emb[want])
    with pytest.raises(saver.InputError, match="bool array"):
        saver.save(tmp_path / "d", tables={"t": {"ids": ids}}, row_filter=lambda c: c["ids"])


def test_a_compressed_checkpoint_is_smaller_valid_safetensors_and_reads_as_the_raw_one(tmp_path):
    n = 100_000
    ids = np.arange(n, dtype=np.int64)
    emb = np.zeros((n, 16), dtype=np.float32)
    emb[::10] = np.random.default_rng(3).standard_normal((n // 10, 16)).astype(np.float32)
    tables = {"cat": {"ids": ids, "embedding": emb, "count": (ids % 7).astype(np.int64)}}
    saver.save(tmp_path / "raw", tables=tables, shards=2)
    report = saver.save(tmp_path / "zstd", tables=tables, shards=2, compress="zstd")
    raw_bytes = sum(os.path.getsize(f) for f in glob.glob(str(tmp_path / "raw" / "*")))
    assert report.bytes_written * 3 < raw_bytes
    # Same content to every reader: this package, the binary, and a load resharded.
    cli = subprocess.run([saver_bin(), "digest", str(tmp_path / "zstd")], check=True, capture_output=True, text=True).stdout.strip()
    assert saver.digest(tmp_path / "zstd") == saver.digest(tmp_path / "raw") == cli
    assert saver.verify(tmp_path / "zstd") == {"status": "ok", "problems": []}
    parts = [saver.load(tmp_path / "zstd", shards=3, shard_index=j).tables["cat"] for j in range(3)]
    whole = by_id({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    np.testing.assert_array_equal(whole["embedding"], emb)
    # The files stay safetensors: compressed tensors are bytes, named in the metadata.
    for f in glob.glob(str(tmp_path / "zstd" / "*.safetensors")):
        with safetensors.safe_open(f, "numpy") as st:
            codecs = st.metadata()["saver.codecs"].split(" ")
            assert len(codecs) == len(st.keys())
            # e.g. "zstd:shuffle4:F32:49828,16": codec, filter, raw dtype and shape.
            fields = [c.split(":") for c in codecs if c != "-"]
            assert any(f[0] == "zstd" and f[2] == "F32" and f[3].endswith(",16") for f in fields)
    with pytest.raises(saver.InputError):
        saver.save(tmp_path / "bad", tables=tables, compress="lz4")


def test_a_manager_saves_full_on_a_schema_change_and_on_request(tmp_path):
    ids = np.arange(100, dtype=np.int64)
    narrow = {"t": {"ids": ids, "emb": np.ones((100, 2), dtype=np.float32)}}
    wide = {"t": {"ids": ids, "emb": np.ones((100, 3), dtype=np.float32)}}
    m = saver.Manager(tmp_path / "run", full_every=8, max_chain_links=8)
    assert "no earlier step" in m.save(1, tables=narrow).full_because
    assert m.save(2, tables=narrow).full_because is None
    why = m.save(3, tables=wide).full_because
    assert "tables changed" in why and "emb" in why, why
    assert m.save(4, tables=wide).full_because is None
    assert "asked for" in m.save(5, tables=wide, full=True).full_because
    m.save_async(6, tables=wide, full=True)
    m.wait()
    assert m.latest()["parent"] is None


def test_a_managers_background_save_has_a_handle_and_the_root_its_tools(tmp_path):
    ids = np.arange(50, dtype=np.int64)
    tables = {"t": {"ids": ids, "emb": np.ones((50, 2), dtype=np.float32)}}
    m = saver.Manager(tmp_path / "run", full_every=1, keep_latest=5)
    handles = []
    for step in (10, 20, 30):
        h = m.save_async(step, tables=tables, metadata={"auc": str(step / 100)})
        assert not h.skipped and h.step == step
        handles.append(h)
    last = handles[-1].wait()
    assert last is not None and last.committed and handles[-1].done()
    # The earlier ones were waited for by the saves after them.
    assert handles[0].done() and handles[0].wait() is None
    assert [s["step"] for s in m.steps()] == [10, 20, 30]
    # Loads say which step, with its metadata.
    step, loaded = m.load_latest()
    assert step == 30 and loaded.report["step"] == 30
    assert loaded.report["metadata"] == {"auc": "0.3"}
    assert saver.load(m.latest()["path"]).report["step"] == 30
    assert m.prune(keep_latest=2, dry_run=True) == {"removed": [10], "kept": [20, 30]}
    assert [s["step"] for s in m.steps()] == [10, 20, 30]
    assert m.prune(keep_latest=2) == {"removed": [10], "kept": [20, 30]}
    assert m.clean() == {"reclaimed": [], "left_alone": []}
    # A damaged newest step: load_latest(fallback=True) goes back to the newest that verifies.
    newest = m.latest()["path"]
    data = next(f for f in os.listdir(newest) if f.endswith(".safetensors"))
    with open(os.path.join(newest, data), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xfe\xfd\xfc")
    with pytest.warns(saver.SaverWarning, match="step 30 does not verify"):
        step, loaded = m.load_latest(fallback=True)
    assert step == 20 and loaded.report["step"] == 20


def test_errors_speak_python_and_a_failed_save_leaves_nothing(tmp_path):
    ids = np.arange(100, dtype=np.int64)
    tables = {"t": {"ids": ids, "emb": np.ones((100, 2), dtype=np.float32)}}
    saver.save(tmp_path / "c", tables=tables)
    with pytest.raises(saver.SaverError) as e:
        saver.save(tmp_path / "c", tables=tables)
    assert "overwrite=True" in str(e.value) and "--overwrite" not in str(e.value)
    assert "SaveOptions" not in str(e.value)
    # A process given rows of another shard.
    with pytest.raises(saver.SaverError) as e:
        saver.save(tmp_path / "d", tables=tables, shards=2, shard_index=0, save_id="x1")
    assert 'foreign_rows="skip"' in str(e.value), str(e.value)
    assert "ForeignRows" not in str(e.value) and "PartitionRule" not in str(e.value)
    assert not (tmp_path / "d").exists(), os.listdir(tmp_path / "d")


def test_errors_speak_python_and_name_what_was_wrong(tmp_path):
    """The native layer's messages, as a Python caller sees them: they name the path, table or
    argument, and say what to pass in this package's terms, never a Rust type or a flag of the
    binary."""
    ids = np.arange(100, dtype=np.int64)
    emb = np.ones((100, 4), np.float32)
    table = {"t": {"ids": ids, "emb": emb}}
    saver.save(tmp_path / "a", tables=table)
    m = saver.Manager(tmp_path / "m")
    m.save(5, tables=table)
    calls = [
        (lambda: saver.save(tmp_path / "a", tables=table), "overwrite=True"),
        (lambda: saver.save(tmp_path / "b", tables=table, shards=2, shard_index=0, save_id="x"), 'foreign_rows="skip"'),
        (lambda: saver.save(tmp_path / "c", tables=table, parent=tmp_path / "none"), "none"),
        (lambda: saver.load(tmp_path / "a", tables=["zz"]), "'zz'"),
        (lambda: saver.save(tmp_path / "f", tables={"r": {"p": saver.Chunk(emb[:50], offset=(0, 0), shape=(100, 4))}}), '"r"'),
        (lambda: m.save(3, tables=table), "overwrite=True"),
        (lambda: saver.load(tmp_path / "a", shards=2, shard_index=5), "shard_index"),
        (lambda: saver.save(tmp_path / "g", tables=table, save_id="../x"), "save_id"),
        (lambda: saver.shard_of(np.zeros((2, 2), np.int64), 2), "ids"),
        (lambda: saver.save(tmp_path / "h", tables=table, direct_io="sometimes"), "direct_io"),
    ]
    for call, named in calls:
        with pytest.raises(saver.SaverError) as e:
            call()
        message = str(e.value)
        assert named in message, message
        for rust in ("::", "--", "SaveOptions", "ForeignRows", "Some(", "Vec<"):
            assert rust not in message, message


def test_a_panic_of_the_native_module_reaches_the_caller_as_a_saver_error(tmp_path):
    from saver import _native

    # What pyo3 raises when Rust code panics: a BaseException, which `except Exception` misses.
    PanicException = type("PanicException", (BaseException,), {"__module__": "pyo3_runtime"})

    def panics(*_):
        raise PanicException("already borrowed")

    try:
        _native._guard(panics, "load_rows")()
    except Exception as e:
        assert isinstance(e, saver.SaverError), e
        assert "native load_rows() failed unexpectedly" in str(e) and "already borrowed" in str(e)
    else:
        raise AssertionError("no error")
    # Other errors pass as they are; what the module hands back is guarded too.
    with pytest.raises(KeyboardInterrupt):
        _native._guard(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), "x")()
    assert isinstance(saver.Manager(tmp_path / "root")._native, _native._Guarded)
