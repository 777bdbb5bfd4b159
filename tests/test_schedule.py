"""gockpt.schedule: when a checkpoint is due (fixed, or the Young/Daly "auto" interval from
measurements) and its K. Measurements are driven through a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gockpt import schedule as schedule_mod
from gockpt.core.config import Config
from gockpt.interval import auto_interval
from gockpt.schedule import Schedule


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(schedule_mod, "time", SimpleNamespace(perf_counter=c))
    return c


def steps(s, clock, n, fwd_bwd, rest):
    """``n`` training steps: forward/backward ``fwd_bwd`` s, then ``rest`` s until the boundary."""
    for _ in range(n):
        clock.now += fwd_bwd
        s.reached_update()
        clock.now += rest
        s.reached_boundary(True)
        s.boundary_done()


def test_fixed_interval():
    s = Schedule(Config(directory="x", interval=5))
    assert [n for n in range(1, 21) if s.due(n)] == [5, 10, 15, 20]


def test_no_interval_is_never_due():
    s = Schedule(Config(directory="x"))
    assert not any(s.due(n) for n in range(1, 50))


def test_auto_waits_for_the_first_measured_checkpoint(clock):
    s = Schedule(Config(directory="x", interval="auto", mtbf=3600.0, first_auto_step=3))
    assert [n for n in range(1, 4) if s.due(n)] == [3]
    s.asked(3)
    steps(s, clock, 4, 0.25, 0.25)  # step time 0.5 s
    assert not any(s.due(n) for n in range(4, 10_000, 7))  # no stall measured yet
    s.durable(2.0)
    expected = auto_interval(2.0, 0.5, 3600.0)
    assert expected > 1
    assert not s.due(3 + expected - 1) and s.due(3 + expected)
    assert s.auto_interval == expected and s.auto_inputs == (2.0, 0.5, 3600.0)


def test_auto_is_recomputed_only_after_each_durable_checkpoint(clock):
    s = Schedule(Config(directory="x", interval="auto", mtbf=3600.0, first_auto_step=1))
    s.asked(1)
    steps(s, clock, 3, 0.5, 0.5)  # 1 s per step
    s.durable(8.0)
    s.due(2)
    first = s.auto_interval
    assert first == auto_interval(8.0, 1.0, 3600.0)
    steps(s, clock, 16, 0.125, 0.125)  # steps got faster, but nothing new was committed
    s.due(3)
    assert s.auto_interval == first
    s.durable(8.0)
    s.due(4)
    assert s.auto_interval == auto_interval(8.0, 0.25, 3600.0) != first
    s.durable(0.5)
    s.due(5)  # the median of the stalls measured so far
    assert s.auto_inputs == (8.0, 0.25, 3600.0)


def test_auto_without_a_measured_step_time_waits(clock):
    s = Schedule(Config(directory="x", interval="auto", mtbf=3600.0, first_auto_step=1))
    s.asked(1)
    s.durable(1.0)
    assert not s.due(1000) and s.auto_interval is None
    steps(s, clock, 1, 0.5, 0.5)
    s.due(1001)
    assert s.auto_interval == auto_interval(1.0, 1.0, 3600.0)


def test_step_times_are_measured_between_boundaries(clock):
    s = Schedule(Config(directory="x"))
    steps(s, clock, 3, 0.25, 0.75)
    clock.now += 2.0
    s.reached_boundary(False)  # a boundary without a step (the first call) is not a step
    assert s.step_times == [1.0, 1.0, 1.0] and s.fwd_bwd_times == [0.25] * 3
    assert s.median_step_time() == 1.0
    steps(s, clock, 20, 0.25, 0.75)
    assert len(s.step_times) == 16  # a bounded history


@pytest.mark.parametrize("mode,overlap,expected", [("gockpt", 3, 3), ("gockpt-o", 5, 5),
                                                   ("async-o", 5, 1), ("sync", None, 1)])
def test_choose_k_fixed(mode, overlap, expected):
    s = Schedule(Config(directory="x", mode=mode, overlap_steps=overlap))
    assert s.choose_k(1 << 30, 0, 1.0) == expected


def test_choose_k_before_any_measurement_is_2():
    assert Schedule(Config(directory="x")).choose_k(1 << 30, 0, 1.0) == 2


@pytest.mark.parametrize("state_bytes,expected", [(320, 3), (256, 2), (1, 1), (10 ** 9, 8)])
def test_choose_k_from_the_measured_forward_backward(clock, state_bytes, expected):
    s = Schedule(Config(directory="x"))
    steps(s, clock, 3, 0.125, 1.0)  # forward/backward 0.125 s
    assert s.choose_k(state_bytes, 0, 1024.0) == expected  # copy time / fwd_bwd, in [1, 8]


def test_choose_k_probes_the_bandwidth_when_none_was_measured(clock, monkeypatch):
    probed = []
    monkeypatch.setattr(schedule_mod, "_probe_bandwidth", lambda: probed.append(1) or 1024.0)
    s = Schedule(Config(directory="x"))
    steps(s, clock, 1, 0.125, 1.0)
    assert s.choose_k(320, 0, 0.0) == 3 and probed == [1]
    # asked again at every step until a copy measures the bandwidth: probed once (a probe
    # allocates and copies 64 MiB, which the training step paid at every step before)
    steps(s, clock, 2, 0.125, 1.0)
    assert s.choose_k(320, 0, 0.0) == 3 and s.choose_k(256, 0, 0.0) == 2 and probed == [1]
    assert s.choose_k(320, 0, 2048.0) == 2 and probed == [1]  # measured: taken as it is


@pytest.mark.parametrize("grad_bytes,expected", [(0, 3), (64, 3), (96, 4), (180, 7), (256, 8)])
def test_choose_k_counts_the_gradients_the_replay_needs(clock, grad_bytes, expected):
    # 128 bytes per forward/backward; a state of 320 bytes; K passes carry 320 + G (K-1)/2.
    s = Schedule(Config(directory="x"))
    steps(s, clock, 3, 0.125, 1.0)
    assert s.choose_k(320, grad_bytes, 1024.0) == expected


def test_a_window_starts_with_the_steps_left_to_the_expected_checkpoint():
    s = Schedule(Config(directory="x", interval=10))
    assert s.window_starting(7, 4) == 4  # 7, 8, 9, 10
    assert s.window_starting(6, 4) is None  # step 9 is not expected: not yet
    assert s.window_starting(8, 4) == 3  # K grew from 3 at boundary 7: the 3 steps left
    assert s.window_starting(10, 4) is None  # the next, step 20, is further than K away
    assert s.window_starting(9, 1) is None  # K = 1: no window


@pytest.mark.parametrize("overlap_steps", [None, 3, 12])
def test_a_window_may_start_only_where_a_window_of_some_k_starts(clock, overlap_steps):
    """window_may_start (the usual boundary's check, before K is worked out) is False only
    where no K the window can have -- up to MAX_K measured, the configured K, the agreed
    one -- starts a window: it never hides one window_starting would start. Until K was
    once worked out from measurements it is True (the bandwidth probe runs early, once)."""
    s = Schedule(Config(directory="x", interval=40, overlap_steps=overlap_steps))
    s.announce(57)
    assert all(s.window_may_start(step) for step in range(0, 90))
    s.choose_k(1 << 20, 0, 1e9)  # (nothing measured yet: K = 2, nothing probed)
    assert s.window_may_start(20) == (overlap_steps is None)
    steps(s, clock, 2, 0.01, 0.001)
    s.choose_k(1 << 20, 0, 1e9)
    longest = max(schedule_mod.MAX_K, overlap_steps or 0, s.agreed_k)
    for step in range(0, 90):
        starts = [k for k in range(1, longest + 1) if s.window_starting(step, k) is not None]
        assert s.window_may_start(step) == bool(starts), step
    assert not s.window_may_start(40 - longest) and s.window_may_start(40 - longest + 1)
    s.agreed_k = 20  # (several ranks: K agreed at the last checkpoint)
    assert s.window_may_start(40 - 20 + 1) and not s.window_may_start(40 - 20)


def test_the_spacing_of_the_users_saves_is_learned():
    s = Schedule(Config(directory="x"))
    assert s.spacing() is None and not s.expected(10)
    s.asked(10)
    assert s.spacing() is None  # one save says nothing about the next
    s.asked(20)
    assert s.spacing() == 10 and s.expected(30) and not s.expected(29)
    s.announce(33)
    assert s.due(33) and s.expected(33)
    s.asked(33)
    assert not s.due(33) and s.spacing() == 13
    assert not s.expected(46)  # announced saves are announced: the next one is not guessed
    s.asked(46)  # ... until a save comes unannounced again
    assert s.spacing() == 13 and s.expected(59)
