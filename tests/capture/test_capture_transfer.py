"""The copy engine (gockpt.capture.transfer over _C.CopyEngine): copies land bit for bit,
gradients overtake state, pacing, close()."""
import gc
import weakref
import threading

import numpy as np
import pytest
import torch

from gockpt import _C
from gockpt.capture.device import HostDevice
from gockpt.capture.transfer import (GRADIENT, PIECE_BYTES, SNAPSHOT, STATE, CopyEngine,
                                    Ticket)

MIB = 1 << 20


def _long_state_job(engine, src, dst, pieces):
    """A STATE ticket of `pieces` 1 MiB copies of one buffer: with a paced link it stays busy
    for pieces * (1 MiB / rate) -- hundreds of times longer than one piece."""
    n = np.full(pieces, 1, dtype=np.int64)
    return engine.submit_segments(n * dst.data_ptr(), n * src.data_ptr(), n * MIB, STATE)


def test_copies_land_and_gradients_overtake_state():
    # 1 GB/s: one 1 MiB piece ~1 ms, the long job ~0.4 s.  Proven by order of completion: the
    # gradients, submitted after two STATE tickets, complete while both are still queued.
    engine = CopyEngine(HostDevice(), link_gbps=1.0)
    big_src = torch.randn(MIB // 4)
    big_dst = torch.empty_like(big_src)
    srcs = [torch.full((1000,), float(i)) for i in range(6)]
    dsts = [torch.empty(1000) for _ in srcs]
    first = _long_state_job(engine, big_src, big_dst, 400)
    state = engine.submit([(dsts[i], srcs[i]) for i in (1, 2, 3)], STATE)
    grads = engine.submit([(dsts[i], srcs[i]) for i in (4, 5)], GRADIENT)
    grads.wait()
    assert not first.done() and not state.done()
    assert all(torch.equal(dsts[i], srcs[i]) for i in (4, 5))
    state.wait()
    assert first.done()  # FIFO within a priority
    assert all(torch.equal(d, s) for d, s in zip(dsts[1:], srcs[1:]))
    assert torch.equal(big_dst, big_src)
    assert state.nbytes == 3 * 4000 and first.nbytes == 400 * MIB and engine.bandwidth() > 0
    assert engine.bytes_copied == 400 * MIB + 5 * 4000
    engine.close()


def test_snapshot_gradients_trail_the_state():
    # A window's step: the gradients copied from a private snapshot are queued at the
    # optimizer step, the next group's state at the boundary after it. The state lands first
    # (the next update_begin waits for it; only the snapshot's reuse waits for the gradients),
    # while both were queued behind a long copy: proven by order of completion (the
    # gradients' copy is as long as the first, ~0.4 s, once the state's has landed).
    engine = CopyEngine(HostDevice(), link_gbps=1.0)
    big_src = torch.randn(MIB // 4)
    big_dst, grad_dst = torch.empty_like(big_src), torch.empty_like(big_src)
    srcs = [torch.full((1000,), float(i)) for i in range(2)]
    dsts = [torch.empty(1000) for _ in srcs]
    first = _long_state_job(engine, big_src, big_dst, 400)
    n = np.full(400, 1, dtype=np.int64)
    grads = engine.submit_segments(n * grad_dst.data_ptr(), n * big_src.data_ptr(), n * MIB,
                                   SNAPSHOT)
    state = engine.submit([(dsts[i], srcs[i]) for i in (0, 1)], STATE)
    state.wait()
    assert first.done() and not grads.done()
    grads.wait()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert torch.equal(grad_dst, big_src)
    engine.close()


def test_many_odd_segments_land_bit_exactly():
    rng = np.random.default_rng(0)
    src = torch.from_numpy(rng.integers(0, 256, 16 * MIB, dtype=np.uint8))
    dst = torch.zeros_like(src)
    sizes = rng.integers(0, 5000, 3000)
    sizes[::7] = 0
    sizes[5] = 3 * PIECE_BYTES + 5  # one segment of several pieces
    starts = np.concatenate([[0], np.cumsum(sizes + 3)[:-1]])  # 3-byte gaps stay untouched
    assert starts[-1] + sizes[-1] < src.numel()
    engine = CopyEngine(HostDevice())
    t = engine.submit_segments(dst.data_ptr() + starts, src.data_ptr() + starts, sizes, STATE)
    t.wait()
    assert t.done() and t.error is None and t.nbytes == int(sizes.sum())
    want = torch.zeros_like(src)
    for a, n in zip(starts, sizes):
        want[a:a + n] = src[a:a + n]
    assert torch.equal(dst, want)
    engine.close()


def test_pacing_lower_bound():
    engine = CopyEngine(HostDevice(), link_gbps=2.0)
    src = torch.randn(2 * MIB)  # 8 MiB: 8 pieces
    dst = torch.empty_like(src)
    t = engine.submit([(dst, src)], STATE)
    t.wait()
    assert torch.equal(dst, src)
    assert t.seconds >= t.nbytes / 2e9 * (1 - 1e-9)
    assert engine.copy_seconds >= t.nbytes / 2e9 * (1 - 1e-9)
    engine.close()


def test_close_finishes_queued_work_and_refuses_more():
    engine = CopyEngine(HostDevice(), link_gbps=1.0)
    src = torch.randn(MIB)  # 4 MiB: ~4 ms paced
    dsts = [torch.empty_like(src) for _ in range(4)]
    tickets = [engine.submit([(d, src)], STATE) for d in dsts]
    engine.close()
    assert all(t.done() for t in tickets)
    assert all(torch.equal(d, src) for d in dsts)
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([(dsts[0], src)], STATE)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_segments([0], [0], [0], GRADIENT)


def test_submissions_from_several_threads():
    engine = CopyEngine(HostDevice())
    srcs = [torch.randn(257) for _ in range(4 * 50)]
    dsts = [torch.empty(257) for _ in srcs]
    tickets = [None] * len(srcs)

    def submit(k):
        for i in range(k, len(srcs), 4):
            tickets[i] = engine.submit([(dsts[i], srcs[i])], i % 2)

    threads = [threading.Thread(target=submit, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in tickets:
        t.wait()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert engine.bytes_copied == len(srcs) * 257 * 4
    engine.close()


def test_ticket_lets_its_tensors_go_after_completion():
    engine = CopyEngine(HostDevice())
    src, dst = torch.randn(1000), torch.empty(1000)
    t = engine.submit([(dst, src)], GRADIENT)
    held = weakref.ref(src)
    del src  # the ticket holds it while its copy may run
    gc.collect()
    assert held() is not None
    t.wait()
    gc.collect()
    assert held() is None and t.done() and t.seconds >= 0  # let go once complete
    t.wait()  # again: nothing left to wait for
    pending = engine.submit([(torch.empty(1000), torch.randn(1000))], STATE)
    del pending  # released (after its copy) by the ticket itself
    gc.collect()
    engine.close()


def test_segment_validation():
    engine = CopyEngine(HostDevice())
    with pytest.raises(ValueError, match="src has 2 elements"):
        engine.submit_segments([0], [0, 0], [0], STATE)
    with pytest.raises(ValueError, match="nbytes.0. is negative"):
        engine.submit_segments([0], [0], [-1], STATE)
    with pytest.raises(ValueError, match="integer"):
        engine.submit_segments(np.array([1.0]), [0], [0], STATE)
    with pytest.raises(ValueError, match="link_gbps"):
        CopyEngine(HostDevice(), link_gbps=0)
    t = engine.submit([(torch.empty(8)[::2], torch.empty(4))], STATE)
    with pytest.raises(RuntimeError, match="contiguous"):
        t.wait()
    engine.close()


def test_raw_engine_bookkeeping():
    e = _C.CopyEngine()
    src, dst = torch.randn(100), torch.empty(100)
    one = np.ones(1, np.int64)
    t = e.submit(1, one * dst.data_ptr(), one * src.data_ptr(), one * 400)
    e.wait(t)
    assert e.done(t) and e.nbytes(t) == 400 and e.seconds(t) >= 0
    assert e.stats()[0] == 400 and torch.equal(dst, src)
    e.release(t)
    e.release(t)  # unknown ids: no-op
    assert e.done(t)  # released tickets were complete
    with pytest.raises(ValueError, match="unknown ticket"):
        e.seconds(t)
    empty = e.submit(0, one[:0], one[:0], one[:0])
    assert e.done(empty) and e.nbytes(empty) == 0
    with pytest.raises(ValueError, match="nbytes has 2 elements"):
        e.submit(0, one, one, np.ones(2, np.int64))
    # submit_counted: the id and the bytes; take_done: a done ticket's seconds, forgotten
    t, nbytes = e.submit_counted(1, one * dst.data_ptr(), one * src.data_ptr(), one * 200)
    assert nbytes == 200
    e.wait(t)
    seconds = e.take_done(t)
    assert isinstance(seconds, float) and seconds >= 0
    assert e.take_done(t) == 0.0 and e.done(t)  # (forgotten: unknown ids are done)
    with pytest.raises(ValueError, match="unknown ticket"):
        e.seconds(t)
    e.close()


def test_copy_error_reaches_the_waiter():
    engine = CopyEngine(HostDevice())
    ticket = engine.submit([(torch.empty(3), torch.empty(4))], STATE)
    try:
        ticket.wait()
    except RuntimeError as exc:
        assert "size" in str(exc)
    else:
        raise AssertionError("a failing copy must raise at wait()")
    engine.close()


def test_empty_submission_is_done():
    engine = CopyEngine(HostDevice())
    assert engine.submit([], STATE).done()
    assert engine.submit_segments([], [], [], STATE).done()
    assert Ticket(0, 0).done() and Ticket(0, 0).seconds == 0.0
    engine.close()


def test_bandwidth_before_any_copy_is_the_emulated_link_or_unknown():
    paced, plain = CopyEngine(HostDevice(), link_gbps=0.5), CopyEngine(HostDevice())
    assert paced.bandwidth() == 0.5e9 and plain.bandwidth() == 0.0
    paced.close(), plain.close()


_INHERITED = {}


def _drop_the_inherited_engine():
    """In a forked child: collect the engine the parent left in _INHERITED."""
    _INHERITED.clear()
    gc.collect()


def test_a_forked_child_drops_its_copy_of_the_engine_without_hanging():
    """DataLoader workers are forked from the training process: collecting the copy engine
    they inherit must not join or destroy what belongs to the parent's worker thread (it
    hung there, in pthread_cond_destroy, when a worker's GC reached an old engine)."""
    import multiprocessing

    engine = _C.CopyEngine()
    src, dst = np.arange(1024, dtype=np.uint8), np.zeros(1024, dtype=np.uint8)
    engine.wait(engine.submit(0, np.array([dst.ctypes.data]), np.array([src.ctypes.data]),
                              np.array([1024])))  # the worker ran, and now waits for work
    _INHERITED["engine"] = engine
    child = multiprocessing.get_context("fork").Process(target=_drop_the_inherited_engine)
    child.start()
    child.join(timeout=120)
    hung = child.exitcode is None
    if hung:
        child.kill()
    _INHERITED.clear()
    assert not hung and child.exitcode == 0
    assert np.array_equal(dst, src)


def test_copy_now_copies_every_segment_short_or_long():
    # (a short copy keeps the GIL, a long one, from 16 MiB, lets it go: the same bytes)
    for size in (1000, (16 << 20) + 7):
        src = torch.from_numpy(np.random.default_rng(size).integers(0, 256, size, np.uint8))
        dst = torch.zeros_like(src)
        half = size // 2
        starts = np.array([0, half + 3], dtype=np.int64)
        sizes = np.array([half, size - half - 3], dtype=np.int64)
        _C.copy_now(dst.data_ptr() + starts, src.data_ptr() + starts, sizes)
        want = src.clone()
        want[half:half + 3] = 0  # (the gap between the segments stays untouched)
        assert torch.equal(dst, want)
