"""When to checkpoint and over how many steps: the interval (fixed, or Young/Daly ``"auto"``
re-measured after every checkpoint) and K, chosen from the measured step times and copy
bandwidth. Everything here is decided from step counts and measurements of this process."""

from __future__ import annotations

import enum
import logging
import statistics
import time
import warnings
from typing import List, Optional

import torch

from .core.config import Config, Interval, OnBusy
from .interval import auto_interval

log = logging.getLogger("gockpt")

_HISTORY = 16  # measurements kept (the medians ignore a few outliers)
# Longest window: the paper finds the best K near 7 on GPUs; beyond, the gradient traffic
# grows faster than what one more step of overlap saves.
MAX_K = 8


class Busy(enum.Enum):
    """What a checkpoint starting now does about the previous one."""

    FREE = "free"  # none, or it is durable: start
    WAIT = "wait"  # still persisting, on_busy="wait": wait until it is durable, then start
    SKIP = "skip"  # still being captured, or persisting with on_busy="skip": do not start


class Schedule:
    """Step-time measurements and the decisions made from them."""

    def __init__(self, config: Config, several_ranks: bool = False):
        self.config = config
        self.several_ranks = several_ranks
        self.agreed_k = config.overlap_steps or 2  # several ranks: K agreed at each F
        self._warned_k = False
        self._probed: Optional[float] = None    # host copy bandwidth, probed once
        self._k_measurable = False  # K worked out from measurements at least once (or fixed)
        self.fwd_bwd_times: List[float] = []    # boundary -> update_begin
        self.step_times: List[float] = []       # boundary -> boundary
        self._t_boundary = time.perf_counter()
        self._last_asked: Optional[int] = None  # step of the last checkpoint taken
        self._learned: Optional[int] = None     # spacing of the last two forced saves
        self._last_announced = False            # the last save was announced by plan_checkpoint
        self._announced: set = set()            # steps announced by plan_checkpoint()
        self._stalls: List[float] = []          # blocked time of the last durable checkpoints
        self._durable = 0                       # checkpoints committed so far ...
        self._durable_used = 0                  # ... of which N* has seen
        self._log_from: Optional[int] = None    # the step before the first boundary seen
        self.log_spacing: Optional[int] = None
        """With the step log (``Config.memory_log``): the most steps between two checkpoints,
        so that one comes before the log is full (:func:`gockpt.steplog.log_spacing`)."""
        self.auto_interval: Optional[int] = None
        """With ``interval="auto"``: the current N*, once the first checkpoint measured it."""
        self.auto_inputs: Optional[tuple] = None
        """(stall, step time, MTBF) that gave ``auto_interval``."""

    # ------------------------------------------------------------------ measurements

    def reached_update(self) -> None:
        """update_begin: forward/backward of this step is over."""
        self.fwd_bwd_times = _keep(self.fwd_bwd_times, time.perf_counter() - self._t_boundary)

    def reached_boundary(self, completed_step: bool) -> None:
        """save_checkpoint: a training step (if ``completed_step``) is over."""
        if completed_step:
            self.step_times = _keep(self.step_times, time.perf_counter() - self._t_boundary)

    def boundary_done(self) -> None:
        """The boundary's own work is over: the next step's clock starts."""
        self._t_boundary = time.perf_counter()

    def durable(self, blocked_s: float) -> None:
        """A checkpoint was committed having blocked training ``blocked_s`` (persist thread)."""
        self._stalls = (self._stalls + [blocked_s])[-8:]
        self._durable += 1

    def median_step_time(self) -> float:
        return statistics.median(self.step_times) if self.step_times else 0.0

    # ------------------------------------------------------------------ decisions

    def due(self, step: int) -> bool:
        """Whether a checkpoint of ``step`` is to be taken (without ``force``): announced, a
        multiple of the interval, N* after the last one, or the step log's spacing after it."""
        if step in self._announced:
            return True
        if self.log_spacing is not None:  # before the step log is full, whatever the interval
            if self._log_from is None:  # (this process's first boundary: a restart's too)
                self._log_from = step - 1
            last = self._last_asked if self._last_asked is not None else self._log_from
            if step - last >= self.log_spacing:
                return True
        interval = self.config.interval
        if interval is None:
            return False
        if interval is not Interval.AUTO:
            return step % interval == 0
        self._update_auto_interval()
        if self._last_asked is None:
            return step >= self.config.first_auto_step
        if self.auto_interval is None:
            return False  # the first checkpoint's stall is not measured yet
        return step - self._last_asked >= self.auto_interval

    def announce(self, step: int) -> None:
        """A checkpoint will be asked for at ``step`` (Checkpointer.plan_checkpoint)."""
        self._announced.add(step)

    def asked(self, step: int) -> None:
        """A checkpoint of ``step`` was taken (due, announced or forced)."""
        self._last_announced = step in self._announced
        self._announced.discard(step)
        if self._last_asked is not None and step > self._last_asked:
            self._learned = step - self._last_asked
        self._last_asked = step

    def expected(self, step: int) -> bool:
        """Whether a checkpoint is expected at ``step``: it is due, or -- without an interval
        -- the forced saves so far came every D steps and ``step`` is the next one. A loop that
        announced its last save announces the next one too: nothing is guessed after it (a
        guess after a loop's last planned save would copy a window for nothing)."""
        if self.due(step):
            return True
        return self.config.interval is None and self._learned is not None \
            and not self._last_announced and step == self._last_asked + self._learned

    def window_starting(self, step: int, k: int) -> Optional[int]:
        """K of the window to start at boundary ``step`` (the checkpoint expected within the
        next ``k`` steps, ``k`` as measured now), with the steps left: a K that grew by one
        since the last boundary (a slower step measured) jumps over the boundary where its
        window was due, and the checkpoint would then be copied at once, blocking, as one
        asked for without notice. None: no window starts here."""
        for span in range(k, 1, -1):
            if self.expected(step + span - 1):
                return span
        return None

    def window_may_start(self, step: int) -> bool:
        """Whether a window of any K there can be (up to MAX_K measured, the configured K, the
        agreed one) would start at boundary ``step``: a checkpoint is expected within it.
        False at the usual boundary, found in a few comparisons, without measuring K; True
        until K was once worked out from measurements (so that the bandwidth probe, once,
        runs at an early boundary as before, not at the first window's start)."""
        if not self._k_measurable:
            return True
        longest = max(MAX_K, self.config.fixed_overlap_steps() or 0, self.agreed_k)
        return self.window_starting(step, longest) is not None

    def spacing(self) -> Optional[int]:
        """Steps between two checkpoints as known now (the interval, N*, or the learned
        spacing of forced saves); None when unknown. A window of K steps must fit in it."""
        interval = self.config.interval
        if isinstance(interval, int):
            known = interval
        else:
            known = self.auto_interval if interval is Interval.AUTO else self._learned
        if self.log_spacing is None:
            return known
        return self.log_spacing if known is None else min(known, self.log_spacing)

    def previous_busy(self, prev, step: int, boundary: int, quiet: bool = False) -> Busy:
        """Whether a checkpoint starting at ``boundary`` (for ``step``) waits for ``prev``, the
        previous one (or None), or is skipped (with a warning unless ``quiet``: a window not
        asked for yet, decided again at its step)."""
        # On several ranks decided from the step count alone, so that every rank decides
        # alike; on one, a window that failed before its step lets that step be taken anew.
        if prev is not None and boundary <= prev.f_boundary and not prev.dropped \
                and (prev.capturing or self.several_ranks):
            if not quiet:
                warnings.warn(f"gockpt: checkpoint at step {step} skipped: the checkpoint of "
                              f"step {prev.handle.final_step} is still being captured",
                              stacklevel=4)
            return Busy.SKIP
        if prev is None or prev.handle.done():
            return Busy.FREE
        if self.config.on_busy is OnBusy.SKIP:
            if not quiet:
                warnings.warn(f"gockpt: checkpoint at step {step} skipped: the checkpoint of "
                              f"step {prev.handle.final_step} is still persisting "
                              "(on_busy='skip')", stacklevel=4)
            return Busy.SKIP
        return Busy.WAIT

    def window_k(self, plan, bandwidth: float, replays: bool) -> int:
        """K of a window starting now: configured, measured (on several ranks: agreed at the
        last checkpoint), at most the spacing of the saves, at most the blocks to copy."""
        k = self.config.fixed_overlap_steps()
        if k is None:
            k = self.agreed_k if self.several_ranks else self.measured_k(plan, bandwidth, replays)
        self._k_measurable |= self.several_ranks  # (the K agreed at the last F)
        spacing = self.spacing()
        if spacing is not None:
            k = min(k, spacing)
        if plan.k_cap:  # replicas' shares: a K that every replica's share can fill
            k = min(k, plan.k_cap)
        groups = len(plan.groups(k))
        if groups < k and self.config.overlap_steps and not self._warned_k:
            self._warned_k = True
            warnings.warn(f"gockpt: overlap_steps={self.config.overlap_steps} but only "
                          f"{groups} blocks are replayed (the others are copied at the final "
                          f"step): K={groups}", stacklevel=4)
        return groups

    def measured_k(self, plan, bandwidth: float, replays: bool) -> int:
        """:meth:`choose_k` for ``plan``'s state (and, with a replay, its gradients)."""
        return self.choose_k(plan.state_bytes(2), plan.optimized_bytes() if replays else 0,
                             bandwidth)

    def choose_k(self, state_bytes: int, grad_bytes: int, bandwidth: float) -> int:
        """K: the fewest steps whose forward/backward passes carry the state copy and the
        gradients the replay needs.  A block copied during step j of the window needs the
        gradients of the K-1-j later steps, so on average the window moves
        ``S + G (K-1) / 2`` bytes (S: state, G: one step's gradients) in K passes;
        ``bandwidth`` is bytes/s (0: not measured yet, probed once: this is asked at every
        step until a copy has measured it, and a probe moves 64 MiB)."""
        fixed = self.config.fixed_overlap_steps()
        if fixed is not None:
            self._k_measurable = True
            return fixed
        if not self.fwd_bwd_times:
            return 2  # nothing measured yet
        if not bandwidth:
            if self._probed is None:
                self._probed = _probe_bandwidth()
            bandwidth = self._probed
        per_pass = statistics.median(self.fwd_bwd_times) * bandwidth
        self._k_measurable = True
        for k in range(1, MAX_K + 1):
            if k * per_pass >= state_bytes + grad_bytes * (k - 1) / 2:
                return k
        # The link cannot keep up even at MAX_K (gradients nearly fill it): the longest
        # window still blocks least.
        return MAX_K

    def _update_auto_interval(self) -> None:
        """Recompute N* from the stalls and step time measured so far (after each checkpoint)."""
        stalls, durable = list(self._stalls), self._durable
        if durable == self._durable_used or not stalls or not self.step_times:
            return
        self._durable_used = durable
        stall = statistics.median(stalls)
        step_time = self.median_step_time()
        if stall <= 0 or step_time <= 0:
            return
        new = auto_interval(stall, step_time, self.config.mtbf)
        self.auto_inputs = (stall, step_time, self.config.mtbf)
        if new != self.auto_interval:
            log.info("gockpt: checkpoint interval %s -> %d steps (stall %.4fs, step %.4fs, "
                     "MTBF %.0fs)", self.auto_interval, new, stall, step_time, self.config.mtbf)
            self.auto_interval = new


def _keep(values: List[float], value: float) -> List[float]:
    return (values + [value])[-_HISTORY:]


def _probe_bandwidth() -> float:
    """Host copy bandwidth from one 32 MiB copy (used before any checkpoint measured it)."""
    src = torch.ones(8 << 20)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return src.numel() * 4 / max(time.perf_counter() - t0, 1e-6)
