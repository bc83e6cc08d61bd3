"""saver.torch with the forms a row-wise plan gives a table: each rank holds a range of its
rows, and the state dict holds the table (and its optimizer state, as TorchRec's fused
optimizer holds it) as a ShardedTensor built from the local shards (`init_from_local_shards`)
or as a DTensor (`Shard(0)`, or `Replicate()`: every rank holds it whole). A checkpoint saved in
one form and split is read in any other, and by a plain `nn.Embedding` and its Adagrad, bit for
bit."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor import init_device_mesh

import gloo_ranks
import saver
import saver.torch

ROWS, DIM = 10, 6


def _whole(seed):
    """The table and its Adagrad state (`momentum1`, as TorchRec names it) whole."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, DIM, generator=g), torch.rand(ROWS, DIM, generator=g)


def _bounds(form, world):
    """The row ranges of the ranks: a DTensor's are torch.chunk's; a ShardedTensor may be cut
    anywhere (here unevenly, 3 rows first)."""
    if form == "dtensor":
        step = -(-ROWS // world)
        return [min(ROWS, step * r) for r in range(world + 1)]
    if form == "replicate":
        return [0, ROWS]
    return [0, 3] + [3 + (ROWS - 3) * r // (world - 1) for r in range(1, world)] if world > 1 else [0, ROWS]


class RowWise(torch.nn.Module):
    """A table held by rows as a row-wise plan holds it, its state dict and `fused_optimizer`
    giving it in `form` ("sharded", "dtensor", "replicate")."""

    def __init__(self, form, seed):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        b = _bounds(form, world)
        a, z = (0, ROWS) if form == "replicate" else (b[rank], b[rank + 1])
        weight, state = _whole(seed)
        self.form, self.a = form, a
        self.local = torch.nn.Parameter(weight[a:z].clone())
        self.local_state = state[a:z].clone()
        self.mesh = init_device_mesh("cpu", (world,)) if form != "sharded" else None
        model = self

        class Fused:
            """What TorchRec's fused optimizer gives: {table parameter: {"<table>.<state>": sharded}}."""

            def state_dict(self):
                return {"state": {"table.weight": {"table.momentum1": model.wrap(model.local_state)}}, "param_groups": []}

            def load_state_dict(self, sd):
                model.local_state.copy_(model.unwrap(sd["state"]["table.weight"]["table.momentum1"]))

        self.fused_optimizer = Fused()

    def wrap(self, local):
        if self.form == "sharded":
            meta = ShardMetadata(shard_offsets=[self.a, 0], shard_sizes=list(local.shape), placement=f"rank:{dist.get_rank()}/cpu")
            return init_from_local_shards([Shard(local, meta)], ROWS, DIM)
        placement = Replicate() if self.form == "replicate" else DShard(0)
        return DTensor.from_local(local, self.mesh, [placement], shape=(ROWS, DIM), stride=(DIM, 1))

    def unwrap(self, t):
        return t.local_shards()[0].tensor if self.form == "sharded" else t.to_local()

    def state_dict(self, *args, keep_vars=False, **kwargs):
        return {"table.weight": self.wrap(self.local.data)}

    def load_state_dict(self, sd, strict=True):
        with torch.no_grad():
            self.local.copy_(self.unwrap(sd["table.weight"]))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank, world, port, form, path, seed, save, out):
    with gloo_ranks.group(rank, world, port):
        model = RowWise(form, seed)
        if save:
            saver.torch.save(path, model, extra={"form": form})
        else:
            assert saver.torch.load(path, model)["form"] in ("sharded", "dtensor", "replicate")
        torch.save((model.a, model.local.detach().clone(), model.local_state.clone()), os.path.join(out, f"{rank}.pt"))


def _ranks(world, form, path, seed, save, out):
    os.makedirs(out, exist_ok=True)
    mp.spawn(_run, args=(world, _free_port(), form, path, seed, save, out), nprocs=world, join=True)
    return [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]


def test_row_wise_forms_read_each_other_and_a_plain_embedding(tmp_path):
    weight, state = _whole(seed=1)
    for n, (saved_form, saved_world, form, world) in enumerate([
        ("sharded", 2, "dtensor", 3),
        ("dtensor", 3, "sharded", 2),
        ("replicate", 2, "sharded", 3),
        ("sharded", 3, "replicate", 2),
    ]):
        path = str(tmp_path / f"ck{n}")
        _ranks(saved_world, saved_form, path, 1, True, str(tmp_path / f"s{n}"))
        ck = saver.Checkpoint(path)
        assert set(ck.row_tables) == {"table.weight"}
        assert set(ck.row_tables["table.weight"]["slots"]) == {"param", "state.momentum1"}
        for a, w, st in _ranks(world, form, path, 2, False, str(tmp_path / f"l{n}")):
            rows = w.shape[0]
            assert rows > 0
            assert torch.equal(w, weight[a:a + rows]), (saved_form, form, a)
            assert torch.equal(st, state[a:a + rows]), (saved_form, form, a)
    # A plain model: the table an nn.Embedding, its state torch.optim.Adagrad's `sum`.
    plain = torch.nn.Module()
    plain.table = torch.nn.Embedding(ROWS, DIM)
    adagrad = torch.optim.Adagrad(plain.parameters(), lr=0.1)
    saver.torch.load(tmp_path / "ck0", plain, adagrad)
    assert torch.equal(plain.table.weight.detach(), weight)
    assert torch.equal(adagrad.state[plain.table.weight]["sum"], state)
