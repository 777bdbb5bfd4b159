"""arithmetic.replay_batch (_C.adam_replay_batch): one call for many slices of many parameters,
bit-identical to adam_replay on each slice alone."""
import numpy as np
import pytest
import torch

from gockpt import _C
from gockpt.replay import arithmetic

# The args table: CPU and CUDA profiles, both lerp branches, L2 / decoupled decay, grad_scale.
TABLE = [
    dict(impl="single", decoupled=True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
         weight_decay=0.1, step=3),
    dict(impl="foreach", decoupled=False, lr=2e-3, beta1=0.3, beta2=0.95, eps=1e-6,
         weight_decay=0.05, step=1),
    dict(impl="fused", decoupled=True, lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8,
         weight_decay=0.1, step=7),
    dict(impl="fused", decoupled=False, lr=1e-3, beta1=0.8, beta2=0.999, eps=1e-7,
         weight_decay=0.01, step=2),
    dict(impl="cuda-forloop", decoupled=True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
         weight_decay=0.1, step=5),
    dict(impl="cuda-foreach", decoupled=False, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
         weight_decay=0.1, step=4),
    dict(impl="cuda-fused", decoupled=True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
         weight_decay=0.0, step=9, grad_scale=1024.0),
    dict(impl="cuda-fused", decoupled=False, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
         weight_decay=0.1, step=6),  # proven for numel % 4 == 0 only
]
KEYS = ("decoupled", "lr", "beta1", "beta2", "eps", "weight_decay", "step")


def _table_lists(table):
    lists = {"impls": [e["impl"] for e in table]}
    lists.update({k: [e[k] for e in table] for k in KEYS})
    lists["grad_scale"] = [e.get("grad_scale", 0.0) for e in table]
    return lists


class Params:
    """Parameters (p, m, v, g tensors of full_numel elements each) cut into segments."""

    def __init__(self, sizes, entries, rng):
        self.tensors = []
        for n in sizes:
            self.tensors.append([
                torch.from_numpy(rng.standard_normal(n, dtype=np.float32)),
                torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)),
                torch.from_numpy(np.abs(rng.standard_normal(n, dtype=np.float32)) * np.float32(1e-4)),
                torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * np.float32(1e-1)),
            ])
        self.entries = entries
        self.segs = []  # (param index, offset, numel)

    def cut(self, pi, bounds):
        for a, b in zip(bounds[:-1], bounds[1:]):
            self.segs.append((pi, a, b - a))

    def clone(self):
        c = Params.__new__(Params)
        c.tensors = [[t.clone() for t in ts] for ts in self.tensors]
        c.entries, c.segs = self.entries, self.segs
        return c

    def arrays(self, order=None):
        segs = self.segs if order is None else [self.segs[i] for i in order]
        cols = {k: [] for k in ("p", "m", "v", "g", "numel", "offset", "full_numel", "arg")}
        for pi, off, n in segs:
            for k, t in zip("pmvg", self.tensors[pi]):
                cols[k].append(t.data_ptr() + 4 * off)
            cols["numel"].append(n)
            cols["offset"].append(off)
            cols["full_numel"].append(self.tensors[pi][0].numel())
            cols["arg"].append(self.entries[pi])
        return {k: np.array(v, dtype=np.int64) for k, v in cols.items()}

    def replay_each(self, table):
        """The reference: adam_replay per segment."""
        for pi, off, n in self.segs:
            e = dict(table[self.entries[pi]])
            impl, gs = e.pop("impl"), e.pop("grad_scale", None)
            p, m, v, g = (t[off:off + n] for t in self.tensors[pi])
            arithmetic.adam_replay(p, m, v, g, impl=impl, offset=off,
                                   full_numel=self.tensors[pi][0].numel(), grad_scale=gs, **e)

    def assert_equal(self, other):
        for pi, (a, b) in enumerate(zip(self.tensors, other.tensors)):
            for name, x, y in zip(("param", "exp_avg", "exp_avg_sq", "grad"), a, b):
                assert torch.equal(x.view(torch.int32), y.view(torch.int32)), \
                    f"parameter {pi} ({self.entries[pi]}): {name} differs"


def _mixed(rng, tiny=2000):
    """2,000 tiny parameters of odd sizes (fused tails everywhere) and a few large ones cut at
    odd offsets, every table entry used; sizes % 4 == 0 where entry 7 needs it."""
    sizes, entries = [], []
    for i in range(tiny):
        e = i % len(TABLE)
        n = int(rng.integers(1, 40))
        sizes.append(n * 4 if e == 7 else n)
        entries.append(e)
    for e, n in ((2, 100003), (0, 70001), (7, 65536 + 4), (6, 99999), (1, 40009)):
        sizes.append(n)
        entries.append(e)
    ps = Params(sizes, entries, rng)
    for pi, n in enumerate(sizes):
        if n < 100:
            k = int(rng.integers(0, 3))  # whole, or cut into 2-3 odd slices
            cuts = sorted(set(int(x) for x in rng.integers(1, n, k))) if n > 1 else []
            ps.cut(pi, [0] + cuts + [n])
        else:
            cuts = sorted(set(int(x) for x in rng.integers(1, n, 5)) | {n - 3})
            ps.cut(pi, [0] + cuts + [n])
    return ps


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    _C.set_isa("auto")


@pytest.mark.parametrize("threads", [1, 2])
def test_batch_equals_per_segment(threads):
    rng = np.random.default_rng(threads)
    ref = _mixed(rng)
    got = ref.clone()
    ref.replay_each(TABLE)
    order = rng.permutation(len(got.segs))  # segment order must not matter either
    arithmetic.replay_batch(**got.arrays(order), **_table_lists(TABLE), threads=threads)
    got.assert_equal(ref)


def test_tiny_segments_only_and_isas():
    isas = ["generic"] + (["avx2"] if _C.isa() in ("avx2", "avx512") else []) + \
        (["avx512"] if _C.isa() == "avx512" else [])
    rng = np.random.default_rng(5)
    base = Params([10] * 2000, [i % len(TABLE) if i % len(TABLE) != 7 else 0
                                for i in range(2000)], rng)
    for pi in range(2000):
        base.cut(pi, [0, 10])
    ref = base.clone()
    ref.replay_each(TABLE)
    for isa in isas:
        _C.set_isa(isa)
        got = base.clone()
        arithmetic.replay_batch(**got.arrays(), **_table_lists(TABLE), threads=2,
                                check_overlap=False)
        got.assert_equal(ref)


def test_empty_batch_and_empty_segments():
    arithmetic.replay_batch(*([np.zeros(0, np.int64)] * 8), **_table_lists(TABLE))
    ps = Params([16], [0], np.random.default_rng(1))
    ps.cut(0, [0, 0, 16, 16])  # empty, whole, empty
    ref = ps.clone()
    ref.replay_each(TABLE)
    arithmetic.replay_batch(**ps.arrays(), **_table_lists(TABLE))
    ps.assert_equal(ref)


def _one(entry=0, n=12, **over):
    ps = Params([n], [entry], np.random.default_rng(2))
    ps.cut(0, [0, n])
    arrays = ps.arrays()
    arrays.update(over)
    return ps, arrays


@pytest.mark.parametrize("change, match", [
    (dict(impl="cuda-forloop", beta1=0.3), "args entry 0: CUDA for-loop"),
    (dict(impl="single", grad_scale=2.0), "args entry 0: grad_scale"),
    (dict(impl="cuda-fused", weight_decay=0.1, decoupled=False, grad_scale=8.0),
     "args entry 0: CUDA fused Adam with weight_decay"),
    (dict(impl="sgd"), "args entry 0: impl"),
    (dict(step=0), "args entry 0: step"),
])
def test_unproven_or_bad_settings_raise(change, match):
    ps, arrays = _one()
    before = ps.clone()
    table = [dict(TABLE[0], **change)]
    with pytest.raises(ValueError, match=match):
        arithmetic.replay_batch(**arrays, **_table_lists(table))
    ps.assert_equal(before)  # nothing written


def test_cuda_fused_weight_decay_needs_numel_multiple_of_4():
    ps, arrays = _one(entry=0, n=10)
    before = ps.clone()
    with pytest.raises(ValueError, match="segment 0 .args entry 0.: CUDA fused"):
        arithmetic.replay_batch(**arrays, **_table_lists([TABLE[7]]))
    ps.assert_equal(before)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.update(numel=a["numel"][:0]), "numel has 0 elements"),
    (lambda a: a.update(p=a["p"].astype(np.float64)), "p must be an integer array"),
    (lambda a: a.update(arg=np.array([3])), "args entry 3"),
    (lambda a: a.update(offset=np.array([1])), "segment 0: slice"),
    (lambda a: a.update(numel=np.array([-1])), "numel.0. is negative"),
    (lambda a: a.update(m=a["p"]), "overlap"),
    (lambda a: a.update(g=a["v"] + 8), "grad range overlaps"),
    (lambda a: a.update(g=a["g"] + 2), "aligned"),
])
def test_validation(mutate, match):
    _, arrays = _one()
    mutate(arrays)
    with pytest.raises(ValueError, match=match):
        arithmetic.replay_batch(**arrays, **_table_lists(TABLE[:1]))


def test_overlapping_segments_refused():
    ps = Params([32], [0], np.random.default_rng(3))
    ps.cut(0, [0, 20])
    ps.segs.append((0, 10, 22))  # elements 10..31 again
    with pytest.raises(ValueError, match="overlap"):
        arithmetic.replay_batch(**ps.arrays(), **_table_lists(TABLE[:1]))


def test_table_lists_must_agree():
    _, arrays = _one()
    lists = _table_lists(TABLE[:1])
    lists["eps"] = [1e-8, 1e-8]
    with pytest.raises(ValueError, match="eps has 2 entries"):
        arithmetic.replay_batch(**arrays, **lists)


def _records(table):
    """An args table as the raw binding takes it: one record per entry, of numpy dtype
    _C.REPLAY_ARGS_DTYPE (beta powers 0: pow; grad_mul 1; float32 gradients)."""
    rec = np.zeros(len(table), _C.REPLAY_ARGS_DTYPE)
    rec["impl"] = [_C.REPLAY_IMPLS.index(e["impl"]) for e in table]
    for k in KEYS:
        rec[k] = [e[k] for e in table]
    rec["grad_scale"] = [e.get("grad_scale", 0.0) for e in table]
    rec["grad_mul"] = 1.0
    return rec


def test_cpp_checks_without_the_wrapper():
    """_C validates on its own (the raw binding is callable directly)."""
    ps, arrays = _one()
    args = [arrays[k] for k in ("p", "m", "v", "g", "numel", "offset", "full_numel", "arg")]
    table = _records(TABLE[:1])
    bad_arg = list(args)
    bad_arg[7] = np.array([1], np.int64)
    with pytest.raises(ValueError, match="segment 0: args entry 1 out of range"):
        _C.adam_replay_batch(*bad_arg, table, 1)
    bad_slice = list(args)
    bad_slice[5] = np.array([5], np.int64)
    with pytest.raises(ValueError, match="segment 0: slice"):
        _C.adam_replay_batch(*bad_slice, table, 1)
    with pytest.raises(ValueError, match="full_numel has 2 elements"):
        _C.adam_replay_batch(*args[:6], np.zeros(2, np.int64), args[7], table, 1)
    # A table of another layout is refused, field by field, never misread.
    dt = _C.REPLAY_ARGS_DTYPE
    lr32 = np.dtype({"names": dt.names, "offsets": [dt.fields[n][1] for n in dt.names],
                     "formats": [np.float32 if n == "lr" else dt.fields[n][0] for n in dt.names],
                     "itemsize": dt.itemsize})
    with pytest.raises(ValueError, match="args: field 'lr' is float32 at byte 8"):
        _C.adam_replay_batch(*args, table.astype(lr32), 1)
    with pytest.raises(ValueError, match="args: dtype float64"):
        _C.adam_replay_batch(*args, np.zeros(len(dt.names)), 1)
    bad_impl = table.copy()
    bad_impl["impl"] = len(_C.REPLAY_IMPLS)
    with pytest.raises(ValueError, match=f"args entry 0: impl {len(_C.REPLAY_IMPLS)} is not"):
        _C.adam_replay_batch(*args, bad_impl, 1)


# A bf16 gradient transport: the update consumes float(g) * grad_mul (one float rounding).
BF16_TABLE = TABLE + [dict(impl="deepspeed-cpu-w16", decoupled=True, lr=1e-3, beta1=0.9,
                           beta2=0.999, eps=1e-8, weight_decay=0.1, step=12)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bf16_gradient_replays_as_its_float32_product(threads):
    rng = np.random.default_rng(10 + threads)
    ref = _mixed(rng, tiny=400)
    ps = Params([5000, 2049], [len(BF16_TABLE) - 1, 2], rng)  # chunks of 2048 + tails
    ps.cut(0, [0, 7, 2100, 4999, 5000])
    ps.cut(1, [0, 2049])
    base = len(ref.tensors)
    ref.tensors += ps.tensors
    ref.entries = list(ref.entries) + ps.entries
    ref.segs = ref.segs + [(pi + base, o, n) for pi, o, n in ps.segs]
    mul = [float(np.float32(x)) for x in rng.uniform(0.01, 3.0, len(BF16_TABLE))]
    mul[0] = 1.0  # no clipping, no loss scale: float(g) exactly
    bf16 = []
    for pi, ts in enumerate(ref.tensors):
        g = ts[3].bfloat16()
        if g.numel() > 8:  # zeros, inf, NaN, subnormals, and products that underflow
            g[:8] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-39, -3e-40,
                                  1e-38, 2.5], dtype=torch.bfloat16)
        bf16.append(g)
        ts[3].copy_(g.float() * torch.tensor(mul[ref.entries[pi]], dtype=torch.float32))
    got = ref.clone()
    table = _table_lists(BF16_TABLE)
    arithmetic.replay_batch(**ref.arrays(), **table, threads=threads)
    arrays = got.arrays()
    arrays["g"] = np.array([bf16[pi].data_ptr() + 2 * off for pi, off, _ in got.segs],
                           dtype=np.int64)
    arithmetic.replay_batch(**arrays, **table, threads=threads, grad_dtype=torch.bfloat16,
                            grad_mul=mul)
    got.assert_equal(ref)
    assert any(torch.isnan(t[0]).any() for t in ref.tensors)  # the specials reached the update


def test_bf16_gradient_arguments_are_checked():
    ps = Params([16], [0], np.random.default_rng(0))
    ps.cut(0, [0, 16])
    arrays, table = ps.arrays(), _table_lists(TABLE)
    with pytest.raises(ValueError, match="grad_mul"):  # a multiplier needs a bf16 gradient
        arithmetic.replay_batch(**arrays, **table, grad_mul=[1.0] * len(TABLE))
    with pytest.raises(ValueError, match="float32 value"):
        arithmetic.replay_batch(**arrays, **table, grad_dtype=torch.bfloat16,
                                grad_mul=[0.1] * len(TABLE))
    with pytest.raises(ValueError, match="grad_dtype"):
        arithmetic.replay_batch(**arrays, **table, grad_dtype=torch.float16)
    arrays["g"] = arrays["g"] + 1  # not aligned to a bf16 element
    with pytest.raises(ValueError, match="aligned"):
        arithmetic.replay_batch(**arrays, **table, grad_dtype=torch.bfloat16)
