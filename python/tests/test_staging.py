"""The staging ring of the host seam (saver/_staging.py): device tensors reach the writers a
chunk at a time through a bounded ring of host buffers. Without a GPU these tests run it with
its CPU stand-in (SAVER_STAND_IN_DEVICE=1: CPU torch tensors are staged as device tensors, their
copies run on a thread of their own); on a machine with CUDA the last tests run it for real."""

import threading

import numpy as np
import pytest
import torch

import saver
from saver import _staging


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setenv("SAVER_STAND_IN_DEVICE", "1")


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = {
        "big": torch.randn(3_000_001, generator=g),  # 12 MB: not a whole number of buffers
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "flags": torch.rand(33, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "host": np.arange(10, dtype=np.int32),  # a numpy array beside: read in place
        "strided": torch.arange(100, dtype=torch.int64).reshape(10, 10)[:, ::3],
    }
    rows = torch.randn(2000, 64, generator=g)
    tables = {"emb": {"w": [saver.Chunk(rows[:1500], offset=(0, 0), shape=(2000, 64)), saver.Chunk(rows[1500:], offset=(1500, 0), shape=(2000, 64))]}}
    return tables, dense


def test_a_staged_save_holds_the_bytes_of_one_read_in_place(tmp_path, monkeypatch):
    monkeypatch.delenv("SAVER_STAND_IN_DEVICE", raising=False)
    tables, dense = _state()
    plain = saver.save(tmp_path / "plain", tables, dense)
    assert plain.staged_bytes == 0 and plain.staging_bytes == 0
    monkeypatch.setenv("SAVER_STAND_IN_DEVICE", "1")
    staged = saver.save(tmp_path / "staged", tables, dense, parallel=4)
    assert saver.digest(tmp_path / "staged") == saver.digest(tmp_path / "plain")
    dense_bytes = sum(t.numel() * t.element_size() for t in dense.values() if torch.is_tensor(t))
    chunk_bytes = 2000 * 64 * 4
    torch_bytes = dense_bytes + chunk_bytes
    # Every byte goes through the ring once: a dense tensor's CRC32, which every process of a
    # save records for their agreement, is that of the pieces its writers read, combined.
    assert staged.staged_bytes == dense_bytes + chunk_bytes
    # The default bound: the smaller of 256 MiB and 1/8 of the staged bytes.
    assert staged.staging_bytes <= torch_bytes // 8
    loaded = saver.load(tmp_path / "staged")
    assert np.array_equal(loaded.dense["big"], dense["big"].numpy())
    assert np.array_equal(loaded.dense["strided"], dense["strided"].contiguous().numpy())


@pytest.mark.parametrize("parallel", [1, 2, 8])
def test_the_ring_never_holds_more_than_its_bound_however_many_writers_read(tmp_path, stand_in, parallel):
    tables, dense = _state(seed=parallel)
    bound = 256 << 10  # two buffers of 128 KiB for 20 MB of tensors
    report = saver.save(tmp_path / "ck", tables, dense, parallel=parallel, staging_bytes=bound)
    ring = _staging._ring
    assert report.staging_bytes == bound == ring.capacity
    assert ring.allocated <= bound and ring.most_in_use <= ring.slots == 2
    back = saver.load(tmp_path / "ck")
    assert np.array_equal(back.tables["emb"]["w"], torch.cat([c.values for c in tables["emb"]["w"]]).numpy())
    # The next save of the same size reuses the ring's buffers.
    again = saver.save(tmp_path / "again", tables, dense, parallel=parallel, staging_bytes=bound)
    assert _staging._ring is ring and again.staged_bytes == report.staged_bytes


def test_a_freed_tensor_fails_the_save_by_name_and_nothing_is_committed(tmp_path, stand_in):
    tables, dense = _state()
    gone = torch.ones(1000)
    gone.untyped_storage().resize_(0)  # as TorchRec's memory stashing leaves a table mid-step
    with pytest.raises(saver.InputError, match=r"dense tensor 'gone'.*freed"):
        saver.save(tmp_path / "ck", tables, {**dense, "gone": gone})
    assert not (tmp_path / "ck").exists()


def test_a_tensor_freed_while_its_save_reads_it_fails_that_save_and_commits_nothing(tmp_path, stand_in, monkeypatch):
    tables, dense = _state()
    victim = dense["big"]
    check = _staging.check_storage
    seen = {"n": 0}
    lock = threading.Lock()

    def freed_after_a_while(tensor, what):
        # From its sixth check on, the tensor reads as freed, as TorchRec's memory stashing
        # leaves a table mid-step. (Freed for real, a CPU tensor's pages are unmapped and the
        # stand-in's copy faults; CUDA's caching allocator keeps the block, which is why the
        # ring checks after each copy too.)
        if tensor.data_ptr() == victim.data_ptr():
            with lock:
                seen["n"] += 1
                if seen["n"] > 5:
                    raise saver.InputError(f"{what}: its storage on {tensor.device} is freed or resized to 0 bytes")
        return check(tensor, what)

    monkeypatch.setattr(_staging, "check_storage", freed_after_a_while)
    with pytest.raises(saver.SaverError, match=r"dense tensor 'big'.*freed"):
        saver.save(tmp_path / "ck", tables, dense, staging_bytes=256 << 10)
    assert seen["n"] > 5, "the ring checked the tensor during the save"
    with pytest.raises(saver.SaverError):
        saver.open(tmp_path / "ck")
    assert _staging._ring._in_use == 0


@pytest.mark.parametrize("how", ["device copy", "host copy: no room", "host copy: asked"])
def test_a_background_save_of_staged_tensors_holds_its_moment(tmp_path, stand_in, monkeypatch, how):
    tables, dense = _state()
    staged = sum(t.numel() * t.element_size() for t in dense.values() if torch.is_tensor(t)) + 2000 * 64 * 4
    options = {}
    if how == "host copy: no room":
        monkeypatch.setenv("SAVER_STAND_IN_DEVICE_FREE", str(staged))  # a tenth short
    if how == "host copy: asked":
        options["device_copy"] = False
    before = {k: v.clone() for k, v in dense.items() if torch.is_tensor(v)}
    rows_before = torch.cat([c.values for c in tables["emb"]["w"]]).clone()
    # The save's reads after the call wait until training has changed every tensor.
    trained = threading.Event()
    read_into = _staging.StagedTensor.read_into

    def read_after_training(self, offset, address, length):
        if self.lasting:
            trained.wait(30)
        return read_into(self, offset, address, length)

    monkeypatch.setattr(_staging.StagedTensor, "read_into", read_after_training)
    handle = saver.save_async(tmp_path / "ck", tables, dense, **options)
    for v in list(dense.values()) + [c.values for c in tables["emb"]["w"]]:
        if torch.is_tensor(v) and v.numel() and v.dtype != torch.bool:
            v.add_(1)  # training goes on once the call returns
    trained.set()
    report = handle.wait()
    assert report.moment == how.split(":")[0]
    assert report.device_copy_bytes == (staged if how == "device copy" else 0)
    assert report.staged_bytes > 0
    back = saver.load(tmp_path / "ck")
    assert np.array_equal(back.dense["big"], before["big"].numpy())
    assert np.array_equal(back.tables["emb"]["w"], rows_before.numpy())


def test_device_copy_is_checked_by_name(tmp_path, stand_in):
    tables, dense = _state()
    with pytest.raises(saver.InputError, match="device_copy"):
        saver.save_async(tmp_path / "ck", tables, dense, device_copy="yes")
    assert not (tmp_path / "ck").exists()


def test_staging_bytes_is_checked_by_name(tmp_path, stand_in):
    tables, dense = _state()
    for bad in (0, -1, 1000, "1MiB", True):
        with pytest.raises(saver.InputError, match="staging_bytes"):
            saver.save(tmp_path / "ck", tables, dense, staging_bytes=bad)
    assert not (tmp_path / "ck").exists()


def test_a_torch_model_saved_through_the_ring_loads_bitwise_through_the_bound_it_is_given(tmp_path, stand_in, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Embedding(5000, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.Adagrad(model.parameters())
    model(torch.arange(10)).sum().backward()
    opt.step()
    report = saver.torch.save(tmp_path / "ck", model, opt)
    assert report.staged_bytes >= sum(p.numel() * 4 for p in model.parameters())
    assert report.staging_bytes < report.staged_bytes
    back = torch.nn.Sequential(torch.nn.Embedding(5000, 32), torch.nn.Linear(32, 8))
    back_opt = torch.optim.Adagrad(back.parameters())
    saver.torch.load(tmp_path / "ck", back, back_opt)
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    # saver.torch.load lands through the bound it is given: its table (and the table's
    # Adagrad sums) in rounds of half of it each.
    landings = []
    made = _staging.Landing.__init__

    def recorded(self, *args, **kwargs):
        made(self, *args, **kwargs)
        landings.append(self)

    monkeypatch.setattr(_staging.Landing, "__init__", recorded)
    again = torch.nn.Sequential(torch.nn.Embedding(5000, 32), torch.nn.Linear(32, 8))
    again_opt = torch.optim.Adagrad(again.parameters())
    saver.torch.load(tmp_path / "ck", again, again_opt, staging_bytes=64 << 10)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert [x.staging_bytes for x in landings] == [64 << 10]
    assert landings[0].rounds >= 2 * 5000 * 32 * 4 // (32 << 10), landings[0].rounds
    with pytest.raises(saver.InputError, match="staging_bytes"):
        saver.torch.load(tmp_path / "ck", again, again_opt, staging_bytes=100)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_a_cuda_model_is_saved_through_pinned_buffers_after_the_queued_work(tmp_path):
    x = torch.zeros(8 << 20, device="cuda")
    # Queued on the current stream: the save's copies must come after it.
    x.add_(1)
    y = torch.full((1000, 64), 2.0, device="cuda")
    report = saver.save(tmp_path / "ck", {"t": {"w": saver.Chunk(y)}}, {"x": x})
    assert report.staged_bytes == x.numel() * 4 + y.numel() * 4 and _staging._ring.pinned
    back = saver.load(tmp_path / "ck")
    assert (back.dense["x"] == 1).all() and (back.tables["t"]["w"] == 2).all()


def _corrupt_last_rows(path):
    data = list(path.rglob("*.safetensors"))
    assert len(data) == 1
    raw = bytearray(data[0].read_bytes())
    raw[-100] ^= 0xFF
    data[0].write_bytes(bytes(raw))


def test_a_load_lands_device_targets_in_bounded_rounds_beside_host_targets(tmp_path, stand_in):
    rows = torch.arange(2000 * 64, dtype=torch.float32).reshape(2000, 64)
    other = np.arange(300 * 8, dtype=np.int64).reshape(300, 8)
    saver.save(tmp_path / "ck", {"emb": {"w": saver.Chunk(rows)}, "host": {"v": saver.Chunk(other)}}, {"d": np.ones(5, np.float32)})
    a, b = torch.zeros(1000, 64), torch.zeros(1000, 32)
    host = np.zeros((300, 8), np.int64)
    bound = 64 << 10
    loaded = saver.load(tmp_path / "ck", staging_bytes=bound, into={
        "emb": {"w": [saver.Chunk(a, offset=(0, 0)), saver.Chunk(b, offset=(1000, 32))]},
        "host": {"v": saver.Chunk(host)},  # a numpy target of the same load: filled in place
    })
    assert torch.equal(a, rows[:1000]) and torch.equal(b, rows[1000:, 32:])
    assert np.array_equal(host, other) and np.array_equal(loaded.dense["d"], np.ones(5, np.float32))
    landed = (a.numel() + b.numel()) * 4
    assert loaded.report["landed_bytes"] == landed
    # Two buffers of half the bound: as many rounds as it takes to carry the bytes through one.
    assert loaded.report["landing_bytes"] == bound
    assert loaded.report["landing_rounds"] == -(-landed // (bound // 2))
    # The rows read for the device targets and the host one, counted over every round.
    assert loaded.report["row_tables"]["bytes_wanted"] == landed + other.nbytes


def test_a_row_wider_than_the_bound_lands_whole_and_the_report_says_what_it_held(tmp_path, stand_in):
    rows = torch.randn(6, 100_000)
    saver.save(tmp_path / "ck", {"wide": {"w": saver.Chunk(rows)}})
    into = torch.zeros(6, 100_000)
    loaded = saver.load(tmp_path / "ck", staging_bytes=64 << 10, into={"wide": {"w": saver.Chunk(into)}})
    assert torch.equal(into, rows)
    assert loaded.report["landing_rounds"] == 6 and loaded.report["landing_bytes"] == 2 * 400_384


def test_the_next_round_reads_while_the_last_one_copies_to_the_device(tmp_path, stand_in, monkeypatch):
    rows = torch.randn(4000, 64)
    saver.save(tmp_path / "ck", {"emb": {"w": saver.Chunk(rows)}})
    events = []
    start, finish = _staging._StandInCopies.start, _staging._StandInCopies.finish

    def logged_start(self, dst, src):
        future = start(self, dst, src)
        events.append(("copy", id(future)))
        return future

    def logged_finish(future):
        events.append(("done", id(future)))
        finish(future)

    monkeypatch.setattr(_staging._StandInCopies, "start", logged_start)
    monkeypatch.setattr(_staging._StandInCopies, "finish", staticmethod(logged_finish))
    ck = saver.open(tmp_path / "ck")

    class Reads:
        def __init__(self, native):
            self._native = native

        def load(self, *args):
            events.append(("read", None))
            return self._native.load(*args)

        def __getattr__(self, name):
            return getattr(self._native, name)

    ck._native = Reads(ck._native)
    into = torch.zeros(4000, 64)
    loaded = ck.load(staging_bytes=128 << 10, into={"emb": {"w": saver.Chunk(into)}})
    assert torch.equal(into, rows) and loaded.report["landing_rounds"] >= 8
    # Every copy is waited for only after the next round's read was started (double
    # buffering), and before its buffer is read into again (two rounds on).
    reads = [i for i, (kind, _) in enumerate(events) if kind == "read"]
    for i, (kind, handle) in enumerate(events):
        if kind != "copy":
            continue
        done = events.index(("done", handle), i)
        between = [r for r in reads if i < r < done]
        assert len(between) == 1 or (not between and not [r for r in reads if r > i]), events


def test_a_corrupt_round_fails_the_load_by_name_after_the_rounds_before_it_landed(tmp_path, stand_in):
    rows = torch.arange(2000 * 64, dtype=torch.float32).reshape(2000, 64)
    saver.save(tmp_path / "ck", {"emb": {"w": saver.Chunk(rows)}})
    _corrupt_last_rows(tmp_path / "ck")
    # One round for the whole load: it fails before any byte reaches the device targets.
    c, d = torch.full((1000, 64), -1.0), torch.full((1000, 64), -1.0)
    with pytest.raises(saver.SaverError, match="emb"):
        saver.load(tmp_path / "ck", staging_bytes=4 << 20, into={"emb": {"w": [saver.Chunk(c, offset=(0, 0)), saver.Chunk(d, offset=(1000, 0))]}})
    assert (c == -1).all() and (d == -1).all()
    # Bounded rounds: those read before the corrupt one were checked and landed; the corrupt
    # round's rows never reach the device, and the error says the load stopped.
    with pytest.raises(saver.SaverError, match="emb"):
        saver.load(tmp_path / "ck", staging_bytes=64 << 10, into={"emb": {"w": [saver.Chunk(c, offset=(0, 0)), saver.Chunk(d, offset=(1000, 0))]}})
    assert torch.equal(c, rows[:1000])
    assert (d[-1] == -1).all()
    # The buffers went back: a good load of the same size runs through them.
    e = torch.zeros(1000, 64)
    saver.load(tmp_path / "ck", staging_bytes=64 << 10, into={"emb": {"w": saver.Chunk(e, offset=(0, 0))}})
    assert torch.equal(e, rows[:1000])


def test_staging_bytes_of_a_load_is_checked_by_name(tmp_path, stand_in):
    saver.save(tmp_path / "ck", {"emb": {"w": saver.Chunk(np.zeros((4, 4), np.float32))}})
    with pytest.raises(saver.InputError, match="staging_bytes"):
        saver.load(tmp_path / "ck", staging_bytes=100)


def test_a_tensor_on_a_device_saver_cannot_stage_is_refused_by_name(tmp_path):
    meta = torch.empty(10, device="meta")
    with pytest.raises(saver.InputError, match=r"dense tensor 'm' is on meta; saver stages CUDA tensors"):
        saver.save(tmp_path / "ck", dense={"m": meta})
    assert not (tmp_path / "ck").exists()
    # The options are checked whatever the tensors' devices.
    with pytest.raises(saver.InputError, match="staging_bytes"):
        saver.save(tmp_path / "ck", dense={"a": np.zeros(3, np.float32)}, staging_bytes=10)


def test_a_copy_that_fails_halfway_fails_the_save_commits_nothing_and_frees_the_ring(tmp_path, stand_in, monkeypatch):
    tables, dense = _state()
    # Copies that take a while, so that the writers wait for buffers (backpressure).
    monkeypatch.setenv("SAVER_STAND_IN_DEVICE_LATENCY", "0.002")
    finish = _staging._StandInCopies.finish
    calls = {"n": 0}
    lock = threading.Lock()

    def failing_finish(future):
        finish(future)
        with lock:
            calls["n"] += 1
            if calls["n"] == 40:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(_staging._StandInCopies, "finish", staticmethod(failing_finish))
    with pytest.raises(saver.SaverError, match="illegal memory access"):
        saver.save(tmp_path / "ck", tables, dense, staging_bytes=256 << 10, parallel=4)
    with pytest.raises(saver.SaverError):
        saver.open(tmp_path / "ck")
    ring = _staging._ring
    assert ring._in_use == 0 and len(ring._free) == ring._made <= ring.slots, "every buffer back in the ring"
    # The ring serves the next save as before.
    monkeypatch.setattr(_staging._StandInCopies, "finish", staticmethod(finish))
    saver.save(tmp_path / "ok", tables, dense, staging_bytes=256 << 10, parallel=4)
    monkeypatch.delenv("SAVER_STAND_IN_DEVICE")
    saver.save(tmp_path / "plain", tables, dense)
    assert saver.digest(tmp_path / "ok") == saver.digest(tmp_path / "plain")
