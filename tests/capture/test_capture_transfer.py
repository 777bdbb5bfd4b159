import threading

import torch

from gockpt.capture.device import HostDevice
from gockpt.capture.transfer import GRADIENT, STATE, CopyEngine


class GatedDevice(HostDevice):
    """Host copies that wait for a gate on the first copy, and log their order."""

    def __init__(self):
        self.gate = threading.Event()
        self.started = threading.Event()
        self.order = []

    def copy(self, dst, src):
        if not self.order:
            self.started.set()
            self.gate.wait()
        self.order.append(int(src[0]))
        dst.copy_(src)


def test_copies_land_and_gradients_overtake_state():
    dev = GatedDevice()
    engine = CopyEngine(dev)
    srcs = [torch.full((1000,), float(i)) for i in range(6)]
    dsts = [torch.empty(1000) for _ in srcs]
    first = engine.submit([(dsts[0], srcs[0])], STATE)
    assert dev.started.wait(10)  # the transfer thread is busy with the first state copy
    state = engine.submit([(dsts[i], srcs[i]) for i in (1, 2, 3)], STATE)
    grads = engine.submit([(dsts[i], srcs[i]) for i in (4, 5)], GRADIENT)
    dev.gate.set()
    for t in (first, state, grads):
        t.wait()
    assert dev.order == [0, 4, 5, 1, 2, 3]
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert state.nbytes == 3 * 4000 and engine.bandwidth() > 0
    engine.close()


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
    engine.close()
