"""Tensors of dtypes numpy has no type for (bfloat16, the 8-bit floats), from torch, bit
patterns of their own and loads: stored as their own dtype, back bit for bit.

torch is a requirement of this suite (python/tests/run.sh installs the pinned version): a missing
torch fails here, it does not skip."""

import numpy as np
import pytest
import torch

import saver
from test_saver import by_id


def test_torch_16_bit_and_8_bit_floats_are_saved_as_their_dtype_and_come_back_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(3)
    n = 3000
    ids = torch.randperm(1 << 20, generator=g)[:n].to(torch.int64)
    emb = torch.randn(n, 8, generator=g).to(torch.bfloat16)
    state = torch.randn(n, 8, generator=g).to(torch.float16)
    scale = torch.randn(n, generator=g).to(torch.float8_e4m3fn)
    dense = {
        "w_bf16": torch.randn(4, 5, generator=g).to(torch.bfloat16),
        "w_f8": torch.randn(7, generator=g).to(torch.float8_e5m2),
    }
    # A strided view: taken as its values, not its storage.
    dense["w_t"] = torch.randn(5, 4, generator=g).to(torch.bfloat16).t()
    saver.save(
        tmp_path / "c",
        tables={"t": {"ids": ids, "emb": emb, "state": state, "scale": scale}},
        dense=dense,
        shards=2,
    )
    loaded = saver.load(tmp_path / "c")
    got = by_id(loaded.tables["t"])
    order = torch.argsort(ids)
    assert isinstance(got["emb"], saver.Bits) and got["emb"].saver_dtype == "BF16"
    assert got["state"].dtype == np.float16
    assert isinstance(got["scale"], saver.Bits) and got["scale"].saver_dtype == "F8_E4M3"
    assert torch.equal(torch.from_numpy(got["emb"]).view(torch.bfloat16), emb[order])
    assert torch.equal(torch.from_numpy(got["state"]), state[order])
    back_scale = torch.from_numpy(got["scale"]).view(torch.float8_e4m3fn)
    assert torch.equal(back_scale.view(torch.uint8), scale[order].view(torch.uint8))
    for name, want in dense.items():
        b = loaded.dense[name]
        assert isinstance(b, saver.Bits), name
        as_torch = torch.from_numpy(np.asarray(b)).view(want.dtype)
        assert as_torch.shape == want.shape, name
        assert torch.equal(as_torch.view(torch.uint8 if want.element_size() == 1 else torch.int16),
                           want.contiguous().view(torch.uint8 if want.element_size() == 1 else torch.int16)), name


def test_a_loaded_bf16_model_saved_again_keeps_its_dtype(tmp_path):
    rng = np.random.default_rng(5)
    ids = np.arange(100, dtype=np.int64)
    patterns = rng.integers(0, 1 << 16, size=(100, 4), dtype=np.uint16)
    saver.save(tmp_path / "a", tables={"t": {"ids": ids, "emb": saver.Bits(patterns, "BF16")}},
               dense={"d": saver.Bits(patterns[0], "BF16")})
    first = saver.load(tmp_path / "a")
    saver.save(tmp_path / "b", tables=first.tables, dense=first.dense)
    second = saver.load(tmp_path / "b")
    assert second.tables["t"]["emb"].saver_dtype == "BF16"
    assert second.dense["d"].saver_dtype == "BF16"
    np.testing.assert_array_equal(by_id(second.tables["t"])["emb"], patterns)
    # One content, whatever the way it came: the two checkpoints have one digest.
    assert saver.digest(tmp_path / "a") == saver.digest(tmp_path / "b")


def test_bit_patterns_of_the_wrong_width_or_an_unknown_dtype_are_refused_by_name(tmp_path):
    with pytest.raises(saver.InputError, match="16-bit patterns"):
        saver.Bits(np.zeros(3, dtype=np.uint8), "BF16")
    with pytest.raises(saver.InputError, match="dtype must be one of"):
        saver.Bits(np.zeros(3, dtype=np.uint16), "F17")
    # A torch dtype numpy holds but saver does not store: named with its slot.
    with pytest.raises(saver.InputError, match="slot 'c'.*complex64"):
        saver.save(tmp_path / "x", tables={"t": {"ids": np.arange(2), "c": torch.zeros(2, 2, dtype=torch.complex64)}})
    assert not (tmp_path / "x").exists()
