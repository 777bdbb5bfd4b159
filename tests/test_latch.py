"""gockpt.core.latch.Latch: a set-once event made of one lock."""

import threading

from gockpt.core.latch import Latch


def test_a_latch_is_unset_until_set_and_then_lets_every_waiter_pass():
    latch = Latch()
    assert not latch.is_set() and latch.wait(0) is False and latch.wait(0.001) is False
    passed = []
    started = threading.Barrier(5)

    def waiter():
        started.wait()
        passed.append(latch.wait())

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()  # (whether a waiter blocks before or after set(), it passes)
    latch.set()
    for t in threads:
        t.join(timeout=60)
    assert passed == [True] * 4 and latch.is_set()
    assert latch.wait() and latch.wait(0) and latch.wait(-1)


def test_a_latch_set_again_stays_set():
    latch = Latch()
    latch.set()
    latch.set()  # (its lock released once: a second release would raise)
    assert latch.is_set() and latch.wait(0) and repr(latch) == "<Latch set>"
