"""gockpt.core.digest: the digest of a tensor's bytes -- its definition, the batched form equal
to one tensor at a time (the CPU's C++ core equal to the definition in torch ops, whatever its
threads), what it tells apart, and the live-digest thread."""

import numpy as np
import pytest
import torch

from gockpt.capture.device import HostDevice
from gockpt.core.digest import ROW, LiveDigests, as_pairs, digest, digests, is_hex, to_hex

MASK = (1 << 64) - 1


def reference(t: torch.Tensor):
    """The definition, word by word in Python integers."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    w = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        flat.element_size()]).tolist()
    a = b = 0
    for j in range(0, len(w), ROW):
        r = sum(w[j:j + ROW])
        a, b = a + r, b + r * (2 * (j // ROW) + 1)
    return a & MASK, b & MASK


def tensors():
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(n, generator=g) for n in (0, 1, 5, ROW - 1, ROW, ROW + 1, 1000, 70001)]
    out += [torch.randn(3, 300, generator=g).bfloat16(), torch.randn(40, generator=g).half(),
            torch.randint(-2 ** 62, 2 ** 62, (600,), generator=g), torch.randn(33).double(),
            torch.tensor([True, False, True]), torch.randint(0, 255, (999,), dtype=torch.uint8),
            torch.full((ROW * 3,), float("nan")), torch.randn(7, 9).t()]  # not contiguous
    return out


def test_batched_digests_are_the_definition_of_each_tensor():
    ts = tensors()
    got = as_pairs(digests(ts))
    for t, pair in zip(ts, got):
        assert pair == reference(t) == digest(t), (t.dtype, tuple(t.shape))
    assert digests([]).shape == (0, 2)


@pytest.mark.parametrize("dtype, lo, hi", [(torch.int8, -2**7, 2**7), (torch.int16, -2**15, 2**15),
                                           (torch.int32, -2**31, 2**31),
                                           (torch.int64, -2**63, 2**63 - 1)])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_the_cpu_digests_are_the_torch_definition_whatever_the_threads(dtype, lo, hi, threads):
    # gockpt._C cuts a tensor into pieces of whole rows spread over its threads: pieces, a
    # short last row, extreme words whose 64-bit row sums wrap, at odd offsets; against the
    # definition written in torch ops (the GPU path's arithmetic)
    g = torch.Generator().manual_seed(3)
    n = 3 * 256 * ROW + 5 * ROW + 7
    w = torch.randint(lo, hi, (n + 1,), dtype=dtype, generator=g)
    w[:ROW] = lo
    w[ROW:2 * ROW] = hi - 1
    w[-ROW - 1:] = hi - 1
    for view in (w[:n], w[1:], w[:ROW - 3], w[:0]):
        full = view.numel() // ROW * ROW
        rows = view[:full].view(-1, ROW).sum(1, dtype=torch.int64)
        if view.numel() > full:
            rows = torch.cat([rows, view[full:].sum(dtype=torch.int64).reshape(1)])
        a = int(rows.sum()) & MASK
        b = int((rows * (2 * torch.arange(rows.numel()) + 1)).sum()) & MASK
        assert as_pairs(digests([view], threads)) == [(a, b)] == [digest(view)]


def test_the_cpu_digests_refuse_what_is_not_words():
    from gockpt import _C
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="element size 3"):
        _C.digests(np.array([x.data_ptr()]), np.array([8]), np.array([3]), 1)
    with pytest.raises(ValueError, match="null address"):
        _C.digests(np.array([0]), np.array([8]), np.array([4]), 1)
    with pytest.raises(ValueError, match="words"):
        _C.digests(np.array([x.data_ptr()]), np.array([-1]), np.array([4]), 1)


def test_what_the_digest_tells_apart():
    x = torch.from_numpy(np.random.default_rng(1).standard_normal(4 * ROW, dtype=np.float32))
    base = digest(x)
    assert digest(torch.zeros(4 * ROW)) == (0, 0) != base
    for i in (0, 17, 4 * ROW - 1):  # any single word, any bit
        for bit in (0, 22, 31):
            y = x.clone()
            y.view(torch.int32)[i] ^= 1 << bit
            assert digest(y)[0] != base[0] and digest(y)[1] != base[1]
    swapped = torch.cat([x[ROW:2 * ROW], x[:ROW], x[2 * ROW:]])  # rows moved: same sum
    assert digest(swapped)[0] == base[0] and digest(swapped)[1] != base[1]
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))


def test_the_spelling_in_the_manifest():
    # (seeded: an unseeded draw's digest spelled no a-f now and then, upper() then equal)
    h = to_hex(digest(torch.randn(100, generator=torch.Generator().manual_seed(0))))
    assert is_hex(h) and len(h) == 32 and h != h.upper()
    assert not is_hex(h.upper()) and not is_hex(h[:-1]) and not is_hex(None) and not is_hex(7)


def test_live_digests_of_tensors_as_they_were_when_submitted():
    digester = LiveDigests(HostDevice())
    ts = tensors()
    ticket = digester.submit(ts)
    HostDevice().order_after_digests(ticket)  # after this, writing them is allowed
    want = [reference(t) for t in ts]
    for t in ts:
        if t.numel() and t.dtype.is_floating_point:
            t.zero_()
    assert ticket.pairs() == want and ticket.seconds > 0
    bad = digester.submit([torch.randn(4).to_sparse()])
    with pytest.raises(TypeError, match="dense tensor"):
        bad.pairs()
    digester.close()
