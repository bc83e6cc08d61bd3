"""saver.torch with TorchRec: an EmbeddingBagCollection under DistributedModelParallel (CPU,
gloo), its tables sharded table-wise or column-wise and its fused Adagrad state, saved by two
ranks in one plan and loaded by ranks of another plan and world size, bit for bit. TorchRec must
be installed (python/tests/run.sh installs it): a missing TorchRec fails here, it is not skipped."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import gloo_ranks
import saver
import saver.torch

# (name, rows, dim): t2 is wide enough for several column shards of 32.
TABLES = [("t0", 100, 16), ("t1", 250, 16), ("t2", 80, 128)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(world, plan_kinds, seed, rowwise=False, min_partition=32, dtensor=False):
    torch.manual_seed(seed)
    configs = [
        torchrec.EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, r, d in TABLES
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    optimizer = torchrec.optim.RowWiseAdagrad if rowwise else torch.optim.Adagrad
    apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": 0.1})
    # A column-wise table of dimension d is cut into d / min_partition shards at most.
    constraints = {
        n: ParameterConstraints(sharding_types=[k], min_partition=min_partition if k == "column_wise" else None)
        for (n, _, _), k in zip(TABLES, plan_kinds)
    }
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(ebc, [EmbeddingBagCollectionSharder()], dist.GroupMember.WORLD)
    # TorchRec's DTensor form (`output_dtensor`): its tables and their fused state are DTensors
    # holding their local shards, any number a rank, in place of ShardedTensors.
    env = ShardingEnv(world, dist.get_rank(), dist.GroupMember.WORLD, output_dtensor=dtensor)
    return DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, env=env)


def _dense_optimizer(model):
    """TorchRec's recipe for what the fused optimizer does not train (a data-parallel table):
    a torch optimizer over the other parameters; None when there are none."""
    params = list(dict(in_backward_optimizer_filter(model.named_parameters())).values())
    return torch.optim.Adagrad(params, lr=0.1) if params else None


def _train(model, rank, steps, dense=None):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        keys = [f"f_{n}" for n, _, _ in TABLES]
        lengths = torch.randint(0, 4, (len(keys) * 8,), generator=g)
        values = torch.cat([torch.randint(0, TABLES[i // 8][1], (int(l),), generator=g) for i, l in enumerate(lengths)])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        # Each column weighted differently, so that a row's gradient differs by column and
        # row-wise state differs by column shard (with a plain sum it would not).
        out = model(kjt).values()
        (out * torch.linspace(0.5, 2.0, out.shape[1])).sum().backward()
        if dense is not None:
            dense.step()
            dense.zero_grad()


def _shards(t):
    """[(offsets, tensor)] of this rank's shards of a ShardedTensor or of a DTensor in
    TorchRec's form; None for another tensor."""
    if hasattr(t, "local_shards"):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in t.local_shards()]
    if hasattr(t, "to_local"):
        local = t.to_local()
        return [(tuple(o), x) for o, x in zip(local.local_offsets(), local.local_shards())]
    return None


def _dump(model, dense=None):
    """This rank's local shards of every table and fused state, and the whole of every
    data-parallel table and its dense optimizer state: {(key, offsets): tensor}."""
    out = {}
    for k, t in model.state_dict().items():
        shards = _shards(t)
        if shards is None:
            out[(k, (0,) * t.dim())] = t.clone()
            continue
        for offsets, x in shards:
            out[(k, offsets)] = x.clone()
    names = {id(p): n for n, p in model.named_parameters()}
    for p, states in (dense.state.items() if dense is not None else ()):
        for k, t in states.items():
            if t.dim() >= 1:
                out[(f"{names[id(p)]}:{k}", (0,) * t.dim())] = t.clone()
    for param, states in model.fused_optimizer.state_dict()["state"].items():
        for k, t in states.items():
            for offsets, x in _shards(t) or []:
                out[(f"{param}:{k}", offsets)] = x.clone()
    return out


def _whole(dumps):
    """The rank dumps put together: {key: whole tensor}."""
    parts = {}
    for d in dumps:
        for (k, off), t in d.items():
            parts.setdefault(k, []).append((off, t))
    whole = {}
    for k, pieces in parts.items():
        rows = max(o[0] + t.shape[0] for o, t in pieces)
        if pieces[0][1].dim() == 2:
            cols = max(o[1] + t.shape[1] for o, t in pieces)
            w = torch.full((rows, cols), float("nan"))
            for o, t in pieces:
                w[o[0]:o[0] + t.shape[0], o[1]:o[1] + t.shape[1]] = t
        else:
            w = torch.full((rows,), float("nan"))
            for o, t in pieces:
                w[o[0]:o[0] + t.shape[0]] = t
        whole[k] = w
    return whole


def _run(rank, world, port, kinds, path, out, save, rowwise=False, min_partition=32, dtensor=False):
    with gloo_ranks.group(rank, world, port):
        model = _model(world, kinds, seed=1 if save else 2, rowwise=rowwise, min_partition=min_partition, dtensor=dtensor)
        dense = _dense_optimizer(model)
        if save:
            _train(model, rank, 2, dense)
            saver.torch.save(path, model, dense, step=2, extra={"plan": kinds})
        else:
            before = _dump(model, dense)
            assert saver.torch.load(path, model, dense) == {"plan": kinds_saved(path)}
            after = _dump(model, dense)
            assert any(not torch.equal(before[k], after[k]) for k in before), "the load changed nothing"
        torch.save(_dump(model, dense), os.path.join(out, f"rank{rank}.pt"))


def kinds_saved(path):
    return saver.torch._meta(path)[0]["extra"]["plan"]


def _ranks(world, kinds, path, out, save, rowwise=False, min_partition=32, dtensor=False):
    os.makedirs(out, exist_ok=True)
    mp.spawn(_run, args=(world, _free_port(), kinds, path, out, save, rowwise, min_partition, dtensor), nprocs=world, join=True)
    return _whole([torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)])


def test_a_torchrec_model_saved_in_one_plan_loads_bit_for_bit_in_others(tmp_path):
    path = str(tmp_path / "ck")
    saved_kinds = ["table_wise", "table_wise", "column_wise"]
    saved = _ranks(2, saved_kinds, path, str(tmp_path / "saved"), save=True)
    ck = saver.Checkpoint(path)
    assert set(ck.row_tables) == {f"embedding_bags.{n}.weight" for n, _, _ in TABLES}
    assert "state.momentum1" in ck.row_tables["embedding_bags.t2.weight"]["slots"]
    assert any(torch.count_nonzero(v) for k, v in saved.items() if ":" in k), "training left optimizer state"
    for world, kinds in ((2, ["column_wise", "table_wise", "table_column_wise"]), (3, ["table_wise", "column_wise", "column_wise"]), (1, ["table_wise"] * 3)):
        got = _ranks(world, kinds, path, str(tmp_path / f"w{world}"), save=False)
        # State keys differ by plan only in their names' shard suffixes: compare by table.
        assert {k.split(":")[0] for k in got} == {k.split(":")[0] for k in saved}
        for k, v in saved.items():
            match = [g for gk, g in got.items() if gk.split(":")[0] == k.split(":")[0] and gk.split(":")[-1].split(".")[-1] == k.split(":")[-1].split(".")[-1]]
            assert match and torch.equal(match[0], v), (world, kinds, k)


def test_row_wise_adagrad_state_follows_its_table_across_column_cuts_by_the_documented_rule(tmp_path):
    """Fused row-wise Adagrad keeps one value per row per column shard. Saved with t2 cut into 4
    column shards: loaded in the same plan it is exact; into another column cut, each new shard
    gets the mean of the saved shards it overlaps, weighted by the columns they share (docs:
    saver.torch); table-wise, the mean of all four."""
    path = str(tmp_path / "ck")
    kinds = ["table_wise", "table_wise", "column_wise"]
    saved = _ranks(2, kinds, path, str(tmp_path / "saved"), save=True, rowwise=True)
    key = next(k for k in saved if k.startswith("embedding_bags.t2.weight:"))
    rows = 80
    per_shard = saved[key].reshape(4, rows)  # 4 saved column shards of 32 columns
    assert torch.count_nonzero(per_shard), "training left row-wise state"
    assert all(not torch.equal(per_shard[0], s) for s in per_shard[1:]), "the column shards' state differs"
    # The same cut: exact, weights and state.
    same = _ranks(2, kinds, path, str(tmp_path / "same"), save=False, rowwise=True)
    for k, v in saved.items():
        assert torch.equal(same[k], v), k
    # Two column shards of 64: each the mean of two saved ones.
    two = _ranks(2, kinds, path, str(tmp_path / "two"), save=False, rowwise=True, min_partition=64)
    got = two[key].reshape(-1, rows)
    assert got.shape[0] == 2
    assert torch.allclose(got[0], (per_shard[0] + per_shard[1]) / 2, rtol=0, atol=1e-6)
    assert torch.allclose(got[1], (per_shard[2] + per_shard[3]) / 2, rtol=0, atol=1e-6)
    assert torch.equal(two["embedding_bags.t2.weight"], saved["embedding_bags.t2.weight"])
    # Table-wise at one rank: the mean of all four; the other tables' state exact.
    one = _ranks(1, ["table_wise"] * 3, path, str(tmp_path / "one"), save=False, rowwise=True)
    assert torch.allclose(one[key], per_shard.mean(0), rtol=0, atol=1e-6)
    for k, v in saved.items():
        if not k.startswith("embedding_bags.t2.weight:"):
            assert torch.equal(one[k], v), k


def test_torchrecs_dtensor_form_and_its_sharded_tensor_form_read_each_other(tmp_path):
    """Under `output_dtensor`, TorchRec gives its tables and their fused state as DTensors that
    hold a rank's shards (a table-wise table's on its one rank, whatever the placements say;
    a rank may hold several column shards of a table, not side by side). Saved in that form at
    2 ranks, with t2 in 4 column shards: the ShardedTensor form reads it at 3 ranks bit for bit,
    weights and row-wise Adagrad state, and so does the DTensor form at 2 ranks; at 1 rank,
    table-wise, it reads t2's state by the documented rule (the mean of its column shards). And the other way, with pointwise
    Adagrad: a ShardedTensor checkpoint into the DTensor form at 3 ranks, bit for bit."""
    path = str(tmp_path / "dt")
    kinds = ["table_wise", "column_wise", "column_wise"]
    saved = _ranks(2, kinds, path, str(tmp_path / "saved"), save=True, rowwise=True, dtensor=True)
    key = next(k for k in saved if k.startswith("embedding_bags.t2.weight:"))
    per_shard = saved[key].reshape(4, 80)
    assert torch.count_nonzero(per_shard), "training left row-wise state"
    assert all(not torch.equal(per_shard[0], s) for s in per_shard[1:]), "the column shards' state differs"
    assert saver.torch._meta(path)[0]["rowwise"]["embedding_bags.t2.weight"]["momentum1"] == [[0, 32], [32, 64], [64, 96], [96, 128]]
    got = _ranks(3, ["column_wise", "table_wise", "column_wise"], path, str(tmp_path / "st3"), save=False, rowwise=True)
    assert got.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(got[k], v), k
    # The DTensor form again, each rank holding two column shards of t2 that are not side by
    # side: each reads its own shards' state.
    again = _ranks(2, kinds, path, str(tmp_path / "dt2"), save=False, rowwise=True, dtensor=True)
    for k, v in saved.items():
        assert torch.equal(again[k], v), k
    one = _ranks(1, ["table_wise"] * 3, path, str(tmp_path / "dt1"), save=False, rowwise=True, dtensor=True)
    assert torch.allclose(one[key], per_shard.mean(0), rtol=0, atol=1e-6)
    for k, v in saved.items():
        if k != key:
            assert torch.equal(one[k], v), k
    path = str(tmp_path / "st")
    saved = _ranks(2, kinds, path, str(tmp_path / "saved-st"), save=True)
    got = _ranks(3, ["column_wise", "column_wise", "table_wise"], path, str(tmp_path / "dt3"), save=False, dtensor=True)
    assert got.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(got[k], v), k


def _plain_ebc(seed):
    """The same tables in an EmbeddingBagCollection on the CPU, without DMP."""
    torch.manual_seed(seed)
    configs = [
        torchrec.EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, r, d in TABLES
    ]
    return torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))


def test_an_unsharded_collection_and_a_sharded_plan_read_each_other(tmp_path):
    """Names follow the model: an EmbeddingBagCollection without DMP saves its tables under the
    names DMP gives them, so either reads the other's weights."""
    plain = _plain_ebc(seed=3)
    saver.torch.save(tmp_path / "plain", plain, extra={"plan": "plain"})
    got = _ranks(2, ["column_wise", "table_wise", "column_wise"], str(tmp_path / "plain"), str(tmp_path / "w2"), save=False)
    for name, t in plain.state_dict().items():
        assert torch.equal(got[name], t), name
    # And back: a DMP checkpoint into the plain collection.
    path = str(tmp_path / "dmp")
    saved = _ranks(2, ["table_wise", "column_wise", "column_wise"], path, str(tmp_path / "saved"), save=True)
    back = _plain_ebc(seed=4)
    saver.torch.load(path, back)
    for name, t in back.state_dict().items():
        assert torch.equal(saved[name], t), name


def _by_table(dump):
    """{(table, state): tensor}: Adagrad's state under one name whichever optimizer kept it
    (the dense torch.optim.Adagrad's `sum`, the fused one's `<table>.momentum1`)."""
    out = {}
    for k, v in dump.items():
        table, _, state = k.partition(":")
        state = state.split(".")[-1]
        out[(table, "momentum1" if state == "sum" else state)] = v
    return out


def test_data_parallel_and_sharded_plans_read_each_other_with_their_adagrad_state(tmp_path):
    """A data-parallel table is a plain tensor, whole on every rank, trained by the dense
    optimizer (torch.optim.Adagrad: `sum`); a sharded one by the fused optimizer
    (`momentum1`). Saved with t0 data-parallel, loaded with t0 table-wise and t1, t2
    data-parallel, at 3 ranks and 1: weights and Adagrad state bit for bit. (DCP refuses this
    load: "Missing key".)"""
    path = str(tmp_path / "ck")
    saved = _by_table(_ranks(2, ["data_parallel", "table_wise", "column_wise"], path, str(tmp_path / "saved"), save=True))
    assert torch.count_nonzero(saved[("embedding_bags.t0.weight", "momentum1")]), "training left the dense Adagrad's state"
    assert set(saver.Checkpoint(path).row_tables) == {f"embedding_bags.{n}.weight" for n, _, _ in TABLES}
    for world, kinds in ((3, ["table_wise", "data_parallel", "data_parallel"]), (1, ["column_wise", "data_parallel", "table_wise"])):
        got = _by_table(_ranks(world, kinds, path, str(tmp_path / f"w{world}"), save=False))
        assert got.keys() == saved.keys(), (world, kinds)
        for k, v in saved.items():
            assert torch.equal(got[k], v), (world, kinds, k)


#: An EmbeddingCollection's tables share one dimension; 64 makes two column shards of 32.
EC_TABLES = [("t0", 100, 64), ("t1", 250, 64), ("t2", 80, 64)]


def _ec_run(rank, world, port, kinds, path, out, save, dtensor=False):
    """An EmbeddingCollection (sequence embeddings) under DMP, its tables trained by TorchRec's
    fused SGD (no state): saved, or loaded and dumped."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    with gloo_ranks.group(rank, world, port):
        torch.manual_seed(1 if save else 2)
        configs = [torchrec.EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r, d in EC_TABLES]
        ec = torchrec.EmbeddingCollection(tables=configs, device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": 0.5})
        constraints = {n: ParameterConstraints(sharding_types=[k], min_partition=32 if k == "column_wise" else None) for (n, _, _), k in zip(EC_TABLES, kinds)}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints)
        plan = planner.collective_plan(ec, [EmbeddingCollectionSharder()], dist.GroupMember.WORLD)
        env = ShardingEnv(world, rank, dist.GroupMember.WORLD, output_dtensor=dtensor)
        model = DistributedModelParallel(ec, device=torch.device("cpu"), plan=plan, env=env)
        if save:
            g = torch.Generator().manual_seed(100 + rank)
            keys = [f"f_{n}" for n, _, _ in EC_TABLES]
            lengths = torch.randint(1, 4, (len(keys) * 8,), generator=g)
            values = torch.cat([torch.randint(0, EC_TABLES[i // 8][1], (int(l),), generator=g) for i, l in enumerate(lengths)])
            out_ = model(KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths))
            sum(jt.values().sum() for jt in out_.values()).backward()
            saver.torch.save(path, model, step=1)
        else:
            saver.torch.load(path, model)
        torch.save(_dump(model), os.path.join(out, f"rank{rank}.pt"))


def _ec_ranks(world, kinds, path, out, save, dtensor=False):
    os.makedirs(out, exist_ok=True)
    mp.spawn(_ec_run, args=(world, _free_port(), kinds, path, out, save, dtensor), nprocs=world, join=True)
    return _whole([torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)])


def test_an_embedding_collection_with_fused_sgd_reads_into_other_plans(tmp_path):
    """EmbeddingCollection's tables are named `embeddings.<table>.weight`; trained by fused SGD
    they carry no optimizer state. Saved table-wise and column-wise at 2 ranks (after a step,
    so the weights moved from their seed), loaded into other plans at 3 ranks and 1, and at 3
    in TorchRec's DTensor form."""
    path = str(tmp_path / "ck")
    saved = _ec_ranks(2, ["table_wise", "column_wise", "column_wise"], path, str(tmp_path / "saved"), save=True)
    assert set(saver.Checkpoint(path).row_tables) == {f"embeddings.{n}.weight" for n, _, _ in EC_TABLES}
    assert all(set(t["slots"]) == {"param"} for t in saver.Checkpoint(path).row_tables.values())
    for world, kinds, dtensor in ((3, ["column_wise", "table_wise", "table_wise"], False), (1, ["table_wise"] * 3, False),
                                  (3, ["table_wise", "column_wise", "column_wise"], True)):
        got = _ec_ranks(world, kinds, path, str(tmp_path / f"w{world}-{dtensor}"), save=False, dtensor=dtensor)
        assert got.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(got[k], v), (world, kinds, k)


def test_row_wise_adagrad_state_reads_between_the_fused_and_the_plain_optimizer(tmp_path):
    """torchrec.optim.RowWiseAdagrad on an unsharded collection keeps one `sum` a row ([rows,
    1], for all the columns); the fused one on DMP one `momentum1` a row per column shard. A
    fused checkpoint (t2 in 4 column shards) loads into the plain optimizer by the documented
    rule (the mean of the column shards, weighted by their columns; exact for a table kept
    whole), and a plain checkpoint into any column cut (each shard gets the row's value)."""
    path = str(tmp_path / "fused")
    saved = _ranks(2, ["table_wise", "table_wise", "column_wise"], path, str(tmp_path / "saved"), save=True, rowwise=True)
    plain = _plain_ebc(seed=5)
    opt = torchrec.optim.RowWiseAdagrad(plain.parameters(), lr=0.1)
    saver.torch.load(path, plain, opt)
    for n, rows, _ in TABLES:
        per_shard = next(v for k, v in saved.items() if k.startswith(f"embedding_bags.{n}.weight:")).reshape(-1, rows)
        got = opt.state[plain.embedding_bags[n].weight]["sum"]
        assert got.shape == (rows, 1)
        if per_shard.shape[0] == 1:
            assert torch.equal(got.reshape(-1), per_shard[0]), n
        else:
            assert torch.allclose(got.reshape(-1), per_shard.mean(0), rtol=0, atol=1e-6), n
    # And back: the plain optimizer's state, after training, into a plan of column shards.
    plain = _plain_ebc(seed=6)
    opt = torchrec.optim.RowWiseAdagrad(plain.parameters(), lr=0.1)
    _train(plain, 0, 2, opt)
    saver.torch.save(tmp_path / "plain", plain, opt, extra={"plan": "plain"})
    got = _ranks(2, ["table_wise", "column_wise", "column_wise"], str(tmp_path / "plain"), str(tmp_path / "w2"), save=False, rowwise=True, min_partition=8)
    for n, rows, _ in TABLES:
        want = opt.state[plain.embedding_bags[n].weight]["sum"].reshape(-1)
        assert torch.count_nonzero(want), n
        per_shard = next(v for k, v in got.items() if k.startswith(f"embedding_bags.{n}.weight:")).reshape(-1, rows)
        assert n != "t2" or per_shard.shape[0] > 1, "t2 is cut into column shards"
        for shard in per_shard:
            assert torch.equal(shard, want), n
        assert torch.equal(got[f"embedding_bags.{n}.weight"], plain.state_dict()[f"embedding_bags.{n}.weight"]), n


def test_row_wise_state_whose_metadata_disagrees_with_its_shape_is_refused(tmp_path, monkeypatch):
    """A row-wise state's slot holds one column per saved column shard, whose ranges the
    metadata names: a checkpoint where the two disagree is refused by name, never read into
    the wrong columns."""
    plain = _plain_ebc(seed=7)
    opt = torchrec.optim.RowWiseAdagrad(plain.parameters(), lr=0.1)
    _train(plain, 0, 1, opt)
    collect = saver.torch._saving._collect

    def three_ranges(*args, **kwargs):
        items, meta = collect(*args, **kwargs)
        meta["rowwise"] = {"embedding_bags.t2.weight": {"sum": [[0, 32], [32, 64], [64, 128]]}}
        return items, meta

    monkeypatch.setattr(saver.torch._saving, "_collect", three_ranges)
    saver.torch.save(tmp_path / "ck", plain, opt)
    back = _plain_ebc(seed=8)
    with pytest.raises(saver.InputError, match=r"embedding_bags\.t2\.weight: .*'sum' of shape \(80, 1\) has 3 column ranges"):
        saver.torch.load(tmp_path / "ck", back, torchrec.optim.RowWiseAdagrad(back.parameters(), lr=0.1))


def _run_with_torchrecs_optimizers(rank, world, port, path, out, save):
    """Saves with the model's fused optimizer, and with a CombinedOptimizer of it, as TorchRec's
    own examples pass them (the fused part is the model's: nothing else is left); or loads both
    into fresh models with no optimizer."""
    from torchrec.optim.keyed import CombinedOptimizer

    kinds = ["table_wise", "table_wise", "column_wise"]
    with gloo_ranks.group(rank, world, port):
        model = _model(world, kinds, seed=1 if save else 2)
        if save:
            _train(model, rank, 2)
            saver.torch.save(os.path.join(path, "fused"), model, model.fused_optimizer)
            saver.torch.save(os.path.join(path, "combined"), model, CombinedOptimizer([("fused", model.fused_optimizer)]))
            torch.save(_dump(model), os.path.join(out, f"rank{rank}.pt"))
        else:
            for kind in ("fused", "combined"):
                saver.torch.load(os.path.join(path, kind), model, CombinedOptimizer([("fused", model.fused_optimizer)]))
                torch.save(_dump(model), os.path.join(out, f"{kind}{rank}.pt"))


def test_torchrecs_own_optimizers_are_accepted_the_fused_part_taken_from_the_model(tmp_path):
    path, out = str(tmp_path / "ck"), str(tmp_path / "out")
    os.makedirs(path)
    os.makedirs(out)
    mp.spawn(_run_with_torchrecs_optimizers, args=(2, _free_port(), path, out, True), nprocs=2, join=True)
    mp.spawn(_run_with_torchrecs_optimizers, args=(2, _free_port(), path, out, False), nprocs=2, join=True)
    for rank in range(2):
        saved = torch.load(os.path.join(out, f"rank{rank}.pt"))
        for kind in ("fused", "combined"):
            got = torch.load(os.path.join(out, f"{kind}{rank}.pt"))
            assert saved.keys() == got.keys()
            for k, v in saved.items():
                assert torch.equal(got[k], v), (kind, k)


def _run_load_other_optimizer(rank, world, port, path, out, rowwise):
    with gloo_ranks.group(rank, world, port):
        model = _model(world, ["table_wise", "table_wise", "column_wise"], seed=2, rowwise=rowwise)
        try:
            saver.torch.load(path, model, None)
            said = "loaded"
        except saver.InputError as e:
            said = str(e)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(said)


def test_a_fused_state_of_another_optimizer_is_refused_in_one_line_that_says_so(tmp_path):
    """Row-wise Adagrad's state into pointwise Adagrad and the other way: each refused saying
    which optimizer keeps the state how (before: a message of DTensors, or "holds no optimizer
    state 'momentum1', only ['momentum1']")."""
    for saved_rowwise, said in ((True, "holds 'momentum1' row-wise"), (False, "not as the model's optimizer keeps it")):
        path = str(tmp_path / f"ck-{saved_rowwise}")
        _ranks(1, ["table_wise"] * 3, path, str(tmp_path / f"s-{saved_rowwise}"), save=True, rowwise=saved_rowwise)
        out = str(tmp_path / f"o-{saved_rowwise}")
        os.makedirs(out)
        mp.spawn(_run_load_other_optimizer, args=(1, _free_port(), path, out, not saved_rowwise), nprocs=1, join=True)
        got = open(os.path.join(out, "rank0.txt")).read()
        assert said in got and "only [" not in got and "DTensor" not in got, got


def _run_move(rank, world, port, kinds, path, out, strict):
    """Loads `path` into a model of plan `kinds` (fused RowWiseAdagrad on its sharded tables,
    the dense Adagrad on its data-parallel ones), with `strict`: what it said and warned, and
    the model's tables and states before and after."""
    import warnings

    with gloo_ranks.group(rank, world, port):
        model = _model(world, kinds, seed=2, rowwise=True, min_partition=8)
        dense = _dense_optimizer(model)
        before = _dump(model, dense)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                saver.torch.load(path, model, dense, strict=strict)
                said = None
            except saver.InputError as e:
                said = str(e)
        warned = [str(w.message) for w in seen if issubclass(w.category, saver.SaverWarning)]
        torch.save({"said": said, "warned": warned, "before": before, "after": _dump(model, dense)}, os.path.join(out, f"rank{rank}.pt"))


def test_a_table_moving_between_the_fused_and_the_dense_optimizer_converts_its_adagrad_state_or_is_refused(tmp_path):
    """The usual TorchRec pair: sharded tables trained by the fused RowWiseAdagrad (`momentum1`,
    one value a row per column shard), data-parallel ones by the dense torch.optim.Adagrad
    (`sum`, one value a row and column). Saved with t0 table-wise, t1 data-parallel and t2 in
    column shards; loaded with t0 and t2 data-parallel and t1 in column shards. Under strict the
    load is refused on every rank, naming the conversion, and the model is untouched (before:
    t0's and t2's state silently fresh zeros). Without strict each state is converted by the
    documented rule, with a warning: `momentum1` broadcast over the columns of its shard, `sum`
    averaged over the columns of each new shard; the weights bit for bit."""
    path = str(tmp_path / "ck")
    saved = _by_table(_ranks(2, ["table_wise", "data_parallel", "column_wise"], path, str(tmp_path / "saved"), save=True, rowwise=True))
    ranges = saver.torch._meta(path)[0]["rowwise"]["embedding_bags.t2.weight"]["momentum1"]
    assert len(ranges) > 1, ranges
    kinds = ["data_parallel", "column_wise", "data_parallel"]
    for strict in (True, False):
        out = str(tmp_path / f"strict-{strict}")
        os.makedirs(out)
        mp.spawn(_run_move, args=(2, _free_port(), kinds, path, out, strict), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
        if strict:
            for r in ranks:
                assert r["said"] is not None and "strict=False converts it" in r["said"], r["said"]
                assert r["before"].keys() == r["after"].keys()
                assert all(torch.equal(r["before"][k], v) for k, v in r["after"].items()), "a refused load changed the model"
            continue
        assert all(r["said"] is None for r in ranks), [r["said"] for r in ranks]
        assert all(any("converted" in w for w in r["warned"]) for r in ranks), [r["warned"] for r in ranks]
        got = _by_table(_whole([r["after"] for r in ranks]))
        for n, rows, cols in TABLES:
            table = f"embedding_bags.{n}.weight"
            assert torch.equal(got[(table, "")], saved[(table, "")]), table
        # Row-wise into element-wise: each saved column shard's value over its columns.
        for n, cuts in (("t0", [[0, 16]]), ("t2", ranges)):
            rows = dict((t, r) for t, r, _ in TABLES)[n]
            per_shard = saved[(f"embedding_bags.{n}.weight", "momentum1")].reshape(-1, rows)
            dense = got[(f"embedding_bags.{n}.weight", "momentum1")]
            assert torch.count_nonzero(per_shard), n
            for j, (a, b) in enumerate(cuts):
                assert torch.equal(dense[:, a:b], per_shard[j].unsqueeze(1).expand(-1, b - a)), (n, a, b)
        # Element-wise into row-wise: each row's mean over the columns of each new shard.
        rows, cols = TABLES[1][1], TABLES[1][2]
        elementwise = saved[("embedding_bags.t1.weight", "momentum1")]
        per_shard = got[("embedding_bags.t1.weight", "momentum1")].reshape(-1, rows)
        assert per_shard.shape[0] > 1, "t1 is cut into column shards"
        width = cols // per_shard.shape[0]
        for j, shard in enumerate(per_shard):
            assert torch.allclose(shard, elementwise[:, j * width:(j + 1) * width].mean(1), rtol=1e-6, atol=0), j


def _dcp_run(rank, world, port, kinds, ours, theirs, out, save):
    import torch.distributed.checkpoint as dcp

    import saver.dcp

    with gloo_ranks.group(rank, world, port):
        model = _model(world, kinds, seed=1 if save else 2)
        if save:
            _train(model, rank, 2, _dense_optimizer(model))
            # TorchRec's own recipe: the model's state dict through DCP, its tables ShardedTensors.
            sd = model.state_dict()
            dcp.save(sd, storage_writer=saver.dcp.StorageWriter(ours))
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(theirs))
        else:
            sd = model.state_dict()
            dcp.load(sd, storage_reader=saver.dcp.StorageReader(ours))
            model.load_state_dict(sd)
            mine = {k: v for k, v in _dump(model).items() if ":" not in k[0]}
            oracle = _model(world, kinds, seed=3)
            sd = oracle.state_dict()
            dcp.load(sd, storage_reader=dcp.FileSystemReader(theirs))
            oracle.load_state_dict(sd)
            # Once on every rank: a dump reads the fused optimizer's state, a collective.
            theirs_dump = _dump(oracle)
            for k, v in mine.items():
                assert torch.equal(v, theirs_dump[k]), k
        torch.save({k: v for k, v in _dump(model).items() if ":" not in k[0]}, os.path.join(out, f"rank{rank}.pt"))


def test_a_torchrec_state_dict_through_dcp_and_saver_loads_into_another_plan_as_dcps_own(tmp_path):
    ours, theirs = str(tmp_path / "saver"), str(tmp_path / "dcp")

    def ranks(world, kinds, out, save):
        os.makedirs(out, exist_ok=True)
        mp.spawn(_dcp_run, args=(world, _free_port(), kinds, ours, theirs, out, save), nprocs=world, join=True)
        return _whole([torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)])

    saved = ranks(2, ["table_wise", "table_wise", "column_wise"], str(tmp_path / "saved"), True)
    assert saver.verify(ours)["status"] == "ok"
    got = ranks(2, ["column_wise", "table_wise", "table_column_wise"], str(tmp_path / "loaded"), False)
    assert saved.keys() == got.keys()
    for k, v in saved.items():
        assert torch.equal(got[k], v), k
