"""gockpt.core.modes: every mode is one frozen policy; the baselines are ablations of one engine."""

from __future__ import annotations

import dataclasses

import pytest

from gockpt import MODES
from gockpt.core.config import Config
from gockpt.core.modes import GRADS_AT_BACKWARD, GRADS_IN_STEP, NO_REPLAY_MODES, POLICIES

#        replays copies_at_start persists_inline grad_wait          fixed_k streams
TABLE = {
    "sync":     (False, True,  True,  None,              1,    False),
    "async":    (False, True,  False, None,              1,    True),
    "async-o":  (False, False, False, None,              1,    True),
    "gockpt":   (True,  False, False, GRADS_IN_STEP,     None, True),
    "gockpt-o": (True,  False, False, GRADS_AT_BACKWARD, None, True),
}


@pytest.mark.parametrize("mode", list(TABLE))
def test_policy_table(mode):
    p = POLICIES[mode]
    assert p.name == mode
    assert (p.replays, p.copies_at_start, p.persists_inline, p.grad_wait, p.fixed_k,
            p.streams) == TABLE[mode]


def test_modes_and_no_replay_modes():
    assert MODES == tuple(TABLE) == tuple(POLICIES)
    assert NO_REPLAY_MODES == ("sync", "async", "async-o")


def test_policies_are_frozen_and_shared_by_configs():
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICIES["gockpt"].replays = False
    assert Config(directory="x", mode="async-o").policy is POLICIES["async-o"]
