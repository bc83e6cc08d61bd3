"""saver.torch: a PyTorch model and its optimizer saved and restored in three lines, bit for
bit, in place; in the background; through a Manager; and by ranks of a gloo process group, read
back by any number of processes."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import gloo_ranks
import saver
import saver.torch


class Dlrm(torch.nn.Module):
    """Two embedding bags, a plain embedding, an MLP and a batch norm (a buffer)."""

    def __init__(self, seed=0, rows=(1000, 300, 50)):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.users = torch.nn.EmbeddingBag(rows[0], 16, mode="sum")
        self.items = torch.nn.EmbeddingBag(rows[1], 16, mode="mean")
        self.cats = torch.nn.Embedding(rows[2], 8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(40, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.norm = torch.nn.BatchNorm1d(40)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, u, i, c):
        x = torch.cat([self.users(u), self.items(i), self.cats(c).sum(1)], dim=1)
        return self.mlp(self.norm(x)).squeeze(1)


def batch(step, rows=(1000, 300, 50)):
    g = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randint(rows[0], (32, 4), generator=g),
        torch.randint(rows[1], (32, 3), generator=g),
        torch.randint(rows[2], (32, 2), generator=g),
        torch.randn(32, generator=g),
    )


def train(model, opt, steps, start=0):
    for s in range(start, start + steps):
        u, i, c, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(u, i, c), y).backward()
        opt.step()


def optimizers(model):
    """Adagrad for the embeddings, Adam for the rest: two param groups of two kinds of state."""
    emb = [model.users.weight, model.items.weight, model.cats.weight]
    rest = [p for n, p in model.named_parameters() if not n.startswith(("users", "items", "cats"))]
    return torch.optim.Adagrad(emb, lr=0.05), torch.optim.Adam(rest, lr=1e-3, betas=(0.8, 0.99))


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def assert_same_optimizer(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


@pytest.mark.parametrize("kind", ["adagrad", "adam"])
def test_a_model_and_its_optimizer_come_back_bit_for_bit_in_place(tmp_path, kind):
    torch.manual_seed(0)
    model = Dlrm(seed=1)
    opt = optimizers(model)[0 if kind == "adagrad" else 1]
    train(model, opt, 5)
    saver.torch.save(tmp_path / "ck", model, opt, step=5, extra={"epoch": 2, "note": "x"})
    # The embeddings are row-range tables with their optimizer state as slots.
    ck = saver.Checkpoint(tmp_path / "ck")
    assert set(ck.row_tables) == {"users.weight", "items.weight", "cats.weight"}
    if kind == "adagrad":
        assert "state.sum" in ck.row_tables["users.weight"]["slots"]
    assert ck.step == 5

    fresh = Dlrm(seed=9)
    fresh_opt = optimizers(fresh)[0 if kind == "adagrad" else 1]
    if kind == "adagrad":
        fresh_opt.param_groups[0]["lr"] = 1.0  # restored from the checkpoint
    weight = fresh.users.weight
    extra = saver.torch.load(tmp_path / "ck", fresh, fresh_opt)
    assert extra == {"epoch": 2, "note": "x"}
    assert fresh.users.weight is weight  # filled in place
    assert_same(model, fresh)
    assert_same_optimizer(opt, fresh_opt)
    # Both train on the same: still equal, bit for bit.
    train(model, opt, 2, start=5)
    train(fresh, fresh_opt, 2, start=5)
    assert_same(model, fresh)


def test_a_background_save_holds_the_moment_and_a_manager_saves_steps_as_deltas(tmp_path):
    model = Dlrm(seed=2)
    opt = optimizers(model)[0]
    train(model, opt, 3)
    snapshot = Dlrm(seed=0)
    snapshot.load_state_dict(model.state_dict())
    h = saver.torch.save_async(tmp_path / "bg", model, opt, step=3)
    train(model, opt, 3, start=3)  # changes the tensors at once
    h.wait()
    back = Dlrm(seed=5)
    saver.torch.load(tmp_path / "bg", back)
    assert_same(snapshot, back)

    m = saver.Manager(tmp_path / "run", full_every=4)
    for step in (10, 20, 30):
        train(model, opt, 1, start=step)
        saver.torch.save(m, model, opt, step=step, extra={"step": step})
    assert [s["links"] for s in m.steps()] == [1, 2, 3]
    back, back_opt = Dlrm(seed=6), optimizers(Dlrm(seed=6))[0]
    back_opt = optimizers(back)[0]
    assert saver.torch.load(m, back, back_opt) == {"step": 30}
    assert_same(model, back)
    assert_same_optimizer(opt, back_opt)


def test_background_saves_reuse_one_copys_memory_and_each_holds_its_moment(tmp_path):
    rows = (40000, 300, 50)
    model = Dlrm(seed=7, rows=rows)
    opt = optimizers(model)[0]
    saver.release_background_memory()
    # The weights of `users` and Adagrad's sum of them are the only tensors of 1 MiB or more.
    big = model.users.weight.numel() * 4
    for k in range(3):
        train(model, opt, 1, start=10 * k)
        snapshot = Dlrm(seed=0, rows=rows)
        snapshot.load_state_dict(model.state_dict())
        snapshot_sum = opt.state[model.users.weight]["sum"].clone()
        h = saver.torch.save_async(tmp_path / f"bg{k}", model, opt, step=k)
        train(model, opt, 2, start=10 * k + 1)  # changes the tensors while the save writes
        report = h.wait()
        if report.moment == "device copy":
            # The CPU stand-in of a device (SAVER_STAND_IN_DEVICE=1): the moment is a copy on
            # the "device", freed with the save, and no host memory is kept.
            assert saver.background_memory() == 0, k
        else:
            # One save's copies are kept, however many saves ran.
            assert saver.background_memory() == 2 * big, k
        back = Dlrm(seed=5, rows=rows)
        back_opt = optimizers(back)[0]
        saver.torch.load(tmp_path / f"bg{k}", back, back_opt)
        assert_same(snapshot, back)
        assert torch.equal(back_opt.state[back.users.weight]["sum"], snapshot_sum), k
    saver.release_background_memory()
    assert saver.background_memory() == 0


def test_what_does_not_fit_is_refused_by_name(tmp_path):
    model = Dlrm(seed=3)
    saver.torch.save(tmp_path / "ck", model)
    other = Dlrm(seed=3, rows=(1000, 300, 60))
    with pytest.raises(saver.InputError, match="cats.weight"):
        saver.torch.load(tmp_path / "ck", other)
    with pytest.raises(saver.InputError, match="extra"):
        saver.torch.save(tmp_path / "x", model, extra={"t": torch.zeros(1)})
    with pytest.raises(saver.InputError, match="not saved by saver.torch"):
        saver.save(tmp_path / "plain", dense={"a": np.zeros(3, np.float32)})
        saver.torch.load(tmp_path / "plain", model)
    adam = optimizers(model)[1]
    saver.torch.save(tmp_path / "adam", model, adam)
    with pytest.raises(saver.InputError, match="Adam, not of a Adagrad"):
        saver.torch.load(tmp_path / "adam", model, optimizers(model)[0])


def _rank_save(rank, world, path, port):
    with gloo_ranks.group(rank, world, port):
        model = Dlrm(seed=4)
        opt = optimizers(model)[0]
        train(model, opt, 3)  # the same on every rank: a replica
        saver.torch.save(path, model, opt, step=3, extra={"world": world})


def _rank_managed(rank, world, root, port):
    """Steps 1-3 saved through a Manager (deltas by its policy), step 4 in the background."""
    with gloo_ranks.group(rank, world, port):
        model = Dlrm(seed=4)
        opt = optimizers(model)[0]
        m = saver.Manager(root, full_every=2, keep_latest=2)
        for step in range(1, 5):
            train(model, opt, 1, start=step)
            if step < 4:
                report = saver.torch.save(m, model, opt, step=step, extra={"world": world})
                assert report.committed
            else:
                saver.torch.save_async(m, model, opt, step=step, extra={"world": world}).wait()


def _rank_load(rank, world, path, port, out, managed=False):
    with gloo_ranks.group(rank, world, port):
        model = Dlrm(seed=7)
        opt = optimizers(model)[0]
        saver.torch.load(saver.Manager(path) if managed else path, model, opt)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(out, f"rank{rank}.pt"))


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_ranks_restored(out, world, reference, ref_opt):
    """Each of `world` ranks' dumps in `out` (`_rank_load`'s) holds `reference` and its
    optimizer's state, bit for bit."""
    for r in range(world):
        got = torch.load(out / f"rank{r}.pt")
        back = Dlrm(seed=0)
        back.load_state_dict(got["model"])
        assert_same(reference, back)
        back_opt = optimizers(back)[0]
        back_opt.load_state_dict(got["opt"])
        assert_same_optimizer(ref_opt, back_opt)


def test_two_gloo_ranks_save_one_checkpoint_that_one_and_three_ranks_load(tmp_path):
    path = str(tmp_path / "ck")
    mp.spawn(_rank_save, args=(2, path, _free_port()), nprocs=2, join=True)
    ck = saver.Checkpoint(path)
    assert ck.shards == 2
    reference = Dlrm(seed=4)
    ref_opt = optimizers(reference)[0]
    train(reference, ref_opt, 3)
    for world in (1, 3):
        out = tmp_path / f"out{world}"
        out.mkdir()
        if world == 1:
            model = Dlrm(seed=7)
            opt = optimizers(model)[0]
            assert saver.torch.load(path, model, opt) == {"world": 2}
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out / "rank0.pt")
        else:
            mp.spawn(_rank_load, args=(world, path, _free_port(), str(out)), nprocs=world, join=True)
        _assert_ranks_restored(out, world, reference, ref_opt)


def test_gloo_ranks_save_steps_through_a_manager_and_other_ranks_restore_the_newest(tmp_path):
    """Under torch.distributed a Manager's steps are one save of all ranks each (deltas by its
    policy, retention after the commit), in the foreground and the background; three ranks
    then restore the newest step through a Manager, bit for bit."""
    root = str(tmp_path / "run")
    mp.spawn(_rank_managed, args=(2, root, _free_port()), nprocs=2, join=True)
    steps = saver.Manager(root).steps()
    assert [s["step"] for s in steps] == [3, 4]
    newest = saver.Checkpoint(saver.Manager(root).latest()["path"])
    assert newest.step == 4 and newest.shards == 2 and newest.is_delta
    reference = Dlrm(seed=4)
    ref_opt = optimizers(reference)[0]
    train(reference, ref_opt, 4, start=1)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_rank_load, args=(3, root, _free_port(), str(out), True), nprocs=3, join=True)
    _assert_ranks_restored(out, 3, reference, ref_opt)


KILLED_TRAINER = r"""
import sys, torch, saver, saver.torch
sys.path.insert(0, sys.argv[2])
from test_torch import Dlrm, optimizers, train
model = Dlrm(seed=8)
opt = optimizers(model)[0]
m = saver.Manager(sys.argv[1])
step = 0
while True:
    step += 1
    train(model, opt, 1, start=step)
    h = saver.torch.save_async(m, model, opt, step=step, extra={"step": step})
    print(step, flush=True)
"""


def test_a_kill_during_a_background_save_leaves_the_newest_committed_step_to_restore(tmp_path):
    restored = 0
    for steps, delay in ((2, 0.0), (4, 0.003), (7, 0.02)):
        root = tmp_path / f"run-{steps}"
        p = subprocess.Popen(
            [sys.executable, "-c", KILLED_TRAINER, str(root), os.path.dirname(__file__)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        # Killed while step `steps`'s save runs in the background (the one before it committed:
        # a manager's save waits for the previous one), a little later each round.
        for line in p.stdout:
            if int(line) >= steps:
                break
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        m = saver.Manager(root)
        latest = m.latest()
        assert latest is not None and latest["step"] >= steps - 1, latest
        model = Dlrm(seed=0)
        opt = optimizers(model)[0]
        extra = saver.torch.load(m, model, opt)
        assert extra == {"step": latest["step"]}
        # The trainer's state at that step, recomputed: exactly what was restored.
        ref = Dlrm(seed=8)
        ref_opt = optimizers(ref)[0]
        for s in range(1, latest["step"] + 1):
            train(ref, ref_opt, 1, start=s)
        assert_same(ref, model)
        restored += 1
    assert restored == 3
