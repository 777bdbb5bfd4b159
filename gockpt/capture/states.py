"""The optimizer's state dicts as one checkpoint's copies read them, and whether any was
replaced before F (``optimizer.load_state_dict()``, a state dict assigned): then the
checkpoint would hold another state than the live one.

Read once per checkpoint, walked from ``optimizer.state``'s items by parameter id (looking each
parameter up would call ``Tensor.__hash__``, a Python function, per parameter); slots without
state are filled in when the optimizer has created states since; at F one C-level identity
pass over ``optimizer.state``'s dicts says whether any was replaced, and the next checkpoint
starts from that reading while none is.
"""

from __future__ import annotations

import operator
from itertools import compress, count, repeat
from typing import Dict, List, Optional

import torch

from .. import _tensors
from ..core.job import Job
from ..core.memory import local
from ..core.plan import Plan
from ..core.staging import HostCopy


class StateWatch:
    """The state dicts of one optimizer, read per checkpoint (one checkpoint captures at a
    time: a new job starts a new reading)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._job: Optional[Job] = None
        self._reading: Optional[_Reading] = None
        self._carried = None  # (plan, _dicts_of(optimizer.state), each slot's dict, the
        # slots without one) at F
        self._lookups: Dict[str, _tensors.DictValues] = {}
        self._state_version = _tensors.DictVersions()  # optimizer.state's, noted at each
        # reading and at each F
        self.generation = 0
        """Changes whenever :meth:`of` may give other dicts than before (a reading made anew,
        slots filled in): what was derived from its lists holds while it is the same."""

    def declare_keys(self, host: HostCopy, state_keys: Optional[tuple]) -> None:
        """Which optimizer state tensors a checkpoint carries, per slot: ``state_keys`` (a
        replay adapter's) for every optimized slot, declared once; without a replay, the
        tensors shaped like their parameter that the optimizer holds now."""
        if state_keys is not None and host.keys_declared:
            return
        likes = {}
        for si, s in enumerate(host.slots):
            if s.static:
                continue
            if state_keys is not None:
                likes[si] = {k: s.local for k in state_keys}
            else:
                live = self.optimizer.state.get(s.param, {})
                likes[si] = {k: local(v) for k, v in live.items()
                             if isinstance(v, torch.Tensor) and k != "step"
                             and local(v).shape == s.local.shape}
        host.set_keys(likes)

    def of(self, job: Job) -> list:
        """Per slot of ``job``'s plan: its optimizer state dict (None: none yet)."""
        state = self.optimizer.state
        if job is not self._job:
            self._job, self._reading = job, None
            if self._carried is not None:
                plan, seen, states, missing = self._carried  # read at the last F
                # no dict replaced since: optimizer.state unchanged (its version: no pass over
                # it), else the same dicts in it
                if plan is job.plan and (self._state_version.same([state])
                                         or _same_dicts(state, seen)):
                    self._reading = _Reading(list(states) if missing else states, seen,
                                             len(seen[1]), missing)
        r = self._reading
        if r is None:
            r = self._reading = _Reading(self.read(job.plan), _dicts_of(state), len(state))
            self._state_version.same([state])  # (noted: unchanged at F, none replaced)
            self.generation += 1
        elif r.missing and len(state) != r.length:  # states created since
            fresh, r.length = self.read(job.plan), len(state)
            self.generation += 1
            for si in r.missing:
                r.states[si] = fresh[si]
            r.missing = [si for si in r.missing if fresh[si] is None]
        return r.states

    def lookup(self, key: str) -> "_tensors.DictValues":
        """What the state dicts hold under ``key``, read through one object per key that looks
        a dict up again only once it has changed (:class:`gockpt._tensors.DictValues`: a
        group's moments without a dict lookup each, after the first window)."""
        found = self._lookups.get(key)
        if found is None:
            found = self._lookups[key] = _tensors.DictValues(key)
        return found

    def read(self, plan: Plan) -> list:
        """Per slot of ``plan``: the optimizer's state dict for its parameter now, or None."""
        index, states = plan.slot_of_id, [None] * len(plan.slots)
        for p, st in self.optimizer.state.items():
            si = index.get(id(p))
            if si is not None:
                states[si] = st
        return states

    def replaced(self, job: Job) -> List[str]:
        """At F: the slots whose optimizer state, as ``job``'s copies read it, has been
        replaced since. When ``optimizer.state`` is unchanged since the reading (its dict
        version, noted then) or still holds the very dicts it held then (one C-level identity
        pass), none was."""
        cached, state = self.of(job), self.optimizer.state
        reading = self._reading
        if self._state_version.same([state]):
            # optimizer.state unchanged since the reading (its version, noted then: no pass
            # over it): the same dicts, and the same slots without one (a state created
            # since is a key added: another version)
            self._carried = (job.plan, reading.seen, cached, list(reading.missing))
            return []
        seen = reading.seen
        if _same_dicts(state, seen):
            now, replaced = cached, []
        else:
            now = self.read(job.plan)
            self.generation += 1  # (the next window starts from this reading)
            reloaded = state is not seen[0]  # load_state_dict: every slot
            replaced = [s.name for s, old, new in zip(job.plan.slots, cached, now)
                        if new is not old and (old is not None or reloaded)]
        # The next checkpoint starts from this reading if no state dict has been replaced
        # by then (its version, else the same identity pass), else it reads them again.
        self._carried = (job.plan, _dicts_of(state), now, _missing(now))
        self._state_version.same([state])  # (noted: unchanged at the next start, none replaced)
        return replaced


class _Reading:
    """One checkpoint's reading: each slot's state dict, what ``optimizer.state`` held then
    (for the check at F), its length, and the slots without state yet."""

    def __init__(self, states: list, seen: tuple, length: int, missing: Optional[list] = None):
        self.states, self.seen, self.length = states, seen, length
        self.missing = _missing(states) if missing is None else list(missing)


def _missing(states: list) -> list:
    """The slots without state (C-level passes: a Python step per slot was a tenth of a
    window's first boundary)."""
    return list(compress(count(), map(operator.is_, states, repeat(None))))


def _dicts_of(state: dict) -> tuple:
    """(``state``, the dicts it holds, in order): what :func:`_same_dicts` compares with."""
    return state, list(state.values())


def _same_dicts(state: dict, seen: tuple) -> bool:
    """Whether ``state`` is the mapping of ``seen`` (:func:`_dicts_of`) and holds the very same
    dicts in the same order (by identity, in one C-level pass)."""
    mapping, values = seen
    return mapping is state and len(state) == len(values) and \
        all(map(operator.is_, state.values(), values))
