"""saver behind DCP's own API (saver/dcp.py): dcp.save and dcp.load through saver's
StorageWriter and StorageReader, with DCP's own FileSystemWriter/FileSystemReader as the
oracle: the same state dict saved both ways, loaded both ways, compared bitwise."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import saver
import saver.dcp

sys.path.insert(0, os.path.dirname(__file__))
import gloo_ranks  # noqa: E402


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "emb.weight": torch.randn(300, 16, generator=g),
            "conv.weight": torch.randn(6, 3, 5, 5, generator=g),  # 4-d: stored as 6 x 75
            "bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "scale": torch.tensor(1.5 + seed, dtype=torch.float64),  # 0-d
            "mask": torch.rand(40, generator=g) > 0.5,
            "count": torch.arange(12, dtype=torch.int64).reshape(3, 4) * (seed + 1),
        },
        "optim": {"state": {"0": {"exp_avg": torch.randn(300, 16, generator=g), "step": torch.tensor(float(seed))}},
                  "param_groups": [{"lr": 0.01 * (seed + 1), "params": ["0"]}]},
        # Not a tensor: DCP's planner writes it as a BYTE_IO item.
        "extra": {"epoch": 3 + seed, "note": f"seed {seed}"},
    }


def _raised(excinfo):
    """The exception a rank raised inside DCP, which wraps it in a CheckpointException."""
    e = excinfo.value
    failures = getattr(e, "failures", None)
    if not failures:
        return e
    first = next(iter(failures.values()))
    return first[0] if isinstance(first, tuple) else first


def _zeros_like(state):
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    if torch.is_tensor(state):
        return torch.zeros_like(state)
    return None if not isinstance(state, (int, float, str)) else type(state)()


def _assert_same(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    else:
        assert a == b, where


def test_a_state_dict_saved_through_saver_loads_bitwise_as_dcps_own_files_do(tmp_path):
    state = _state(0)
    dcp.save(state, storage_writer=saver.dcp.StorageWriter(tmp_path / "saver"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    ours, theirs = _zeros_like(state), _zeros_like(state)
    dcp.load(ours, storage_reader=saver.dcp.StorageReader(tmp_path / "saver"))
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
    _assert_same(ours, state)
    _assert_same(ours, theirs)
    # A saver checkpoint like any other: verified, opened, loaded without DCP.
    assert saver.verify(tmp_path / "saver")["status"] == "ok"
    ck = saver.open(tmp_path / "saver")
    assert "model.emb.weight" in ck.row_tables and not ck.dense
    plain = saver.load(tmp_path / "saver", tables=["model.emb.weight"])
    assert np.array_equal(plain.tables["model.emb.weight"]["value"], state["model"]["emb.weight"].numpy())
    # saver's own tools, which know nothing of DCP: resharded to 3 shards, the same content,
    # and DCP's load reads the new checkpoint as it read the old.
    bin_ = os.environ.get("SAVER_BIN")
    assert bin_ and os.path.exists(bin_), "SAVER_BIN must name the saver binary (python/tests/run.sh sets it)"
    subprocess.run([bin_, "reshard", str(tmp_path / "saver"), "--out", str(tmp_path / "three"), "--shards", "3"], check=True, capture_output=True)
    assert saver.digest(tmp_path / "three") == saver.digest(tmp_path / "saver")
    again = _zeros_like(state)
    dcp.load(again, storage_reader=saver.dcp.StorageReader(tmp_path / "three"))
    _assert_same(again, state)


def test_checkpoint_id_names_the_path_and_a_resave_replaces_the_old_checkpoint_at_its_commit(tmp_path):
    path = tmp_path / "ck"
    dcp.save(_state(0), checkpoint_id=str(path), storage_writer=saver.dcp.StorageWriter())
    first = saver.open(path).save_id
    dcp.save(_state(1), checkpoint_id=str(path), storage_writer=saver.dcp.StorageWriter())
    assert saver.open(path).save_id != first
    back = _zeros_like(_state(1))
    dcp.load(back, checkpoint_id=str(path), storage_reader=saver.dcp.StorageReader())
    _assert_same(back, _state(1))
    # Nothing of the first save is left beside the second.
    assert not [p for p in path.rglob("*") if first in p.name]
    # Without overwrite a committed checkpoint is kept, and the save says why.
    with pytest.raises(CheckpointException) as e:
        dcp.save(_state(2), storage_writer=saver.dcp.StorageWriter(path, overwrite=False))
    assert isinstance(_raised(e), saver.SaverError) and "already holds a committed checkpoint" in str(_raised(e))
    again = _zeros_like(_state(1))
    dcp.load(again, storage_reader=saver.dcp.StorageReader(path))
    _assert_same(again, _state(1))


def test_a_flipped_byte_in_any_data_file_fails_the_load_naming_the_tensor(tmp_path):
    state = {"w": torch.randn(4000, 16), "v": torch.randn(3000)}
    dcp.save(state, storage_writer=saver.dcp.StorageWriter(tmp_path / "saver"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    ours = next((tmp_path / "saver").rglob("*.safetensors"))
    theirs = next((tmp_path / "dcp").glob("*.distcp"))
    raw = bytearray(ours.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    ours.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as e:
        dcp.load(_zeros_like(state), storage_reader=saver.dcp.StorageReader(tmp_path / "saver"))
    assert isinstance(_raised(e), saver.SaverError), _raised(e)
    assert "CRC32" in str(_raised(e)) and ('table "w"' in str(_raised(e)) or 'table "v"' in str(_raised(e))), _raised(e)
    # DCP's own files carry no checksum: the same flip in them loads silently.
    raw = bytearray(theirs.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    theirs.write_bytes(bytes(raw))
    back = _zeros_like(state)
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
    assert not (torch.equal(back["w"], state["w"]) and torch.equal(back["v"], state["v"]))


def test_a_checkpoint_saver_dcp_did_not_write_is_refused_by_name(tmp_path):
    saver.save(tmp_path / "ck", dense={"a": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointException) as e:
        dcp.load({"a": torch.zeros(3)}, storage_reader=saver.dcp.StorageReader(tmp_path / "ck"))
    # DCP words a failed metadata read its own way, our reason inside.
    assert "not a checkpoint saver.dcp wrote (its metadata has no 'dcp')" in str(_raised(e))


def test_a_tensor_cut_past_its_first_dimension_is_refused_by_name(tmp_path):
    with pytest.raises(saver.InputError, match="conv: a chunk .* cut along a dimension past the first"):
        saver.dcp._stored_chunk((4, 6, 5), (0, 3, 0), (4, 3, 5), "conv")


# --- ranks: DTensors as FSDP2 shards them, saved at 2 ranks and loaded at 1 and 3 ---------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _whole(seed):
    g = torch.Generator().manual_seed(100 + seed)
    return {"rows": torch.randn(10, 6, generator=g), "cols": torch.randn(5, 9, generator=g),
            "both": torch.randn(7, 4, 3, generator=g), "same": torch.randn(11, generator=g)}


def _dtensor_state(whole, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {
        "rows": distribute_tensor(whole["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(whole["cols"], mesh, [Shard(1)]),
        "both": distribute_tensor(whole["both"], mesh, [Shard(0)]),
        "same": distribute_tensor(whole["same"], mesh, [Replicate()]),
        "sched": {"last_epoch": 9, "lrs": [0.5, 0.25]},
    }


def _rank(rank, world, port, path, oracle, save, out):
    from torch.distributed.tensor import DTensor

    with gloo_ranks.group(rank, world, port):
        whole = _whole(0)
        state = _dtensor_state(whole if save else {k: torch.zeros_like(v) for k, v in whole.items()}, world)
        if not save:
            state["sched"] = {"last_epoch": 0, "lrs": [0.0, 0.0]}
        if save:
            dcp.save(state, storage_writer=saver.dcp.StorageWriter(path))
            dcp.save(state, storage_writer=dcp.FileSystemWriter(oracle))
            return
        dcp.load(state, storage_reader=saver.dcp.StorageReader(path))
        theirs = _dtensor_state({k: torch.zeros_like(v) for k, v in whole.items()}, world)
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(oracle))
        for k, v in state.items():
            if isinstance(v, DTensor):
                assert torch.equal(v.to_local(), theirs[k].to_local()), k
                assert torch.equal(v.full_tensor(), whole[k]), k
        assert state["sched"] == {"last_epoch": 9, "lrs": [0.5, 0.25]} == theirs["sched"]
        torch.save({k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}, os.path.join(out, f"{rank}.pt"))


def _ranks(world, path, oracle, save, out):
    os.makedirs(out, exist_ok=True)
    mp.spawn(_rank, args=(world, _free_port(), str(path), str(oracle), save, str(out)), nprocs=world, join=True)


@pytest.mark.parametrize("load_world", [1, 3])
def test_dtensors_saved_at_two_ranks_load_at_one_and_three_bitwise_as_dcps_own(tmp_path, load_world):
    _ranks(2, tmp_path / "saver", tmp_path / "dcp", True, tmp_path / "out")
    # One save of two shards, committed once: verified like any saver checkpoint.
    assert saver.verify(tmp_path / "saver")["status"] == "ok"
    ck = saver.open(tmp_path / "saver")
    assert ck.save_id.startswith("dcp-")
    _ranks(load_world, tmp_path / "saver", tmp_path / "dcp", False, tmp_path / "out")
    assert len(list((tmp_path / "out").glob("*.pt"))) == load_world
    # And by the command line, which knows nothing of DCP.
    bin_ = os.environ.get("SAVER_BIN")
    assert bin_ and os.path.exists(bin_), "SAVER_BIN must name the saver binary (python/tests/run.sh sets it)"
    out = subprocess.run([bin_, "inspect", str(tmp_path / "saver")], capture_output=True, text=True)
    assert out.returncode == 0 and "both" in out.stdout, out.stderr


def test_dcp_async_save_through_saver_holds_the_state_of_its_call(tmp_path):
    state = _state(3)
    future = dcp.async_save(state, storage_writer=saver.dcp.StorageWriter(tmp_path / "ck"))
    # DCP's stager copied the state before the call returned: a write now is not saved.
    with torch.no_grad():
        state["model"]["emb.weight"].add_(1)
    future.result()
    back = _zeros_like(state)
    dcp.load(back, storage_reader=saver.dcp.StorageReader(tmp_path / "ck"))
    _assert_same(back, _state(3))


def test_use_collectives_false_needs_a_save_id_and_without_every_rank_commits_nothing(tmp_path):
    with pytest.raises((CheckpointException, saver.InputError)) as e:
        dcp.save(_state(0), storage_writer=saver.dcp.StorageWriter(tmp_path / "ck"), use_collectives=False)
    assert "save_id" in str(_raised(e))
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").rglob("*.safetensors"))
    # One committed checkpoint, then rank 0 of a save of two ranks without collectives: the
    # old checkpoint stays, since the save commits only once its last shard is durable.
    dcp.save(_state(1), storage_writer=saver.dcp.StorageWriter(tmp_path / "ck"))
    dcp.save(_state(2), storage_writer=saver.dcp.StorageWriter(tmp_path / "ck", save_id="half-1", world_size=2),
             use_collectives=False)
    back = _zeros_like(_state(1))
    dcp.load(back, storage_reader=saver.dcp.StorageReader(tmp_path / "ck"))
    _assert_same(back, _state(1))


def _whole_nocoll(seed):
    g = torch.Generator().manual_seed(200 + seed)
    return {"rows": torch.randn(10, 6, generator=g), "cols": torch.randn(5, 9, generator=g),
            "deep": torch.randn(4, 6, 3, generator=g), "same": torch.randn(11, generator=g),
            "scale": torch.tensor(2.5 + seed)}


def _nocoll_state(whole, world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {
        "rows": distribute_tensor(whole["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(whole["cols"], mesh, [Shard(1)]),
        # Cut past its first dimension: each rank's chunk is a table of its own in this mode.
        "deep": distribute_tensor(whole["deep"], mesh, [Shard(1)]),
        "same": distribute_tensor(whole["same"], mesh, [Replicate()]),
        "scale": whole["scale"].clone(),
        "sched": {"last_epoch": 4},
    }


def _nocoll_rank(rank, world, port, path, save_id, save, out):
    from torch.distributed.tensor import DTensor

    with gloo_ranks.group(rank, world, port):
        whole = _whole_nocoll(0)
        if save:
            state = _nocoll_state(whole, world)
            dcp.save(state, storage_writer=saver.dcp.StorageWriter(path, save_id=save_id), use_collectives=False)
            return
        state = _nocoll_state({k: torch.zeros_like(v) for k, v in whole.items()}, world)
        state["sched"] = {"last_epoch": 0}
        dcp.load(state, storage_reader=saver.dcp.StorageReader(path))
        for k, v in state.items():
            if isinstance(v, DTensor):
                assert torch.equal(v.full_tensor(), whole[k]), k
        assert torch.equal(state["scale"], whole["scale"]) and state["sched"] == {"last_epoch": 4}
        with open(os.path.join(out, f"{rank}.ok"), "w") as f:
            f.write("ok")


def test_use_collectives_false_commits_one_save_of_every_rank_that_loads_at_any_number_of_ranks(tmp_path):
    path, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    mp.spawn(_nocoll_rank, args=(2, _free_port(), str(path), "job7-step3", True, str(out)), nprocs=2, join=True)
    # One save of two shards, committed once by saver's protocol, under the caller's id.
    assert saver.verify(path)["status"] == "ok"
    assert saver.open(path).save_id == "job7-step3"
    for world in (1, 3):
        mp.spawn(_nocoll_rank, args=(world, _free_port(), str(path), None, False, str(out)), nprocs=world, join=True)
    assert len(list(out.glob("*.ok"))) == 3
    # The same id again is another save's: refused, the checkpoint kept.
    with pytest.raises((CheckpointException, saver.SaverError)):
        dcp.save({"x": torch.zeros(3)}, storage_writer=saver.dcp.StorageWriter(path, save_id="job7-step3"), use_collectives=False)
    assert saver.open(path).save_id == "job7-step3"
    # And out to DCP's stock reader, which knows nothing of saver's tables.
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    done = saver.dcp.export_hf(path, tmp_path / "hf", piece_bytes=40)
    assert done["skipped"] == ["sched.last_epoch"], done
    whole = _whole_nocoll(0)
    back = {k: torch.zeros_like(v) for k, v in whole.items()}
    dcp.load(back, storage_reader=HuggingFaceStorageReader(str(tmp_path / "hf")), no_dist=True)
    for k in whole:
        assert torch.equal(back[k], whole[k]), k


_RESAVER = """
import sys, torch, torch.distributed.checkpoint as dcp, saver.dcp
path = sys.argv[1]
k = int(sys.argv[2])
while True:
    k += 1
    state = {"a": torch.full((4000, 512), float(k)), "b": torch.full((3, 500, 7), float(k)),
             "k": {"step": k}}
    dcp.save(state, storage_writer=saver.dcp.StorageWriter(path))
    print(k, flush=True)
"""


def test_a_resave_killed_at_any_moment_leaves_the_old_checkpoint_or_the_new_never_a_mixture(tmp_path):
    import random
    import signal
    import time
    import warnings

    warnings.simplefilter("ignore")
    script = tmp_path / "resave.py"
    script.write_text(_RESAVER)
    path = tmp_path / "ck"
    rng = random.Random(7)
    rounds = int(os.environ.get("SAVER_RACE_ROUNDS", "8"))
    committed, seen = 0, set()
    for r in range(rounds):
        child = subprocess.Popen([sys.executable, str(script), str(path), str(committed)], stdout=subprocess.PIPE, text=True)
        # Wait for one save to land, then kill at a varied moment within the next ones.
        first = child.stdout.readline()
        assert first, f"round {r}: the saving process died before its first save"
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait()
        done = [int(first)] + [int(line) for line in child.stdout.read().split()]
        back = {"a": torch.zeros(4000, 512), "b": torch.zeros(3, 500, 7), "k": {"step": 0}}
        dcp.load(back, storage_reader=saver.dcp.StorageReader(path))
        k = back["k"]["step"]
        # The newest save reported, or the one after it (committed, killed before it said so).
        assert k in (done[-1], done[-1] + 1), (k, done)
        assert (back["a"] == k).all() and (back["b"] == k).all(), f"round {r}: a mixture of saves around {k}"
        assert saver.verify(path)["status"] == "ok"
        seen.add(k)
        committed = k
    assert len(seen) == rounds


def test_a_manager_takes_dcp_saves_as_steps_and_loads_its_newest(tmp_path):
    m = saver.Manager(tmp_path / "run")
    for step in (10, 20):
        dcp.save(_state(step), storage_writer=saver.dcp.StorageWriter(m, step=step))
    assert [s["step"] for s in m.steps()] == [10, 20]
    back = _zeros_like(_state(20))
    dcp.load(back, storage_reader=saver.dcp.StorageReader(m))
    _assert_same(back, _state(20))
    older = _zeros_like(_state(10))
    dcp.load(older, storage_reader=saver.dcp.StorageReader(m, step=10))
    _assert_same(older, _state(10))
    with pytest.raises(saver.InputError, match="step: a Manager saves steps"):
        saver.dcp.StorageWriter(m)
    with pytest.raises(saver.InputError, match="holds no committed step 30"):
        saver.dcp.StorageReader(m, step=30)


def test_a_checkpoint_of_dcps_own_files_imports_into_saver_tensor_by_tensor(tmp_path):
    state = _state(4)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    report = saver.dcp.import_dcp(tmp_path / "dcp", tmp_path / "saver")
    assert report is not None and report.bytes_written > 0
    assert saver.verify(tmp_path / "saver")["status"] == "ok"
    back = _zeros_like(state)
    dcp.load(back, storage_reader=saver.dcp.StorageReader(tmp_path / "saver"))
    _assert_same(back, state)
    # From a shell, both ways: in, then out to DCP's HuggingFace layout.
    run = [sys.executable, "-m", "saver.dcp"]
    out = subprocess.run(run + ["import", str(tmp_path / "dcp"), str(tmp_path / "shell")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    again = _zeros_like(state)
    dcp.load(again, storage_reader=saver.dcp.StorageReader(tmp_path / "shell"))
    _assert_same(again, state)
    out = subprocess.run(run + ["export-hf", str(tmp_path / "shell"), str(tmp_path / "hf"), "--piece-bytes", "4096"], capture_output=True, text=True)
    assert out.returncode == 0 and "left out (not tensors)" in out.stdout, out.stderr
    torch.save(_flat_tensors(state), tmp_path / "ref.pt")
    out = subprocess.run([sys.executable, "-c", _STOCK_READER, str(tmp_path / "hf"), str(tmp_path / "ref.pt")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    # A refusal is a message naming the path, not a traceback.
    out = subprocess.run(run + ["export-hf", str(tmp_path / "dcp"), str(tmp_path / "hf3")], capture_output=True, text=True)
    assert out.returncode == 2 and "error:" in out.stderr and "Traceback" not in out.stderr, out.stderr


# --- the other way: DCP's stock HuggingFaceStorageReader, with no saver installed ---------

_STOCK_READER = """
import sys
sys.modules["saver"] = None  # what this process loads, it loads without saver
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
ref = torch.load(sys.argv[2])
back = {k: torch.zeros_like(v) for k, v in ref.items()}
dcp.load(back, storage_reader=HuggingFaceStorageReader(sys.argv[1]), no_dist=True)
for k in ref:
    assert back[k].dtype == ref[k].dtype and back[k].shape == ref[k].shape, k
    assert torch.equal(back[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8)), k
print("same", len(ref))
"""


def _flat_tensors(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat_tensors(v, f"{prefix}{k}."))
        elif torch.is_tensor(v):
            out[prefix + k] = v
    return out


def test_an_export_loads_bitwise_with_dcps_stock_huggingface_reader_and_no_saver(tmp_path):
    state = _state(6)
    dcp.save(state, storage_writer=saver.dcp.StorageWriter(tmp_path / "saver"))
    # Pieces of 1000 bytes: the tables cut into many, each at its own offset in its own file.
    done = saver.dcp.export_hf(tmp_path / "saver", tmp_path / "hf", piece_bytes=1000)
    flat = _flat_tensors(state)
    assert done["tensors"] == len(flat) and done["bytes"] == sum(t.numel() * t.element_size() for t in flat.values())
    assert done["files"] == len(list((tmp_path / "hf").glob("*.safetensors"))) > 10
    # Items that are not tensors have no place in that layout, and are named.
    assert "extra.epoch" in done["skipped"] and not any(k in flat for k in done["skipped"])
    torch.save(flat, tmp_path / "ref.pt")
    out = subprocess.run([sys.executable, "-c", _STOCK_READER, str(tmp_path / "hf"), str(tmp_path / "ref.pt")], capture_output=True, text=True)
    assert out.returncode == 0 and f"same {len(flat)}" in out.stdout, out.stderr[-3000:]
    # And the same from a Manager's newest step; a directory already holding files is refused.
    m = saver.Manager(tmp_path / "run")
    dcp.save(state, storage_writer=saver.dcp.StorageWriter(m, step=5))
    assert saver.dcp.export_hf(m, tmp_path / "hf2")["bytes"] == done["bytes"]
    with pytest.raises(saver.InputError, match="hf2: exists and is not an empty directory"):
        saver.dcp.export_hf(m, tmp_path / "hf2")


def test_an_export_of_a_corrupt_checkpoint_fails_naming_the_tensor_and_leaves_nothing(tmp_path):
    state = {"w": torch.randn(4000, 16), "v": torch.randn(3000)}
    dcp.save(state, storage_writer=saver.dcp.StorageWriter(tmp_path / "saver"))
    f = next((tmp_path / "saver").rglob("*.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(saver.SaverError, match="CRC32") as e:
        saver.dcp.export_hf(tmp_path / "saver", tmp_path / "hf")
    assert 'table "w"' in str(e.value) or 'table "v"' in str(e.value)
    # Neither the directory nor its temporary sibling is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saver"]


def _stock_rank(rank, world, port, hf, out):
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.tensor import DTensor

    with gloo_ranks.group(rank, world, port):
        whole = _whole(0)
        state = _dtensor_state({k: torch.zeros_like(v) for k, v in whole.items()}, world)
        del state["sched"]  # a BYTE_IO item: not in that layout
        dcp.load(state, storage_reader=HuggingFaceStorageReader(hf))
        for k, v in state.items():
            assert isinstance(v, DTensor) and torch.equal(v.full_tensor(), whole[k]), k
        with open(os.path.join(out, f"{rank}.ok"), "w") as f:
            f.write("ok")


def test_dtensors_saved_at_two_ranks_export_and_load_at_three_with_dcps_stock_reader(tmp_path):
    _ranks(2, tmp_path / "saver", tmp_path / "dcp", True, tmp_path / "out")
    done = saver.dcp.export_hf(tmp_path / "saver", tmp_path / "hf", piece_bytes=64)
    assert sorted(done["skipped"]) == ["sched.last_epoch", "sched.lrs"], done
    out = tmp_path / "stock"
    out.mkdir()
    mp.spawn(_stock_rank, args=(3, _free_port(), str(tmp_path / "hf"), str(out)), nprocs=3, join=True)
    assert len(list(out.glob("*.ok"))) == 3


def test_async_saves_stage_into_the_copy_the_last_one_kept_never_one_still_being_written(tmp_path):
    state = _state(5)
    dcp.async_save(state, storage_writer=saver.dcp.StorageWriter(tmp_path / "a")).result()

    def pointers(staged):
        return sorted(t.data_ptr() for t in saver.dcp._tensors(staged))

    # The next background save of the same layout copies into the memory the last one used.
    kept = pointers(saver.dcp._kept_copies.values()[0])
    first = saver.dcp.StorageWriter(tmp_path / "b")
    assert pointers(first.stage(state)) == kept
    # One taken and not yet written: a save beside it gets memory of its own.
    second = saver.dcp.StorageWriter(tmp_path / "c")
    assert not set(pointers(second.stage(state))) & set(kept)
    first.close()
    second.close()
    # A state of another layout is never staged into it.
    other = {"w": torch.zeros(3)}
    assert not set(pointers(saver.dcp.StorageWriter(tmp_path / "d").stage(other))) & set(kept)
    # And what the saves wrote is what each was given.
    state["model"]["emb.weight"].fill_(7)
    dcp.async_save(state, storage_writer=saver.dcp.StorageWriter(tmp_path / "e")).result()
    back = _zeros_like(state)
    dcp.load(back, storage_reader=saver.dcp.StorageReader(tmp_path / "e"))
    _assert_same(back, state)
    first_back = _zeros_like(state)
    dcp.load(first_back, storage_reader=saver.dcp.StorageReader(tmp_path / "a"))
    _assert_same(first_back, _state(5))
    # The kept copy is what the process holds for the next background save, until released.
    assert saver.dcp.staged_memory() >= state["model"]["emb.weight"].numel() * 4
    saver.dcp.release_staged_memory()
    assert saver.dcp.staged_memory() == 0
