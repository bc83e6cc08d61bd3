"""saver.torch never leaves a model half-filled: a load it refuses changes nothing, a load whose
read fails midway says what it overwrote, and a Manager's load falls back to the step before;
and every torch.optim optimizer resumes bit for bit, SparseAdam's integer step included."""

import copy
import os
import sys
import time
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import saver
import saver.torch
from test_torch import Dlrm, assert_same, assert_same_optimizer, optimizers, train


def snapshot(model, opt=None):
    """Copies of everything a load could write: the model's tensors and the optimizer's state
    dict (its tensors cloned)."""
    return copy.deepcopy(model.state_dict()), None if opt is None else copy.deepcopy(opt.state_dict())


def assert_untouched(model, opt, before):
    state, opt_state = before
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert torch.equal(now[k], state[k]), f"{k} was written by a refused load"
    if opt is not None:
        got = opt.state_dict()
        assert got["param_groups"] == opt_state["param_groups"]
        assert got["state"].keys() == opt_state["state"].keys()
        for i, st in opt_state["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v)), (i, k)


def _other_linear(model):
    model.mlp[0] = torch.nn.Linear(40, 31)
    model.mlp[2] = torch.nn.Linear(31, 1)


def _no_norm(model):
    model.norm = torch.nn.Identity()


class _Zeros(torch.nn.Module):
    """In place of an embedding of 8 columns: no table."""

    def forward(self, ids):
        return torch.zeros(*ids.shape, 8)


def _no_cats(model):
    model.cats = _Zeros()


@pytest.mark.parametrize("case", ["linear of another shape", "module missing", "table missing", "another optimizer", "weights only"])
def test_a_refused_load_leaves_the_model_and_the_optimizer_as_they_were(tmp_path, case):
    saved = Dlrm(seed=1)
    opt = optimizers(saved)[0]
    train(saved, opt, 2)
    weights_only = case == "weights only"
    saver.torch.save(tmp_path / "ck", saved, None if weights_only else opt)
    model = Dlrm(seed=2)
    {"linear of another shape": _other_linear, "module missing": _no_norm, "table missing": _no_cats}.get(case, lambda m: None)(model)
    if case == "another optimizer":
        target_opt = torch.optim.Adam(model.parameters())
    elif weights_only:
        target_opt = torch.optim.Adagrad(model.parameters())
    else:
        target_opt = torch.optim.Adagrad([p for n, p in model.named_parameters() if not n.startswith("mlp")], lr=0.05)
    train(model, target_opt, 1)
    before = snapshot(model, target_opt)
    expected = {
        "linear of another shape": "mlp.0.bias: the checkpoint holds F32 of shape \\(32,\\)",
        "module missing": "unexpected \\['norm.bias'",
        "table missing": "unexpected \\['cats.weight'\\]",
        "another optimizer": "Adagrad, not of a Adam",
        "weights only": "saved without an optimizer",
    }[case]
    with pytest.raises(saver.InputError, match=expected):
        saver.torch.load(tmp_path / "ck", model, target_opt)
    assert_untouched(model, target_opt, before)


def _flip_a_byte_of_the_largest_data_file(step_dir):
    files = [os.path.join(step_dir, f) for f in os.listdir(step_dir) if f.endswith(".safetensors")]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.seek(os.path.getsize(largest) * 2 // 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_read_that_fails_midway_names_what_it_overwrote_and_fallback_loads_the_step_before(tmp_path):
    manager = saver.Manager(tmp_path / "run", full_every=1)
    model = Dlrm(seed=1)
    opt = optimizers(model)[0]
    train(model, opt, 2)
    saver.torch.save(manager, model, opt, step=2)
    at_two = Dlrm(seed=0)
    at_two.load_state_dict(model.state_dict())
    opt_at_two = optimizers(at_two)[0]
    opt_at_two.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(model, opt, 2, start=2)
    saver.torch.save(manager, model, opt, step=4)
    _flip_a_byte_of_the_largest_data_file(manager.latest()["path"])

    fresh = Dlrm(seed=9)
    fresh_opt = optimizers(fresh)[0]
    with pytest.raises(saver.SaverError, match="may hold part of this checkpoint") as e:
        saver.torch.load(manager, fresh, fresh_opt)
    assert not isinstance(e.value, saver.InputError)
    assert "users.weight" in str(e.value) and "fallback=True" in str(e.value)
    # Into the same, partly overwritten model and optimizer: the step before, whole.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saver.torch.load(manager, fresh, fresh_opt, fallback=True)
    said = [str(w.message) for w in caught if issubclass(w.category, saver.SaverWarning)]
    assert len(said) == 1 and said[0].startswith("step 4 does not load") and "falling back to step 2" in said[0], said
    assert_same(at_two, fresh)
    assert_same_optimizer(opt_at_two, fresh_opt)
    with pytest.raises(saver.InputError, match="give a saver.Manager"):
        saver.torch.load(manager.latest()["path"], fresh, fresh_opt, fallback=True)


class Sparse(torch.nn.Module):
    """What every optimizer trains: an embedding table (sparse gradients for SparseAdam) and,
    for the others, a linear layer."""

    def __init__(self, sparse, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(60, 8, sparse=sparse)
        self.lin = None if sparse else torch.nn.Linear(8, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, ids):
        x = self.emb(ids).sum(1)
        return x.sum(1) if self.lin is None else self.lin(x).squeeze(1)


OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.01),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "SparseAdam": lambda ps: torch.optim.SparseAdam(list(ps), lr=0.01),
}


def _steps(model, opt, start, count):
    for s in range(start, start + count):
        g = torch.Generator().manual_seed(500 + s)
        ids = torch.randint(60, (16, 3), generator=g)
        y = torch.randn(16, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y).backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_resumes_bit_for_bit(tmp_path, name):
    sparse = name == "SparseAdam"
    model = Sparse(sparse, seed=1)
    opt = OPTIMIZERS[name](model.parameters())
    _steps(model, opt, 0, 3)
    saver.torch.save(tmp_path / "ck", model, opt, step=3)
    back = Sparse(sparse, seed=2)
    back_opt = OPTIMIZERS[name](back.parameters())
    saver.torch.load(tmp_path / "ck", back, back_opt)
    # The state's Python types come back too (SparseAdam's step is an int, not a 0-d tensor).
    for p, q in zip(model.parameters(), back.parameters()):
        for k, v in opt.state[p].items():
            assert type(back_opt.state[q][k]) is type(v), (k, type(back_opt.state[q][k]), type(v))
    _steps(model, opt, 3, 2)
    _steps(back, back_opt, 3, 2)
    for (n, p), q in zip(model.named_parameters(), back.parameters()):
        assert torch.equal(p, q), f"{name}: {n} differs after resuming, by {(p - q).abs().max().item()}"


def _rank_of_a_save_one_dies_in(rank, world, root, port, out, background):
    """Rank `world - 1` dies inside its share of a Manager's step (after the ranks agreed on the
    save); the others write down how long their save took to raise, and what it said."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = Dlrm(seed=4)
    opt = optimizers(model)[0]
    manager = saver.Manager(root)
    if rank == world - 1:
        # Killed while its native save runs: its shard never comes.
        manager.save = manager.save_async = lambda *a, **k: os._exit(9)
    start = time.monotonic()
    try:
        if background:
            saver.torch.save_async(manager, model, opt, step=1).wait()
        else:
            saver.torch.save(manager, model, opt, step=1)
        said = "returned"
    except Exception as e:  # noqa: BLE001 - what a trainer catches
        said = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - start:.3f}\n{said}")
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.parametrize("background", [False, True])
def test_when_a_rank_dies_in_a_managed_save_every_other_rank_raises_within_seconds(tmp_path, background):
    from test_torch import _free_port

    world, out = 3, tmp_path / "out"
    out.mkdir()
    ctx = mp.spawn(_rank_of_a_save_one_dies_in, args=(world, str(tmp_path / "run"), _free_port(), str(out), background),
                   nprocs=world, join=False)
    deadline = time.monotonic() + 120
    for p in ctx.processes:
        p.join(max(1, deadline - time.monotonic()))
        assert not p.is_alive(), "a rank still waits"
    for rank in range(world - 1):
        took, said = (out / f"rank{rank}.txt").read_text().split("\n", 1)
        # Before: 600 s, the Manager's wait for the dead rank's shard.
        assert float(took) < 30, (rank, took, said)
        assert said.startswith("SaverError:") and "another rank left the save" in said, said
    assert saver.Manager(tmp_path / "run").latest() is None


def _rank_loading_its_own_path(rank, world, paths, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = Dlrm(seed=0)
    try:
        saver.torch.load(paths[rank], model)
        said = "loaded"
    except Exception as e:  # noqa: BLE001
        said = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(said)
    dist.barrier()
    os._exit(0)


def test_ranks_given_different_checkpoints_all_refuse_to_load(tmp_path):
    from test_torch import _free_port

    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for seed, path in enumerate(paths):
        saver.torch.save(path, Dlrm(seed=seed))
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_rank_loading_its_own_path, args=(2, paths, _free_port(), str(out)), nprocs=2, join=True)
    for rank in range(2):
        said = (out / f"rank{rank}.txt").read_text()
        assert said.startswith("InputError: the ranks opened different checkpoints: rank 0"), said


def test_tampered_metadata_or_hyperparameters_are_refused_by_name(tmp_path):
    import json
    import zlib

    model = Dlrm(seed=1)
    opt = optimizers(model)[0]
    saver.torch.save(tmp_path / "ck", model, opt)

    def tamper(edit):
        """The checkpoint's saver.torch metadata edited, and its manifest resealed."""
        ck = tmp_path / "ck"
        index = json.loads((ck / "model.safetensors.index.json").read_text())
        manifest_path = ck / index["metadata"]["saver_manifest"]
        manifest = json.loads(manifest_path.read_text())
        manifest["user_metadata"][saver.torch.META_KEY] = edit(manifest["user_metadata"][saver.torch.META_KEY])
        body = json.dumps(manifest).encode()
        manifest_path.write_bytes(body)
        index["metadata"]["saver_manifest_crc32"] = zlib.crc32(body)
        (ck / "model.safetensors.index.json").write_text(json.dumps(index, separators=(",", ":")))

    original = json.loads(saver.Checkpoint(tmp_path / "ck").metadata[saver.torch.META_KEY])
    cases = [
        (lambda raw: raw[:-3], "is not JSON"),
        (lambda raw: json.dumps([1, 2]), "is not an object"),
        (lambda raw: json.dumps({**original, "tables": "users.weight"}), "'tables' is missing or not a list"),
        (lambda raw: json.dumps({**original, "param_groups": [{"params": 3}]}), "a param group is not"),
        (lambda raw: json.dumps({**original, "param_groups": [{**g, "hyper": {**g["hyper"], "lr": "fast"}} for g in original["param_groups"]]}),
         "hyperparameter 'lr' is 'fast' in the checkpoint"),
    ]
    for edit, said in cases:
        tamper(lambda raw, edit=edit: edit(json.dumps(original)))
        fresh = Dlrm(seed=2)
        fresh_opt = optimizers(fresh)[0]
        before = snapshot(fresh, fresh_opt)
        with pytest.raises(saver.InputError, match=said):
            saver.torch.load(tmp_path / "ck", fresh, fresh_opt)
        assert_untouched(fresh, fresh_opt, before)


def test_load_latest_says_which_step_it_read(tmp_path):
    manager = saver.Manager(tmp_path / "run")
    fresh = Dlrm(seed=3)
    assert saver.torch.load_latest(manager, fresh) is None
    model = Dlrm(seed=1)
    for step in (5, 9):
        saver.torch.save(manager, model, step=step, extra={"at": step})
    assert saver.torch.load_latest(manager, fresh) == (9, {"at": 9})
    assert_same(model, fresh)
    with pytest.raises(saver.InputError, match="holds no committed step"):
        saver.torch.load(saver.Manager(tmp_path / "empty"), fresh)


def test_an_embedding_of_no_rows_or_no_columns_is_saved_and_loaded(tmp_path):
    model = torch.nn.ModuleDict({"none": torch.nn.Embedding(0, 4), "narrow": torch.nn.Embedding(5, 0), "some": torch.nn.Embedding(3, 2)})
    opt = torch.optim.Adagrad(model.parameters())
    saver.torch.save(tmp_path / "ck", model, opt)
    held = saver.Checkpoint(tmp_path / "ck").row_tables
    assert tuple(held["none.weight"]["slots"]["param"][1]) == (0, 4) and tuple(held["narrow.weight"]["slots"]["param"][1]) == (5, 0)
    back = torch.nn.ModuleDict({"none": torch.nn.Embedding(0, 4), "narrow": torch.nn.Embedding(5, 0), "some": torch.nn.Embedding(3, 2)})
    back_opt = torch.optim.Adagrad(back.parameters())
    saver.torch.load(tmp_path / "ck", back, back_opt)
    assert_same(model, back)


def _rank_agreeing_on_its_own_group(rank, world, path, port, out):
    import torch.distributed as dist

    import gloo_ranks

    with gloo_ranks.group(rank, world, port):
        # A group of its own beside the default one, as a gloo group beside NCCL: every
        # collective saver makes must name it.
        side = dist.new_group(backend="gloo")
        groups = []
        for name in ("all_gather_object", "broadcast_object_list"):
            real = getattr(dist, name)

            def spy(*args, _real=real, **kwargs):
                groups.append(kwargs.get("group"))
                return _real(*args, **kwargs)

            setattr(dist, name, spy)
        model = Dlrm(seed=3)
        opt = optimizers(model)[0]
        train(model, opt, 1)
        saver.torch.save(path, model, opt, process_group=side)
        h = saver.torch.save_async(path + "-bg", model, opt, process_group=side)
        h.wait()
        back = Dlrm(seed=9)
        saver.torch.load(path, back, optimizers(back)[0], process_group=side)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(f"{len(groups)} {sum(g is side for g in groups)}\n")
        torch.save(back.state_dict(), os.path.join(out, f"rank{rank}.pt"))


def test_the_ranks_agree_on_the_process_group_given_and_only_on_it(tmp_path):
    from test_torch import _free_port

    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_rank_agreeing_on_its_own_group, args=(2, str(tmp_path / "ck"), _free_port(), str(out)), nprocs=2, join=True)
    for rank in range(2):
        calls, on_side = map(int, (out / f"rank{rank}.txt").read_text().split())
        assert calls > 0 and calls == on_side, f"rank {rank}: {on_side} of {calls} collectives on the group given"
    a, b = (torch.load(out / f"rank{r}.pt") for r in range(2))
    for k in a:
        assert torch.equal(a[k], b[k]), k
