"""Bitwise tests of gockpt.arithmetic.adam_replay against torch's own Adam/AdamW (CPU, float32)."""
import numpy as np
import pytest
import torch

from gockpt import _C
from gockpt.replay import arithmetic

IMPLS = ("single", "foreach", "fused")
SETTINGS = (
    dict(betas=(0.9, 0.999), eps=1e-8, lr=1e-3),
    dict(betas=(0.3, 0.95), eps=1e-6, lr=3e-2),  # |1-beta1| >= 0.5: the other lerp branch
)


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
    _C.set_isa("auto")


def _data(n, steps, seed):
    rng = np.random.default_rng(seed)
    p0 = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    grads = []
    for _ in range(steps):
        scale = np.float32(10.0 ** rng.integers(-4, 1))
        grads.append(torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * scale))
    return p0, grads


def _torch_opt(impl, decoupled, p, wd, s):
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    kw = {"foreach": False} if impl == "single" else {impl: True}
    return cls([p], lr=s["lr"], betas=s["betas"], eps=s["eps"], weight_decay=wd, **kw)


def _compare(impl, decoupled, wd, n, torch_threads, steps, s, seed=0, init_step=0,
             replay_impl=None, threads=None):
    """Run torch's optimizer and the replay side by side; return the torch and replay states."""
    torch.set_num_threads(torch_threads)
    p0, grads = _data(n, steps, seed)
    p = torch.nn.Parameter(p0.clone())
    opt = _torch_opt(impl, decoupled, p, wd, s)
    rp = p0.clone()
    rm = torch.zeros(n)
    rv = torch.zeros(n)
    if init_step:
        rng = np.random.default_rng(seed + 1)
        rm = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2))
        rv = torch.from_numpy(np.abs(rng.standard_normal(n, dtype=np.float32)) * np.float32(1e-4))
        opt.state[p] = {"step": torch.tensor(float(init_step), dtype=torch.float32),
                        "exp_avg": rm.clone(), "exp_avg_sq": rv.clone()}
    for k in range(steps):
        lr = s["lr"] * (1.0 + 0.37 * k)  # lr changes between steps
        for g in opt.param_groups:
            g["lr"] = lr
        p.grad = grads[k].clone()
        opt.step()
        arithmetic.adam_replay(rp, rm, rv, grads[k], impl=replay_impl or impl, decoupled=decoupled,
                             lr=lr, beta1=s["betas"][0], beta2=s["betas"][1], eps=s["eps"],
                             weight_decay=wd, step=init_step + k + 1, threads=threads)
    st = opt.state[p]
    assert float(st["step"]) == init_step + steps
    return (p.detach(), st["exp_avg"], st["exp_avg_sq"]), (rp, rm, rv)


def _assert_bitwise(ref, got):
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ref, got):
        ndiff = int((a != b).sum())
        assert torch.equal(a, b), f"{name}: {ndiff} of {a.numel()} elements differ"


@pytest.mark.parametrize("n", [1, 7, 8, 9, 17, 1000, 32768 + 5])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_torch(impl, decoupled, wd, n):
    for s in SETTINGS:
        for tth in (1, 2):
            ref, got = _compare(impl, decoupled, wd, n, tth, steps=6, s=s, seed=n)
            _assert_bitwise(ref, got)


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_torch_large(impl, decoupled):
    n = 4 * 1024 * 1024 + 3  # several torch chunks per thread, vector tails, fused scalar tail
    ref, got = _compare(impl, decoupled, 0.1, n, 2, steps=2, s=SETTINGS[0], seed=7)
    _assert_bitwise(ref, got)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_step_count_and_nonzero_state(impl):
    for decoupled in (True, False):
        ref, got = _compare(impl, decoupled, 0.05, 1031, 2, steps=4, s=SETTINGS[0], seed=3,
                            init_step=123456)
        _assert_bitwise(ref, got)


def test_fused_differs_from_single():
    """The fused kernel's arithmetic differs from the default path: replaying a fused run with
    the single-tensor recipe must not be bitwise (guards against a test that cannot fail)."""
    ref, got = _compare("fused", True, 0.1, 100003, 2, steps=10, s=SETTINGS[0],
                        replay_impl="single")
    assert not all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("impl", IMPLS)
def test_slices_equal_whole(impl):
    n = 65536 * 3 + 7
    p0, grads = _data(n, 3, seed=11)
    whole = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    parts = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    cuts = [0, 5, 4099, 65536, 100001, n - 9, n - 3, n]  # splits inside the fused tail too
    kw = dict(impl=impl, decoupled=True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.1)
    for k, g in enumerate(grads):
        arithmetic.adam_replay(*whole, g, step=k + 1, **kw)
        for a, b in zip(cuts[:-1], cuts[1:]):
            sl = [t[a:b].clone() for t in parts]
            arithmetic.adam_replay(*sl, g[a:b].clone(), step=k + 1, offset=a, full_numel=n, **kw)
            for t, u in zip(parts, sl):
                t[a:b] = u
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
    # and the slices equal torch itself
    p = torch.nn.Parameter(p0.clone())
    opt = _torch_opt(impl, True, p, 0.1, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8))
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert torch.equal(p.detach(), parts[0])
    assert torch.equal(opt.state[p]["exp_avg_sq"], parts[2])


def test_fused_slice_needs_full_numel():
    """A slice ending at the parameter's end must know it is the end (fused scalar tail)."""
    n = 1000 * 8 + 7
    found_difference = False
    for seed in range(4):
        p0, grads = _data(n, 6, seed=seed)
        outs = []
        for full in (n, n + 1):  # correct full_numel vs. pretending the parameter goes on
            st = [p0[-15:].clone(), torch.zeros(15), torch.zeros(15)]
            for k, g in enumerate(grads):
                arithmetic.adam_replay(*st, g[-15:].clone(), impl="fused", decoupled=True, lr=1e-3,
                                     beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                     step=k + 1, offset=n - 15, full_numel=full)
            outs.append(st)
        found_difference |= not torch.equal(outs[0][2], outs[1][2])
    assert found_difference


@pytest.mark.parametrize("impl", IMPLS)
def test_isa_and_threads_agree(impl):
    n = 300007
    p0, grads = _data(n, 3, seed=5)
    isas = ["generic"]
    hw = _C.isa()
    if hw in ("avx2", "avx512"):
        isas.append("avx2")
    if hw == "avx512":
        isas.append("avx512")
    results = []
    for isa in isas:
        for threads in (1, 2, 3):
            _C.set_isa(isa)
            st = [p0.clone(), torch.zeros(n), torch.zeros(n)]
            for k, g in enumerate(grads):
                arithmetic.adam_replay(*st, g, impl=impl, decoupled=False, lr=2e-3, beta1=0.8,
                                     beta2=0.99, eps=1e-7, weight_decay=0.01, step=k + 1,
                                     threads=threads)
            results.append(st)
    _C.set_isa("auto")
    for st in results[1:]:
        for a, b in zip(results[0], st):
            assert torch.equal(a, b)


def test_sqrt_backend_matches_torch_sqrt():
    assert arithmetic.sqrt_backend() in ("mkl-vml", "ieee")
    ok, why = arithmetic.exactness_supported()
    assert ok, why
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 0x7F800000, size=1_000_003, dtype=np.int64).astype(np.uint32)
    x = torch.from_numpy(bits.view(np.float32).copy())
    out = torch.empty_like(x)
    _C.torch_sqrt(x.data_ptr(), out.data_ptr(), x.numel())
    ref = torch.sqrt(x)
    assert torch.equal(out, ref)
    ieee = torch.from_numpy(np.sqrt(x.numpy()))
    if arithmetic.sqrt_backend() == "mkl-vml":
        # torch.sqrt is not IEEE here; otherwise the VML path would be pointless
        assert int((ieee != ref).sum()) > 0
    else:
        assert torch.equal(ieee, ref)


def test_sqrt_backend_fallback_is_ieee():
    if arithmetic.sqrt_backend() != "mkl-vml":
        pytest.skip("VML not available")
    try:
        _C.disable_vml_sqrt()
        assert arithmetic.sqrt_backend() == "ieee"
        x = torch.rand(10007) * 100
        out = torch.empty_like(x)
        _C.torch_sqrt(x.data_ptr(), out.data_ptr(), x.numel())
        assert torch.equal(out, torch.from_numpy(np.sqrt(x.numpy())))
    finally:
        assert _C.init_vml_sqrt(arithmetic._libtorch_cpu_path()) == "mkl-vml"


def _args(n=10):
    return [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)]


KW = dict(impl="single", decoupled=True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
          weight_decay=0.0, step=1)


@pytest.mark.parametrize("mutate, match", [
    (lambda a, kw: a.__setitem__(0, a[0].double()), "float32"),
    (lambda a, kw: a.__setitem__(1, torch.zeros(20)[::2]), "contiguous"),
    (lambda a, kw: a.__setitem__(2, torch.zeros(11)), "elements"),
    (lambda a, kw: a.__setitem__(3, torch.zeros(2, 5)), "1-D"),
    (lambda a, kw: a.__setitem__(3, np.zeros(10, np.float32)), "torch.Tensor"),
    (lambda a, kw: kw.__setitem__("impl", "sgd"), "impl"),
    (lambda a, kw: kw.update(offset=5, full_numel=12), "slice"),
    (lambda a, kw: kw.__setitem__("step", 0), "step"),
    (lambda a, kw: a.__setitem__(1, a[0]), "distinct"),
])
def test_validation(mutate, match):
    a, kw = _args(), dict(KW)
    mutate(a, kw)
    with pytest.raises(ValueError, match=match):
        arithmetic.adam_replay(*a, **kw)


def _replay_steps(st, grads, impl="single", threads=None, **kw):
    hp = dict(decoupled=True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    hp.update(kw)
    for k, g in enumerate(grads):
        arithmetic.adam_replay(*st, g, impl=impl, step=k + 1, threads=threads, **hp)
    return st


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_chunk_sizes_agree_with_torch(decoupled):
    """The single/foreach kernel pipelines tiles (phase 2 of one tile with phase 1 of the
    next); odd tile sizes put vector/scalar splits and tile ends everywhere."""
    n = 5000 + 3
    p0, grads = _data(n, 3, seed=21)
    p = torch.nn.Parameter(p0.clone())
    s = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    opt = _torch_opt("single", decoupled, p, 0.1, s)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
    isas = ["generic"] + {"avx2": ["avx2"], "avx512": ["avx2", "avx512"]}.get(_C.isa(), [])
    try:
        for isa in isas:
            _C.set_isa(isa)
            for tile in (16, 17, 40, 100, 511, 512, 513, 4096, 16384):
                _C._set_tile(tile)
                st = _replay_steps([p0.clone(), torch.zeros(n), torch.zeros(n)], grads,
                                   decoupled=decoupled, threads=1)
                _assert_bitwise(ref, st)
    finally:
        _C._set_tile(512)
        _C.set_isa("auto")


def test_concurrent_callers():
    """Several Python threads replaying at once (the GIL is released): one owns the thread
    pool, the others run on their own thread; every result is exact."""
    import threading
    n = 200003
    jobs = []
    for seed in range(4):
        p0, grads = _data(n, 2, seed=100 + seed)
        ref = _replay_steps([p0.clone(), torch.zeros(n), torch.zeros(n)], grads, threads=1)
        jobs.append((p0, grads, ref))
    outs = [None] * len(jobs)
    errors = []

    def run(i):
        try:
            p0, grads, _ = jobs[i]
            for _ in range(3):
                outs[i] = _replay_steps([p0.clone(), torch.zeros(n), torch.zeros(n)], grads,
                                        threads=2)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    assert not errors, errors
    for (_, _, ref), got in zip(jobs, outs):
        _assert_bitwise(ref, got)


def test_thread_pool_after_fork():
    """The persistent worker threads do not exist in a fork()ed child: the child must get a
    fresh pool, not hang waiting for them."""
    import os
    import time
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    n = 300007
    p0, grads = _data(n, 2, seed=9)
    ref = _replay_steps([p0.clone(), torch.zeros(n), torch.zeros(n)], grads, threads=2)
    st = [p0.clone(), torch.zeros(n), torch.zeros(n)]  # torch's own OpenMP ops can hang in a
    ref_np = [t.numpy() for t in ref]                   # fork()ed child: none run there
    pid = os.fork()
    if pid == 0:  # child: only our kernel and numpy, then _exit
        code = 1
        try:
            _replay_steps(st, grads, threads=2)
            code = 0 if all(np.array_equal(a, t.numpy()) for a, t in zip(ref_np, st)) else 2
        finally:
            os._exit(code)
    deadline = time.time() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.time() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("child hung replaying after fork")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
