"""gockpt.replay_step against golden vectors of CUDA optimizers recorded on an NVIDIA H100.

tests/data/cuda-adam-h100.safetensors (a measured fact, recorded with torch 2.11.0+cu130 and
DeepSpeed 0.19.8 by what is now experiments/record_golden.py): per case the state after 6
chained steps from zero state (t1..t6) and one step each with the step count set to 100, 1000 and
10000 from the t6 state (grad1 again).  Bit patterns are compared; a NaN equals a NaN at the
same position (payloads differ between the GPU and the CPU).

``GOCKPT_GOLDEN=FILE`` runs the same tests against vectors recorded afresh on the GPU at hand
(the GPU round does): every replay profile checked against that GPU's kernels.
"""
import json
import os
from fractions import Fraction

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import gockpt
from gockpt import _C
from gockpt.replay import arithmetic
from gockpt.replay.claims import claimed, replay_claims

STORED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                      "cuda-adam-h100.safetensors")
GOLDEN = os.environ.get("GOCKPT_GOLDEN") or STORED
STATE = ("param", "exp_avg", "exp_avg_sq")
JUMPS = (100, 1000, 10000)


def _meta():
    with safe_open(GOLDEN, "pt") as f:
        return json.loads(f.metadata()["golden"])


META = _meta()
CASES = {c["name"]: c for c in META["cases"]}
TORCH_CASES = sorted(n for n in CASES if n.startswith("torch/"))
DEEPSPEED_CASES = sorted(n for n in CASES if n.startswith("deepspeed/"))


@pytest.fixture(scope="module")
def golden():
    return load_file(GOLDEN)


def profile_of(case):
    """Golden case name -> replay profile: torch/AdamW/fused-gradscale/h1 -> cuda/torch/AdamW/fused,
    deepspeed/FusedAdam/adam_w_mode=True/h0 -> cuda/deepspeed/FusedAdam/adam_w_mode=True."""
    source, opt, impl, _ = case.split("/")
    return f"cuda/{source}/{opt}/{impl.replace('-gradscale', '')}"


def _hyper(c):
    return dict(lr=c["lr"], betas=tuple(c["betas"]), eps=c["eps"],
                weight_decay=c["weight_decay"])


def _grad(golden, c, t):
    g = golden[f"input/grad{t}"]
    return g * c["grad_scale"] if c.get("grad_scale") else g.clone()  # the kernel sees it scaled


def mismatches(got, want):
    """Elements whose bit patterns differ (a NaN matches any NaN at the same position)."""
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    return int((~same).sum())


def replay_case(golden, case, arith, tensors=None, n=None):
    """Replay a golden case with `arith` (only ``tensors``, on the first ``n`` elements);
    returns {'t1/param': differing elements, ...} for the tensors replayed."""
    c = CASES[case]
    scale = c.get("grad_scale")
    kw = dict(_hyper(c), grad_scale=scale, tensors=tensors)
    n = META["n"] if n is None else n
    names = STATE if tensors is None else tensors
    p = golden["input/param"][:n].clone()
    st = [p, torch.zeros_like(p), torch.zeros_like(p)]
    diffs = {}
    for t in range(1, META["trajectory_steps"] + 1):
        gockpt.replay_step(arith, *st, _grad(golden, c, t)[:n].clone(), step=t, **kw)
        for name, x in zip(STATE, st):
            if name in names:
                diffs[f"t{t}/{name}"] = mismatches(x, golden[f"{case}/t{t}/{name}"][:n])
    for j in JUMPS:
        st = [golden[f"{case}/t6/{name}"][:n].clone() for name in STATE]
        gockpt.replay_step(arith, *st, _grad(golden, c, 1)[:n].clone(), step=j, **kw)
        for name, x in zip(STATE, st):
            if name in names:
                diffs[f"jump{j}/{name}"] = mismatches(x, golden[f"{case}/jump{j}/{name}"][:n])
    return diffs


@pytest.mark.parametrize("case", TORCH_CASES)
def test_golden_case_bitwise(golden, case):
    """6 chained steps from zero state and the 3 jumps, every state tensor bit for bit."""
    diffs = replay_case(golden, case, profile_of(case))
    bad = {k: n for k, n in diffs.items() if n}
    assert not bad, f"{case} with {profile_of(case)}: differing elements {bad}"


@pytest.mark.parametrize("case, wrong", [
    ("torch/AdamW/foreach/h0", "cpu/torch/AdamW/single"),   # CPU arithmetic on a CUDA run
    ("torch/AdamW/fused/h0", "cpu/torch/AdamW/fused"),
    ("torch/AdamW/forloop/h0", "cuda/torch/AdamW/foreach"),  # sqrt/scalar vs sqrt*(1/scalar)
    ("torch/Adam/fused/h0", "cuda/torch/Adam/foreach"),
])
def test_wrong_profile_does_not_match(golden, case, wrong):
    """The comparison can fail: a deliberately wrong arithmetic leaves elements different."""
    diffs = replay_case(golden, case, wrong)
    assert sum(diffs.values()) > 0


def test_cuda_powf_is_not_correctly_rounded():
    """The fused kernel's bias corrections use CUDA's powf; 0.95f**6 is one ulp below the
    correctly rounded value (the recorded torch/AdamW/fused/h1 trajectory depends on it)."""
    base = np.float32(0.95)
    exact = Fraction(float(base)) ** 6
    near = np.float32(float(exact))
    cands = [np.nextafter(near, np.float32(0)), near, np.nextafter(near, np.float32(1))]
    rounded = min(cands, key=lambda x: abs(Fraction(float(x)) - exact))
    got = np.float32(_C.cuda_powf(float(base), 6.0))
    assert got == np.nextafter(rounded, np.float32(0))
    for b, t in ((0.9, 1.0), (0.999, 3.0), (0.5, 10.0), (0.0, 5.0)):
        assert np.float32(_C.cuda_powf(b, t)) == np.float32(b) ** np.float32(t)


@pytest.mark.parametrize("case", ["torch/Adam/fused/h0", "torch/AdamW/fused-gradscale/h1",
                                  "torch/AdamW/foreach/h1", "torch/Adam/forloop/h0"])
def test_slices_equal_whole(golden, case):
    """Replaying a parameter in slices at odd offsets (and with 1-3 threads) gives the bits of
    one whole replay: the fused kernel's vector lane is taken from the global index."""
    c = CASES[case]
    impl, decoupled = arithmetic._PROFILES[profile_of(case)]
    kw = dict(impl=impl, decoupled=decoupled, lr=c["lr"], beta1=c["betas"][0],
              beta2=c["betas"][1], eps=c["eps"], weight_decay=c["weight_decay"],
              grad_scale=c.get("grad_scale"))
    n = META["n"]
    whole = [golden[f"{case}/t6/{name}"].clone() for name in STATE]
    parts = [x.clone() for x in whole]
    g = _grad(golden, c, 1)
    arithmetic.adam_replay(*whole, g, step=7, **kw)
    cuts = [0, 1, 6, 7, 1001, 2048, 3001, n - 3, n]
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        sl = [x[a:b].clone() for x in parts]
        arithmetic.adam_replay(*sl, g[a:b].clone(), step=7, offset=a, full_numel=n,
                               threads=1 + k % 3, **kw)
        for x, y in zip(parts, sl):
            x[a:b] = y
    for name, a, b in zip(STATE, whole, parts):
        assert mismatches(a, b) == 0, name


def test_replay_arithmetics_lists_every_profile():
    names = gockpt.replay_arithmetics()
    expected = {f"{dev}/torch/{opt}/{impl}" for opt in ("Adam", "AdamW")
                for dev, impls in (("cpu", ("single", "foreach", "fused")),
                                   ("cuda", ("forloop", "foreach", "fused")))
                for impl in impls}
    expected |= {f"{dev}/deepspeed/FusedAdam/adam_w_mode={m}" for m in (True, False)
                 for dev in ("cpu", "cuda")}
    assert names == sorted(expected)
    assert {profile_of(c) for c in CASES} <= set(names)


def test_unknown_arithmetic_lists_known_ones():
    args = [torch.zeros(4) for _ in range(4)]
    with pytest.raises(ValueError, match="cuda/torch/AdamW/fused") as e:
        gockpt.replay_step("cuda/torch/SGD/fused", *args, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=0.0, step=1)
    assert "cpu/torch/Adam/single" in str(e.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_claimed_tensor_of_every_case_bitwise(golden, case):
    """Per case, the tensors the profile claims (gockpt.replay.claims) are reproduced bit for
    bit through the public replay API, the 6 chained steps and the 3 jumps; asking for one it
    does not claim is refused, naming it and why."""
    c, arith = CASES[case], profile_of(case)
    claims = replay_claims(arith, META["n"], c["weight_decay"])
    ok = tuple(t for t in STATE if claims[t] is None)
    if ok:
        diffs = replay_case(golden, case, arith, tensors=ok)
        bad = {k: n for k, n in diffs.items() if n}
        assert not bad and len(diffs) == 9 * len(ok), f"{case}: differing elements {bad}"
    for t in STATE:
        if claims[t] is not None:
            args = [golden["input/param"].clone() for _ in range(4)]
            with pytest.raises(ValueError, match=f"{t}: ") as e:
                gockpt.replay_step(arith, *args, step=1, **_hyper(c))
            assert claims[t] in str(e.value)


def test_what_is_claimed_of_the_golden_cases():
    """DeepSpeed's CUDA FusedAdam (--use_fast_math): its moments, not its parameter line --
    and nothing when its moments read the parameter (Adam mode with weight decay); torch's
    every tensor at numel % 4 == 0."""
    got = {case: claimed(profile_of(case), META["n"], c["weight_decay"])
           for case, c in CASES.items()}
    for case in TORCH_CASES:
        assert got[case] == STATE, case
    for case in DEEPSPEED_CASES:
        c = CASES[case]
        l2 = not c["adam_w_mode"] and c["weight_decay"] != 0
        assert got[case] == (() if l2 else ("exp_avg", "exp_avg_sq")), case
    assert sum(len(v) == 3 for v in got.values()) == len(TORCH_CASES) == 19
    # fresh vectors hold DeepSpeed's cases only where its CUDA op could be built
    assert len(DEEPSPEED_CASES) == 6 or GOLDEN != STORED


@pytest.mark.parametrize("case", ["torch/AdamW/fused/h0", "torch/AdamW/fused/h1",
                                  "torch/AdamW/fused-gradscale/h1"])
@pytest.mark.parametrize("n", [4095, 4094, 4093])
def test_fused_adamw_moments_at_odd_element_counts(golden, case, n):
    """torch's fused CUDA AdamW with weight decay at numel % 4 != 0: the moments are claimed
    (each element's moments are the same explicit fmas in every vector lane) and reproduced
    on the golden vectors' first n elements; the parameter is not claimed."""
    c = CASES[case]
    assert claimed(profile_of(case), n, c["weight_decay"]) == ("exp_avg", "exp_avg_sq")
    diffs = replay_case(golden, case, profile_of(case), tensors=("exp_avg", "exp_avg_sq"), n=n)
    assert len(diffs) == 18 and not any(diffs.values()), diffs
    with pytest.raises(ValueError, match="param: .*numel % 4 == 0"):
        replay_case(golden, case, profile_of(case), n=n)


def test_a_tensor_not_replayed_is_left_as_it_is(golden):
    case = "deepspeed/FusedAdam/adam_w_mode=True/h0"
    if case not in CASES:  # only fresh vectors (GOCKPT_GOLDEN) recorded without DeepSpeed
        pytest.skip(f"{GOLDEN} holds no DeepSpeed case")
    p = golden["input/param"].clone()
    st = [p.clone(), torch.zeros_like(p), torch.zeros_like(p)]
    gockpt.replay_step(profile_of(case), *st, _grad(golden, CASES[case], 1), step=1,
                       tensors=("exp_avg", "exp_avg_sq"), **_hyper(CASES[case]))
    assert torch.equal(st[0], p) and mismatches(st[1], golden[f"{case}/t1/exp_avg"]) == 0


def _kw(**over):
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=1)
    kw.update(over)
    return kw


@pytest.mark.parametrize("arith, make, kw, match", [
    ("cuda/torch/AdamW/foreach", lambda: [torch.zeros(8) for _ in range(4)],
     _kw(grad_scale=65536.0), "grad_scale"),
    ("cuda/torch/Adam/fused", lambda: [torch.zeros(10) for _ in range(4)], _kw(), "numel % 4"),
    ("cuda/torch/AdamW/fused", lambda: [torch.zeros(10) for _ in range(4)], _kw(), "numel % 4"),
    ("cuda/torch/Adam/fused", lambda: [torch.zeros(8) for _ in range(4)],
     _kw(grad_scale=2.0), "grad_scale"),
    ("cuda/torch/AdamW/foreach", lambda: [torch.zeros(8) for _ in range(4)],
     _kw(betas=(0.3, 0.999)), "beta1"),
    ("cuda/torch/AdamW/fused", lambda: [torch.zeros(8, dtype=torch.float64)] * 4, _kw(),
     "float32"),
    ("cuda/torch/AdamW/fused", lambda: [torch.zeros(8), torch.zeros(8), torch.zeros(9),
                                        torch.zeros(8)], _kw(), "elements"),
    ("cuda/torch/AdamW/fused", lambda: [torch.zeros(16)[::2]] + [torch.zeros(8)] * 3, _kw(),
     "contiguous"),
    ("cuda/torch/AdamW/fused", lambda: (lambda b: [b[:8], b[4:12], b[16:24], b[24:]])(
        torch.zeros(32)), _kw(), "distinct"),
    ("cuda/torch/AdamW/fused", lambda: [torch.zeros(8) for _ in range(4)], _kw(step=0), "step"),
])
def test_replay_step_refuses(arith, make, kw, match):
    with pytest.raises(ValueError, match=match):
        gockpt.replay_step(arith, *make(), **kw)


def test_fused_without_weight_decay_takes_any_size(golden):
    """weight_decay == 0 leaves no contractible pair: a size that is not a multiple of 4 is
    replayed (here the golden h2 case cut to 4093 elements keeps its bits)."""
    case = "torch/AdamW/fused/h2"
    c = CASES[case]
    st = [golden[f"{case}/t6/{name}"][:4093].clone() for name in STATE]
    gockpt.replay_step("cuda/torch/AdamW/fused", *st, _grad(golden, c, 1)[:4093], step=100,
                       **_hyper(c))
    for name, x in zip(STATE, st):
        assert mismatches(x, golden[f"{case}/jump100/{name}"][:4093]) == 0, name


def test_any_contiguous_shape_is_the_flat_parameter(golden):
    """A 2-D contiguous tensor is replayed as its flat memory order."""
    case = "torch/Adam/fused/h1"
    c = CASES[case]
    flat = [golden[f"{case}/t6/{name}"].clone() for name in STATE]
    square = [x.clone().view(64, 64) for x in flat]
    g = _grad(golden, c, 1)
    gockpt.replay_step("cuda/torch/Adam/fused", *flat, g, step=100, **_hyper(c))
    gockpt.replay_step("cuda/torch/Adam/fused", *square, g.view(64, 64), step=100, **_hyper(c))
    for name, a, b in zip(STATE, flat, square):
        assert mismatches(b.view(-1), golden[f"{case}/jump100/{name}"]) == 0, name
        assert mismatches(a, b.view(-1)) == 0, name


def test_golden_every_isa(golden):
    """The generic, AVX2 and AVX-512 builds of the CUDA profiles give the same (golden) bits."""
    isas = ["generic"] + {"avx2": ["avx2"], "avx512": ["avx2", "avx512"]}.get(_C.isa(), [])
    try:
        for isa in isas:
            _C.set_isa(isa)
            for case in TORCH_CASES:
                diffs = replay_case(golden, case, profile_of(case))
                assert sum(diffs.values()) == 0, (isa, case)
    finally:
        _C.set_isa("auto")


@pytest.mark.parametrize("case", [c for c in DEEPSPEED_CASES
                                  if CASES[c]["adam_w_mode"] or not CASES[c]["weight_decay"]])
def test_deepspeed_cuda_moments_in_a_batch_of_slices(golden, case):
    """The batched replay (what a checkpoint's replay thread runs) with the
    deepspeed-cuda-moments kernel, the parameter cut in slices: the recorded moments of the
    6 chained steps bit for bit, and no parameter written."""
    c, n = CASES[case], META["n"]
    cuts = [0, 7, 1001, 2048, n]
    p = golden["input/param"].clone()
    before = p.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    for t in range(1, META["trajectory_steps"] + 1):
        g = _grad(golden, c, t)
        addr = lambda x: np.array([x.data_ptr() + 4 * a for a in cuts[:-1]])  # noqa: E731
        arithmetic.replay_batch(
            addr(p), addr(m), addr(v), addr(g), np.diff(cuts), np.array(cuts[:-1]),
            np.full(len(cuts) - 1, n), np.zeros(len(cuts) - 1, dtype=np.int64),
            ["deepspeed-cuda-moments"], [c["adam_w_mode"]], [c["lr"]], [c["betas"][0]],
            [c["betas"][1]], [c["eps"]], [c["weight_decay"] if not c["adam_w_mode"] else 0.0],
            [float(t)], threads=2)
        assert mismatches(m, golden[f"{case}/t{t}/exp_avg"]) == 0, (case, t)
        assert mismatches(v, golden[f"{case}/t{t}/exp_avg_sq"]) == 0, (case, t)
    assert torch.equal(p, before)
