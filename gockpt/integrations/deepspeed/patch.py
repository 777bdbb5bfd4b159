"""One patched engine: the gockpt hooks around ``forward``/``backward``/``step`` and the
gockpt ``save_checkpoint``/``load_checkpoint``.

The step boundary (where a checkpoint may start or reach version F) is the end of a real
optimizer step, but DeepSpeed users call ``engine.save_checkpoint`` only when they want one.  So
the boundary is left *pending* after ``step()`` and recorded by whichever comes first: the
user's ``save_checkpoint`` (the checkpoint of that step), the next ``forward``/``backward``,
``wait()``, or the end of the process -- always before anything can change the state again.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Callable, Optional

import torch

from ... import storage
from ...checkpointer import Checkpointer
from ...core.config import GradTransport
from ...core.errors import CheckpointNotFoundError, ConfigError
from ...loading import load
from ...core.paths import directory_to_read, real_directory
from ...resharding import rank_and_world, written_by
from ...storage.commit import is_committed, read_latest
from .state import (EngineState, base_optimizer, check_record, engine_record, fp32_layout,
                    parallel_options, relink, restore_engine, step_written, warm_cpu_adam)


class EnginePatch:
    """gockpt's state for one engine (kept in ``gockpt.integrations.deepspeed._patches``)."""

    def __init__(self, engine, options: dict):
        # weak: the registry maps the engine to this patch, and a strong reference back
        # would keep every patched engine (and its model) alive for the whole process
        self._engine = weakref.ref(engine)
        options = dict(options)
        self.directory = options.pop("directory", None)  # known before the first save
        self.options = options
        self.ck: Optional[Checkpointer] = None
        self.state: Optional[EngineState] = None
        self.layout: Optional[dict] = None  # fp32_layout, taken once
        self.pending = False        # a step ended; its boundary is not recorded yet
        self.in_backward = False    # backward_begin called for the step under way
        self.warned_latest = False
        self.restored = None  # what the last load_checkpoint restored (gockpt.Restored)
        self.client_state = None  # as the last save gave it (the step log's, at each step)
        self.read_bytes: Optional[dict] = None  # what a load at another degree read
        # How to read what DeepSpeed last multiplied the gradients by (bf16 transport): set
        # by each unscale, called only when a checkpoint records that step's gradients.
        self.multiplier: Optional[Callable[[], torch.Tensor]] = None
        if options.get("grad_transport") == GradTransport.BF16 and watch_unscale(engine.optimizer, self):
            options["grad_multiplier"] = \
                lambda: self.multiplier() if self.multiplier is not None else None

    @property
    def engine(self):
        return self._engine()

    # ------------------------------------------------------------------ the loop

    def before_forward(self) -> None:
        self.flush()
        if self.ck is None and self.directory is not None:
            self._open(self._resolved(self.directory))  # made with the engine: F copies ahead

    def before_backward(self) -> None:
        self.flush()
        if self.ck is not None and not self.in_backward:
            self.ck.backward_begin()  # first micro-batch of this step
        self.in_backward = True

    def before_step(self) -> bool:
        """Returns whether this ``step()`` is a real optimizer step (accumulation boundary)."""
        real = bool(self.engine.is_gradient_accumulation_boundary())
        if real and self.ck is not None and self.in_backward:
            self.ck.update_begin()
        return real

    def after_step(self, real: bool) -> None:
        if real:
            self.in_backward = False
            self.pending = self.ck is not None

    def flush(self) -> None:
        """Record a pending step boundary (with the step log, the engine's record of that
        step: what a restart at it restores)."""
        if self.pending:
            self.pending = False
            self._boundary(self.ck)

    def _boundary(self, ck: Checkpointer) -> None:
        """The step boundary, no save asked."""
        engine, layout, client = self.engine, self.layout, self.client_state
        record = None if ck.steplog is None else (lambda: engine_record(engine, client, layout))
        ck.save_checkpoint(engine.global_steps, record)

    # ------------------------------------------------------------------ save / load / wait

    def save(self, save_dir, tag, client_state, save_latest) -> bool:
        if self.options.get("memory_log") is not None and client_state and \
                not callable(client_state):
            raise ConfigError("gockpt_ds: with memory_log, give client_state as a callable "
                              "(called at every step the log keeps, so that a restart at a "
                              "logged step gets that step's); a dict is this save's step's only")
        if self.in_backward:
            raise ConfigError("engine.save_checkpoint() was called between backward() and "
                              "step(); call it after engine.step()")
        if not save_latest and not self.warned_latest:
            warnings.warn("gockpt: save_latest=False is ignored: naming the checkpoint in "
                          "'latest' is how gockpt commits it", stacklevel=3)
            self.warned_latest = True
        directory = self._resolved(save_dir)
        if self.ck is not None and self.ck.config.directory != directory:
            self.close()
        fresh = self.ck is None
        if fresh:
            self._open(directory)
        elif not self.pending:
            raise ConfigError("engine.save_checkpoint() must follow engine.step(): a second "
                              "save at the same step, or a save before the first step")
        self.pending = False
        self.client_state = client_state
        engine, layout = self.engine, self.layout
        handle = self.ck.save_checkpoint(engine.global_steps,
                                         lambda: engine_record(engine, client_state, layout),
                                         force=True,
                                         name=None if tag is None else str(tag))
        return handle is not None

    @staticmethod
    def _resolved(directory) -> str:
        """``directory`` as Config resolves it (gockpt.core.paths): the same directory, the
        same Checkpointer."""
        try:
            return real_directory(directory)
        except OSError:
            return os.fspath(directory)  # the Checkpointer's ConfigError says why

    def _open(self, directory: str) -> None:
        """The Checkpointer of this engine's state in ``directory``."""
        self.state = EngineState(self.engine)
        self.layout = fp32_layout(self.engine)
        options = {**parallel_options(self.engine, self.state),
                   "step_written": step_written(self.engine, self.state), **self.options}
        self.ck = Checkpointer(self.state, base_optimizer(self.engine), directory,
                               scheduler=self.engine.lr_scheduler, **options)

    def load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
             load_module_only):
        self.close()  # finish what is in flight: loading replaces the state under it
        engine = self.engine
        with_optimizer = load_optimizer_states and not load_module_only
        scheduler = engine.lr_scheduler if load_lr_scheduler_states and not load_module_only \
            else None
        top = storage.resolve(directory_to_read(os.fspath(load_dir)),
                              None if tag is None else str(tag))
        written, world = written_by(top), rank_and_world()[1]
        self.read_bytes = None
        from .reshard import load_at_another_degree, needs_resharding  # (DCP: on use)
        if needs_resharding(top, engine, written, world):
            restored, self.read_bytes = load_at_another_degree(
                top, engine, with_optimizer=with_optimizer, scheduler=scheduler,
                written=written, world=world, check=lambda record: check_record(engine, record, top))
        else:  # the checkpoint resolved above, or the memory tier's copy of the newest
            run = os.path.dirname(top)
            newest = tag is None and run == directory_to_read(os.fspath(load_dir))
            restored = load(run, EngineState(engine),
                            base_optimizer(engine) if with_optimizer else None,
                            tag=None if newest else os.path.basename(top), scheduler=scheduler,
                            memory_dir=self.options.get("memory_dir"))
            check_record(engine, restored.extra_state, restored.path)
        if with_optimizer:
            relink(engine)
        if not with_optimizer and hasattr(engine.optimizer, "refresh_fp32_params"):
            engine.optimizer.refresh_fp32_params()  # DeepSpeed's semantics: fp32 from weights
        record = restored.extra_state
        if not load_module_only:
            restore_engine(engine, record)
        if with_optimizer:
            warm_cpu_adam(base_optimizer(engine))
        self.restored = restored
        return restored.path, record["client_state"]

    def close(self, failing: Optional[bool] = None) -> None:
        """Record a pending boundary, finish every checkpoint (durable), re-raise errors. At
        the end of the process (``failing`` given: on an uncaught exception or not) the
        Checkpointer's own exit rule instead (``Checkpointer.close_at_exit``: on several ranks
        a failing process abandons what is in flight, and records no boundary first)."""
        if self.ck is None:
            return
        ck, self.ck = self.ck, None
        try:
            if self.pending and not (failing and ck.ranks.several):
                self.pending = False
                self._boundary(ck)
        finally:
            self.in_backward = False
            if failing is None:
                ck.close()
            else:
                ck.close_at_exit(failing)


def zero_bf16(engine) -> bool:
    """Whether the engine hands its base optimizer bf16 gradients made fp32 and multiplied by
    one unscale/clip coefficient (ZeRO 1/2 in bf16 without offload): the bf16 transport's case."""
    wrapper = engine.optimizer
    return (type(wrapper).__name__ == "DeepSpeedZeroOptimizer" and engine.bfloat16_enabled()
            and not getattr(wrapper, "cpu_offload", False)
            and hasattr(wrapper, "unscale_and_clip_grads"))


def watch_unscale(wrapper, patch: EnginePatch) -> bool:
    """Wrap ZeRO's ``unscale_and_clip_grads`` (called per param group right before the base
    optimizer's step) so that ``patch.multiplier()`` gives the float32 scalar it multiplied the
    gradients by: the same call on a one-element 1.0 gives it bit for bit, whatever DeepSpeed's
    formula. The probe runs only when asked (a checkpoint recording that step), never on
    the steps in between; nothing DeepSpeed reads changes between the unscale and the step.
    False when the wrapper has no such method."""
    original = getattr(wrapper, "unscale_and_clip_grads", None)
    if original is None or type(wrapper).__name__ != "DeepSpeedZeroOptimizer":
        return False

    def unscale_and_clip_grads(grad_groups_flat, total_norm, *args, **kwargs):
        out = original(grad_groups_flat, total_norm, *args, **kwargs)
        first = grad_groups_flat[0]
        device = (first[0] if isinstance(first, list) else first).device

        def multiplier() -> torch.Tensor:
            probe = torch.ones(1, dtype=torch.float32, device=device)
            original([probe], total_norm, *args, **kwargs)
            return probe
        patch.multiplier = multiplier
        return out
    wrapper.unscale_and_clip_grads = unscale_and_clip_grads
    return True


def holds_gockpt_checkpoint(load_dir, tag) -> bool:
    """Whether ``tag`` (or what ``latest`` names) in ``load_dir`` is a gockpt checkpoint."""
    root = os.fspath(load_dir)
    if tag is None:
        try:
            tag, _ = read_latest(root)
        except ValueError:  # not a pointer gockpt wrote; DeepSpeed's own tells for itself
            tag = None
    if tag is not None:
        return is_committed(os.path.join(root, str(tag)))
    try:
        storage.resolve(root)  # no 'latest': any committed gockpt checkpoint
        return True
    except CheckpointNotFoundError:
        return False
