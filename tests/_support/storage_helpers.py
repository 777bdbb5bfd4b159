"""Shared by the tests of gockpt.storage (tests/storage/): sample tensors, saving a checkpoint,
bit-exact comparison."""

import os

import torch

from gockpt import storage
from gockpt.storage import CheckpointWriter

MiB = 1 << 20


def odd_tensors():
    """Tensors of awkward sizes (around 4096 and the chunk size), dtypes and layouts."""
    g = torch.Generator().manual_seed(1)

    def u8(n):
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    return {
        "one_byte": u8(1),
        "b4095": u8(4095),
        "b4096": u8(4096),
        "b4097": u8(4097),
        "b4MiB+1": u8(4 * MiB + 1),
        "f32_9MiB": torch.randn(9 * MiB // 4 + 3, generator=g),
        "bf16": torch.randn(3, 1001, generator=g).bfloat16(),
        "scalar": torch.tensor(-1.5, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "noncontig": torch.randn(300, 70, generator=g).t()[::2],
        "bool": torch.tensor([True, False] * 3000),
    }


def sample_tensors():
    """Small tensors of every promised dtype, special values, empty and non-contiguous ones."""
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 4, generator=g),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "f64": torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float64),
        "i64": torch.tensor([-(2**63), 2**63 - 1]),
        "i32": torch.arange(-4, 4, dtype=torch.int32),
        "i16": torch.arange(7, dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 7),
        "empty_i": torch.empty(3, 0, dtype=torch.int64),
        "noncontig": torch.arange(24.0).reshape(4, 6).t()[1:, ::2],
        "u32": torch.tensor([0, 1, 2**32 - 1], dtype=torch.int64).to(torch.uint32),
    }


def bits(t):
    """The bytes of ``t`` as a flat uint8 tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(expected, got):
    """Same names in the same order, same dtypes and shapes, same bytes."""
    assert list(got) == list(expected)
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(bits(got[k]), bits(t)), k


def save(root, name, tensors=None, manifest=None, **commit_kw):
    """Commit ``tensors`` (default: sample_tensors()) as checkpoint ``name``; returns its path."""
    w = CheckpointWriter(str(root), name)
    w.write_tensors(sample_tensors() if tensors is None else tensors)
    return w.commit({"step": 1} if manifest is None else manifest, **commit_kw)


def save_with(root, name, tensors, **writer_kw):
    """Commit ``tensors`` with a CheckpointWriter given ``writer_kw``; returns (path, writer)."""
    w = CheckpointWriter(str(root), name, **writer_kw)
    w.write_tensors(tensors)
    path = w.commit({"k": 1})
    return path, w


def data_bytes(path):
    """The whole data file of checkpoint ``path``."""
    with open(os.path.join(path, storage.DATA_FILE), "rb") as f:
        return f.read()


def flip_byte(path, offset):
    """Flip the lowest bit of the byte at ``offset`` of file ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def layout_of(tensors):
    """The ``begin`` layout {name: (dtype, shape)} of ``tensors``."""
    return {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
