"""The five checkpointing modes as one frozen policy each, built once per Checkpointer.

Every place that behaves differently per mode asks the policy a question (does it replay? does
it copy everything when the checkpoint starts? ...) instead of comparing mode names, so that the
paper's baselines are ablations of one engine, not separate code paths.

| mode     | what blocks training                                                          |
| -------- | ----------------------------------------------------------------------------- |
| sync     | copy + write of everything at save_checkpoint                                 |
| async    | copy of everything at save_checkpoint; written in the background              |
| async-o  | copies ride under one step's forward/backward; the rest blocks at update_begin |
| gockpt   | copies spread over K steps; gradient copies waited for in the optimizer step   |
| gockpt-o | as gockpt; gradient copies waited for at the next backward_begin              |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Mode(str, enum.Enum):
    """The five modes (a ``str``: ``Mode.ASYNC_O == "async-o"``, as users pass them)."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_O = "async-o"
    GOCKPT = "gockpt"
    GOCKPT_O = "gockpt-o"

    def __str__(self) -> str:
        return self.value


class GradWait(enum.Enum):
    """Where a replaying mode waits for the gradient copies of a step."""

    IN_STEP = "optimizer step"     # gockpt: before the update may change anything
    AT_BACKWARD = "next backward"  # gockpt-o: overlapped with the update and next forward


GRADS_IN_STEP, GRADS_AT_BACKWARD = GradWait.IN_STEP, GradWait.AT_BACKWARD


@dataclass(frozen=True)
class ModePolicy:
    """What one mode does; see the module table."""

    name: Mode
    replays: bool
    """Blocks captured before F are brought to F by replaying optimizer steps (needs an exact
    replay arithmetic for the optimizer)."""
    copies_at_start: bool
    """Every copy is taken, blocking, inside the save_checkpoint that starts the checkpoint."""
    persists_inline: bool
    """The write and commit happen inside save_checkpoint (the whole checkpoint blocks)."""
    grad_wait: Optional[GradWait]
    """Where gradient copies are waited for (GRADS_IN_STEP / GRADS_AT_BACKWARD); None: the
    mode records no gradients."""

    @property
    def fixed_k(self) -> Optional[int]:
        """K when the mode fixes it (1 without replay), else None (chosen or configured)."""
        return None if self.replays else 1

    def snapshots_gradients(self, device) -> bool:
        """Whether the replayed steps' gradient copies read a private snapshot of ``.grad``
        taken in the optimizer's pre-hook (host memory of its own where ``device`` is the CPU:
        :func:`gockpt.core.staging.planned_host_bytes`): an overlapped copy on a device that
        cannot queue the training work behind it; elsewhere the stream waits for the copy."""
        return self.replays and self.grad_wait == GRADS_AT_BACKWARD and \
            device.overlap_needs_snapshot

    @property
    def streams(self) -> bool:
        """Blocks may be written while others are still being captured or replayed."""
        return not self.persists_inline


POLICIES = {
    Mode.SYNC: ModePolicy(Mode.SYNC, replays=False, copies_at_start=True,
                          persists_inline=True, grad_wait=None),
    Mode.ASYNC: ModePolicy(Mode.ASYNC, replays=False, copies_at_start=True,
                           persists_inline=False, grad_wait=None),
    Mode.ASYNC_O: ModePolicy(Mode.ASYNC_O, replays=False, copies_at_start=False,
                             persists_inline=False, grad_wait=None),
    Mode.GOCKPT: ModePolicy(Mode.GOCKPT, replays=True, copies_at_start=False,
                            persists_inline=False, grad_wait=GRADS_IN_STEP),
    Mode.GOCKPT_O: ModePolicy(Mode.GOCKPT_O, replays=True, copies_at_start=False,
                              persists_inline=False, grad_wait=GRADS_AT_BACKWARD),
}

MODES = tuple(m.value for m in POLICIES)
#: Modes that need no optimizer replay and therefore accept any optimizer.
NO_REPLAY_MODES = tuple(m.value for m, p in POLICIES.items() if not p.replays)
