"""gockpt.replay.digest: the C++ digest equals the torch int64 one (what a GPU runs), adds up
over slices, sees every single flipped bit, and batches."""
import numpy as np
import pytest
import torch

from gockpt import _C
from gockpt.replay.digest import DIGEST_MULTIPLIER, digest, digest_segments, digest_torch

SIZES = (0, 1, 7, 1000, (1 << 20) + 3)
FIRSTS = (0, 1, 5, (1 << 33) + 7)
SPECIALS = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-45,
            1.17e-38, 3.4028235e38, -3.4028235e38, 1.0]
MASK = (1 << 64) - 1


def _isas():
    hw = _C.isa()
    return ["generic"] + (["avx2"] if hw in ("avx2", "avx512") else []) + \
        (["avx512"] if hw == "avx512" else [])


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    _C.set_isa("auto")


def _words(n, seed):
    """Random bit patterns (NaNs with payloads, infinities, subnormals among them) and the
    special values, as float32."""
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    t = torch.from_numpy(w.view(np.float32).copy())
    k = min(n, len(SPECIALS))
    t[:k] = torch.tensor(SPECIALS[:k], dtype=torch.float32)
    return t


def _reference(t, first):
    """The definition with Python integers."""
    w = t.view(torch.int32).numpy().view(np.uint32).astype(object)
    idx = np.arange(first, first + len(w), dtype=object)
    d1 = int(np.sum(w * (2 * idx + 1))) if len(w) else 0
    d2 = int(np.sum(w * (((idx * (DIGEST_MULTIPLIER & MASK)) & MASK) | 1))) if len(w) else 0
    return d1 & MASK, d2 & MASK


def test_multiplier_constant():
    assert DIGEST_MULTIPLIER & MASK == 0x9E3779B97F4A7C15 and DIGEST_MULTIPLIER < 0


@pytest.mark.parametrize("n", SIZES)
def test_cpp_equals_torch(n):
    t = _words(n, seed=n)
    for first in FIRSTS:
        want = digest_torch(t, first)
        for isa in _isas():
            _C.set_isa(isa)
            assert digest(t, first) == want, (isa, first)
        _C.set_isa("auto")
    if n <= 1000:
        for first in FIRSTS:
            assert digest(t, first) == _reference(t, first)


def test_unaligned_and_odd_starts():
    t = _words(4099, seed=1)
    for isa in _isas():
        _C.set_isa(isa)
        for a in range(9):  # starts off 64-byte alignment, lengths around vector widths
            for b in (a, a + 1, a + 15, a + 33, 4099):
                assert digest(t[a:b], a + 3) == digest_torch(t[a:b], a + 3)


def test_digest_of_slices_adds_up():
    t = _words(100003, seed=2)
    first = 12345
    whole = digest(t, first)
    cuts = [0, 1, 8, 1000, 65536, 65541, 100003]
    d1 = d2 = 0
    for a, b in zip(cuts[:-1], cuts[1:]):
        s1, s2 = digest(t[a:b], first + a)
        d1, d2 = (d1 + s1) & MASK, (d2 + s2) & MASK
    assert (d1, d2) == whole


def test_single_flipped_bit_changes_d1():
    t = _words(4099, seed=3)
    base = digest(t, 7)
    words = t.numpy().view(np.uint32)  # shares t's memory
    for i in (0, 1, 15, 16, 17, 2047, 4096, 4098):
        for bit in range(32):
            words[i] ^= np.uint32(1 << bit)
            d1, d2 = digest(t, 7)
            words[i] ^= np.uint32(1 << bit)
            assert d1 != base[0] and d2 != base[1], (i, bit)
    assert digest(t, 7) == base


def test_position_matters():
    t = torch.tensor([1.0, 2.0, 3.0])
    assert digest(t) != digest(torch.tensor([2.0, 1.0, 3.0]))
    assert digest(t, 0) != digest(t, 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_batch_equals_per_segment(threads):
    t = _words((1 << 21) + 77, seed=4)
    segs = [(0, 0), (0, 1), (5, 1000), (1000, (1 << 20) + 9), ((1 << 20) + 9, (1 << 21) + 77),
            (3, 3), (17, 4096)]
    base = t.data_ptr()
    src = np.array([base + 4 * a for a, _ in segs], dtype=np.int64)
    nwords = np.array([b - a for a, b in segs], dtype=np.int64)
    first = np.array([a + 11 * k for k, (a, _) in enumerate(segs)], dtype=np.int64)
    got = digest_segments(src, nwords, first, threads=threads)
    assert got.dtype == np.uint64 and got.shape == (len(segs), 2)
    for k, (a, b) in enumerate(segs):
        assert tuple(int(x) for x in got[k]) == digest(t[a:b], int(first[k]))
    assert digest_segments([], [], []).shape == (0, 2)


@pytest.mark.parametrize("call, match", [
    (lambda: digest(torch.zeros(4, dtype=torch.float64)), "float32"),
    (lambda: digest(torch.zeros(8)[::2]), "contiguous"),
    (lambda: digest(torch.zeros(4), first=-1), "first"),
    (lambda: digest_torch(np.zeros(4, np.float32)), "torch.Tensor"),
    (lambda: digest_segments([0], [1, 2], [0]), "nwords has 2 elements"),
    (lambda: digest_segments([0], [-1], [0]), "nwords.0. is negative"),
    (lambda: digest_segments([0.5], [1], [0]), "integer"),
])
def test_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cpp_out_array_checked():
    t = torch.zeros(4)
    src = np.array([t.data_ptr()], np.int64)
    one = np.ones(1, np.int64)
    for out in (np.empty(2, np.int64), np.empty(3, np.uint64), np.empty((2, 2), np.uint64)[:, 0]):
        with pytest.raises(ValueError, match="out must be"):
            _C.digest_batch(src, one, one, out, 1)
    ro = np.empty(2, np.uint64)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be"):
        _C.digest_batch(src, one, one, ro, 1)


@pytest.mark.parametrize("n,block", [(1, 4), (100, 16), (1003, 64), (4096, 4096), (70000, 1000)])
def test_block_digests_with_torch_ops_equal_the_host_digests(n, block):
    """What a GPU runs for the live blocks (torch int64 ops), checked on the CPU against C++."""
    from gockpt.replay.digest import block_digests_torch
    t = torch.randn(n)
    t[::7] = float("nan")
    got = block_digests_torch(t, block, window=3 * block).numpy().view(np.uint64)
    starts = np.arange(0, n, block, dtype=np.int64)
    want = digest_segments(t.data_ptr() + 4 * starts, np.minimum(block, n - starts), starts)
    assert np.array_equal(got, want)
