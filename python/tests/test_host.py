"""The host seam (saver/_host.py, with its staging ring saver/_staging.py) is the one place
where a tensor becomes host memory and back: no other module of the package calls `.cpu()`,
`.numpy()` or `.to(...)` on a tensor or looks at its device, so that what a device tensor gets
(staged through the ring, copied, or refused) is decided there alone."""

import ast
import os

import numpy as np
import pytest
import torch

import saver
from saver import _host

PACKAGE = os.path.dirname(saver.__file__)
#: What only the seam may do to a tensor.
HOST_ONLY = {"cpu", "numpy", "cuda", "to", "device", "pin_memory", "from_numpy"}


def _sources():
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(root, f)


def test_no_module_but_the_host_seam_moves_a_tensor_to_or_from_host_memory():
    offenders = []
    for path in _sources():
        if os.path.basename(path) in ("_host.py", "_staging.py"):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Attribute) and node.attr in HOST_ONLY:
                offenders.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}: .{node.attr}")
    assert not offenders, "only saver/_host.py may do this:\n" + "\n".join(offenders)


def test_the_seam_takes_cpu_tensors_without_a_copy_and_refuses_to_fill_a_device_tensor():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = _host.readable(t, "t")
    assert a.ctypes.data == t.data_ptr(), "a CPU tensor is read in place"
    w = _host.writable(t, "t")
    w[0, 0] = 42
    assert t[0, 0] == 42, "a load fills the tensor's own memory"
    back = _host.tensor_of(np.ones(5, np.float32))
    assert back.dtype == torch.float32 and back.shape == (5,)
    meta = torch.empty(3, device="meta")
    with pytest.raises(saver.InputError, match=r"buf is on meta; load into a CPU tensor"):
        _host.writable(meta, "buf")
    with pytest.raises(saver.InputError, match=r"p is on meta; saver.torch saves CPU tensors"):
        _host.on_host(meta, "p", "saver.torch saves CPU tensors")
