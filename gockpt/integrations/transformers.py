"""gockpt in the Hugging Face Trainer's loop: a ``Trainer`` subclass.

    from gockpt.integrations.transformers import GockptTrainer
    trainer = GockptTrainer(model=model, args=TrainingArguments("out", save_steps=100),
                            train_dataset=data)            # in place of Trainer(...)
    trainer.train()                                        # gockpt-o checkpoints in out/
    trainer.train(resume_from_checkpoint=True)             # resumes from the newest, bit for bit

What it changes in the Trainer's loop:

- gockpt's three calls go where the Trainer's gradients are final: ``backward_begin`` at
  ``on_step_begin`` (the first micro-batch of each optimizer step), ``update_begin`` at
  ``on_pre_optimizer_step`` (after gradient accumulation and clipping, so the replay consumes
  what the update consumes), the step boundary after the step.
- The boundary of step N is told to gockpt when step N is over: at the next step's
  ``on_step_begin``, the next epoch's ``on_epoch_begin`` or ``on_train_end`` -- after the
  Trainer's logging, evaluation (a plateau scheduler steps there) and save decision for N,
  which it takes once per step or twice at an epoch's end.
- The Trainer's saves (``save_strategy``, ``save_steps``, the end of training) are gockpt
  checkpoints of that step, with the Trainer's state (``trainer_state.json``: the step, the
  epoch, logs, stateful callbacks) and each rank's RNG states as ``extra_state``. The Trainer
  writes no ``checkpoint-N`` folder; ``save_total_limit`` is gockpt's ``keep_last``;
  ``trainer.save_model()`` still exports the model in the Trainer's format.
- ``train(resume_from_checkpoint=True)`` (or a gockpt run or checkpoint directory) resumes
  from gockpt's newest checkpoint: the model, optimizer and scheduler by ``gockpt.load``
  (every byte checked), the Trainer's state and data position as the Trainer restores its
  own, the RNG states where the Trainer puts its own back.

Refused (ConfigError when ``train`` starts): DeepSpeed and FSDP (they save and load through
their engines), several GPUs in one process (DataParallel), ``fp16`` however set (GradScaler
skips steps: not yet), ``load_best_model_at_end`` and ``push_to_hub`` (Trainer checkpoint
folders), ``auto_find_batch_size``, ``enable_jit_checkpoint``, hyperparameter searches,
layer-wise optimizers. The optimizer must be one gockpt's mode replays (AdamW, the Trainer's
default, for gockpt-o).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Optional

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

import gockpt
from ..capture.smallstate import capture_rng, restore_rng
from ..core.errors import ConfigError, LoadError
from .saved import extra_state_of

KEY = "hf_trainer"  # (extra_state's section)
STATE_FILE = "trainer_state.json"


class GockptTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints are gockpt's. ``gockpt_dir``: the run
    directory (default: ``args.output_dir``); ``gockpt_options``: the rest of
    :class:`gockpt.Config` (``mode`` default ``"gockpt-o"``, ``overlap_steps``, ``memory``,
    ``remote``, ...). Everything else as ``Trainer``."""

    def __init__(self, *args, gockpt_dir: Optional[str | os.PathLike] = None,
                 gockpt_options: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.gockpt_dir = os.fspath(gockpt_dir if gockpt_dir is not None
                                    else self.args.output_dir)
        self.gockpt_options = {"mode": "gockpt-o", **(gockpt_options or {})}
        self.ck: Optional[gockpt.Checkpointer] = None
        self._pending: Optional[int] = None  # the step whose boundary gockpt is not told yet
        self._asked = False  # the Trainer saves at that step
        self._resume: Optional[str] = None  # the checkpoint a resuming train() loads
        self._rng = None  # this rank's RNG states at that checkpoint
        # first: a step's boundary (its RNG states) before other callbacks act on the next
        self.callback_handler.callbacks.insert(0, _Hooks(self))

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        self._refuse(trial)
        staged = None
        if resume_from_checkpoint not in (None, False):
            where = self.gockpt_dir if resume_from_checkpoint is True else resume_from_checkpoint
            staged = self._stage_resume(where)
        try:
            return super().train(resume_from_checkpoint=staged, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        except BaseException:
            self._close(failing=True)
            raise
        finally:
            self._resume = self._rng = None
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)

    def _refuse(self, trial) -> None:
        args = self.args
        fp16 = args.fp16 or getattr(args, "mixed_precision", None) == "fp16" \
            or getattr(self.accelerator, "scaler", None) is not None
        why = ("DeepSpeed (use gockpt.integrations.deepspeed)" if self.is_deepspeed_enabled
               else "FSDP" if self.is_fsdp_enabled
               else "several GPUs in one process (DataParallel; use torchrun)" if args.n_gpu > 1
               else "fp16 (GradScaler skips steps; bf16 works)" if fp16
               else "load_best_model_at_end (it loads a Trainer checkpoint folder)"
               if args.load_best_model_at_end
               else "push_to_hub (it pushes the Trainer's checkpoint folders)" if args.push_to_hub
               else "auto_find_batch_size (its retries restart training inside train())"
               if args.auto_find_batch_size
               else "enable_jit_checkpoint (it saves in the middle of a step)"
               if getattr(args, "enable_jit_checkpoint", False)
               else "a hyperparameter search (its trials would share one gockpt_dir)"
               if trial is not None or self.hp_search_backend is not None else None)
        if why is not None:
            raise ConfigError(f"GockptTrainer: {why} is not supported")

    def _stage_resume(self, where) -> str:
        """The checkpoint ``where`` names, its Trainer state written where the Trainer reads
        it (a folder of its own, removed when ``train`` returns)."""
        where = os.fspath(where)
        if not os.path.isdir(where) or os.path.isfile(os.path.join(where, STATE_FILE)):
            what = "a Trainer checkpoint folder, which GockptTrainer does not read" \
                if os.path.isdir(where) else "not a directory"
            raise ConfigError(f"GockptTrainer: resume_from_checkpoint={where!r} is {what}: "
                              f"pass True (the newest checkpoint of {self.gockpt_dir}) or a "
                              "gockpt run or checkpoint directory")
        top, extra = extra_state_of(where)
        if not isinstance(extra, dict) or KEY not in extra:
            raise ConfigError(f"{top} holds no Trainer state (not written by GockptTrainer): "
                              "load it with gockpt.load instead")
        staged = tempfile.mkdtemp(prefix="gockpt-hf-")
        with open(os.path.join(staged, STATE_FILE), "w") as f:
            f.write(extra[KEY]["trainer_state"])
        self._resume = top
        return staged

    # The Trainer's loads: gockpt.load puts model, optimizer and scheduler in place at once,
    # once the optimizer exists; the RNG states where the Trainer restores its own.
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._resume is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if self._resume is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        restored = gockpt.load(self._resume, self.model_wrapped, _inner(self.optimizer),
                               scheduler=_inner(self.lr_scheduler), restore_rng=False)
        if restored.step != self.state.global_step:
            raise LoadError(f"{restored.path}: step {restored.step}, but its Trainer state "
                            f"says {self.state.global_step}")
        self._rng = restored.extra_state[KEY]["rng"]

    def _load_scaler(self, checkpoint):
        if self._resume is None:
            return super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint):
        if self._resume is None:
            return super()._load_rng_state(checkpoint)
        restore_rng(self._rng)

    def _save_checkpoint(self, model, trial):
        """The Trainer saves this step: gockpt's checkpoint of it, when its boundary is told."""
        if self.ck is None:
            return super()._save_checkpoint(model, trial)
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self._asked = True

    def _start(self) -> None:
        args, state = self.args, self.state
        if type(_inner(self.optimizer)).__name__ == "LayerWiseDummyOptimizer":
            raise ConfigError("GockptTrainer: a layer-wise optimizer (it updates during the "
                              "backward) is not supported")
        interval = state.save_steps if args.save_strategy == "steps" and state.save_steps > 0 \
            else None
        options = {"interval": interval, "keep_last": args.save_total_limit,
                   **self.gockpt_options}
        self.ck = gockpt.Checkpointer(self.model_wrapped, _inner(self.optimizer),
                                      self.gockpt_dir, scheduler=_inner(self.lr_scheduler),
                                      **options)
        if interval is not None and state.max_steps > state.global_step:
            self.ck.plan_checkpoint(state.max_steps)  # (the Trainer saves at the end)
        self._pending, self._asked = None, False

    def _boundary(self) -> None:
        """Tell gockpt the boundary of the step that ended (a checkpoint if the Trainer saved)."""
        if self.ck is None or self._pending is None:
            return
        step, asked = self._pending, self._asked
        self._pending, self._asked = None, False
        self.ck.save_checkpoint(step, extra_state=self._extra_state, force=asked)

    def _extra_state(self) -> dict:
        """What the Trainer's own checkpoint holds besides model, optimizer and scheduler: its
        state, as ``_save_checkpoint`` updates it (the stateful callbacks' states), as JSON;
        this rank's RNG states."""
        saved = dataclasses.asdict(self.state)
        for cb in self.callback_handler.callbacks + [self.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if isinstance(saved["stateful_callbacks"].get(name), list):
                    saved["stateful_callbacks"][name].append(cb.state())
                else:
                    saved["stateful_callbacks"][name] = cb.state()
        return {KEY: {"trainer_state": json.dumps(saved, indent=2, sort_keys=True) + "\n",
                      "rng": capture_rng()}}

    def _close(self, failing: bool = False) -> None:
        if self.ck is not None:
            ck, self.ck = self.ck, None
            ck.close_at_exit(failing=True) if failing else ck.close()


class _Hooks(TrainerCallback):
    """gockpt's calls at the Trainer's events."""

    def __init__(self, trainer: GockptTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._start()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer._boundary()  # (before the epoch's data loader draws its seed)

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._boundary()
        self.trainer.ck.backward_begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.ck.update_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._pending = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._boundary()
        self.trainer._close()


def _inner(wrapped):
    """The torch optimizer or scheduler Accelerate wraps (gockpt's hooks go on it)."""
    if isinstance(wrapped, AcceleratedOptimizer):
        return wrapped.optimizer
    if isinstance(wrapped, AcceleratedScheduler):
        return wrapped.scheduler
    return wrapped
