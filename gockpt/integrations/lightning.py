"""gockpt in PyTorch Lightning's own loop: one callback.

    from gockpt.integrations.lightning import GockptCallback
    trainer = Trainer(callbacks=[GockptCallback("checkpoints/run1", every_n_train_steps=100)])
    trainer.fit(model)                                     # gockpt-o checkpoints every 100 steps
    trainer.fit(model, ckpt_path="checkpoints/run1")       # resumes from the newest, bit for bit

What it does to Lightning's loop (``setup``, for ``fit``):

- Lightning runs the training step, the backward and the gradient clipping inside
  ``optimizer.step(closure)`` for most precisions (32-true, bf16-mixed), after torch's step
  pre-hooks, where gockpt records the gradients the update consumes. The callback gives the
  trainer's precision plugin an ``optimizer_step`` that runs the closure (and Lightning's
  ``on_before_optimizer_step`` hooks and clipping after it) first, then
  ``Checkpointer.update_begin``, then the step: the replay sees the gradients the update
  consumes, clipped and accumulated.
- The fit's last step (``trainer.estimated_stepping_batches``) is a checkpoint, announced
  when training starts (copied over the steps before it).
- ``backward_begin`` before the first backward of each optimizer step (``on_before_backward``,
  once per accumulation window), ``save_checkpoint(global_step)`` after each optimizer step
  (``on_train_batch_end``), with Lightning's own state at F as ``extra_state``: its loops
  (epoch and batch progress), callbacks' states and the rest of what ``trainer.save_checkpoint``
  writes -- but the model, optimizer and scheduler, which gockpt's checkpoint holds itself.
- The trainer's ``CheckpointIO`` reads a gockpt run or checkpoint directory given as
  ``ckpt_path``: Lightning restores its loops and callbacks from it; the model, optimizer,
  scheduler and RNG states are restored by ``gockpt.load`` (every byte checked) in
  ``on_fit_start``, before Lightning's own restore of the optimizer, which then keeps them.

- ``trainer.save_checkpoint`` (what ``ModelCheckpoint`` calls: every N steps or epochs, the
  best by a metric, the last) takes a gockpt checkpoint of that step. Each step's boundary is
  taken at the next batch's or epoch's start (or the end of ``fit``), once every callback
  has said whether it saves the step; Lightning's state is the one it dumped for the save
  (taken at the step's end when gockpt's own interval checkpoints it). Once the checkpoint is
  durable, the file ``ModelCheckpoint`` named holds a pointer to it (rank 0; a small JSON
  file): ``ckpt_path="last"`` / ``"best"`` / that file resume from the gockpt checkpoint.

Under FSDP2 (``ModelParallelStrategy``, data parallel) each rank checkpoints its shards;
the strategy reads checkpoints itself after ``on_fit_start``, so its ``load_checkpoint``
restores a gockpt checkpoint there.

Refused (ConfigError when ``fit`` starts): manual optimization, a strategy other than one
device, DDP or FSDP2 through ModelParallelStrategy without tensor parallelism, more
than one optimizer or scheduler, an optimizer that needs a closure (LBFGS), a precision other
than 32-true and bf16-mixed (16-mixed's GradScaler skips steps: not yet;
the "-true" half and double precisions train other than fp32 weights, which the replay needs).
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Optional

import torch

try:  # the unified package first, as Lightning's docs have it
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # pragma: no cover - whichever is installed
    import pytorch_lightning as pl
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

import gockpt
from ..core.errors import ConfigError
from ..storage import tree
from .lightning_files import Pointers, pointed
from .saved import extra_state_of

PRECISIONS = ("32-true", "bf16-mixed")
_OWN = ("state_dict", "optimizer_states", "lr_schedulers", "hyper_parameters", "hparams_name",
        "hparams_type", "datamodule_hyper_parameters", "datamodule_hparams_type")  # (what gockpt holds itself, or is the user's code)


class GockptCallback(pl.Callback):
    """gockpt's checkpoints of a Lightning ``fit``: ``directory`` (a run directory), one every
    ``every_n_train_steps`` optimizer steps (None: none of its own) and one at each
    ``trainer.save_checkpoint`` (``ModelCheckpoint``'s saves); ``options``: the rest of
    :class:`gockpt.Config` (``mode`` default ``"gockpt-o"``, ``overlap_steps``, ``keep_last``,
    ``memory``, ``remote``, ...)."""

    def __init__(self, directory: str | os.PathLike, every_n_train_steps: Optional[int] = None,
                 **options):
        super().__init__()
        if every_n_train_steps is not None and (type(every_n_train_steps) is not int
                                                or every_n_train_steps < 1):
            raise ConfigError(f"every_n_train_steps must be None or an int >= 1, got "
                              f"{every_n_train_steps!r}")
        self.directory, self.every = os.fspath(directory), every_n_train_steps
        self.options = {"mode": "gockpt-o", **options}
        self.ck: Optional[gockpt.Checkpointer] = None
        self._in_step = False  # backward_begin called, the step's save not yet
        self._stepped_at: Optional[int] = None  # global_step at the last boundary
        self._pending: Optional[list] = None  # [step, Lightning's state, files asked] not yet
        self._pointers: Optional[Pointers] = None  # ModelCheckpoint's files, once durable
        self._resume: Optional[str] = None  # the checkpoint ckpt_path named (CheckpointIO)
        self._trainer = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer
        if trainer.callbacks[0] is not self and self in trainer.callbacks:
            # its hooks first: a step's boundary taken before another callback's next hook
            # changes anything (moved to the front, the others' order kept; the hook being
            # called goes on with the one after this callback, as it would have)
            trainer.callbacks.remove(self)
            trainer.callbacks.insert(0, self)
        io = trainer.strategy.checkpoint_io  # (validate / test / predict read pointers too)
        trainer.strategy.checkpoint_io = _GockptIO(self, io.inner if isinstance(io, _GockptIO)
                                                   else io)
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ConfigError("GockptCallback: manual optimization is not supported (gockpt's "
                              "hooks need Lightning's optimizer step)")
        if str(trainer.precision) not in PRECISIONS:
            raise ConfigError(f"GockptCallback: precision {trainer.precision!r} is not "
                              f"supported; use one of {', '.join(PRECISIONS)}")
        strategy = type(trainer.strategy).__name__
        if strategy not in ("SingleDeviceStrategy", "DDPStrategy", "ModelParallelStrategy") or \
                getattr(trainer.strategy, "_tensor_parallel_size", 1) not in (1, "auto"):
            raise ConfigError(f"GockptCallback: strategy {strategy} is not supported; one "
                              "device, DDP, or FSDP2 (ModelParallelStrategy, data parallel)")
        if strategy == "ModelParallelStrategy" and "load_checkpoint" not in vars(trainer.strategy):
            trainer.strategy.load_checkpoint = types.MethodType(
                _load_through(self, trainer.strategy.load_checkpoint), trainer.strategy)
        plugin = trainer.strategy.precision_plugin
        plugin.optimizer_step = types.MethodType(_closure_first(self), plugin)
        if "save_checkpoint" not in vars(trainer):  # (every rank calls it, every caller)
            trainer.save_checkpoint = types.MethodType(_save_through(self, trainer.save_checkpoint),
                                                       trainer)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._resume is not None:
            self._restore(trainer, trainer._checkpoint_connector._loaded_checkpoint)

    def _restore(self, trainer, loaded: dict) -> None:
        """gockpt.load of the checkpoint ``ckpt_path`` named, into the fit's model, optimizer
        and scheduler; ``loaded``: what Lightning restores next, from what ckpt_path gave it
        (made the states gockpt.load just put in place)."""
        top, self._resume = self._resume, None
        optimizer, scheduler = _optimizer_of(trainer), _scheduler_of(trainer)
        gockpt.load(top, trainer.lightning_module, optimizer, scheduler=scheduler)
        loaded["optimizer_states"] = [optimizer.state_dict()]
        loaded["lr_schedulers"] = [scheduler.state_dict()] if scheduler is not None else []

    def on_train_start(self, trainer, pl_module) -> None:
        # the LightningModule itself (its names, whatever wraps it: a checkpoint loads on any
        # number of devices), its replicas declared as such on several (DDP)
        ddp = trainer.world_size > 1 and type(trainer.strategy).__name__ == "DDPStrategy"
        options = {"replicated": True, **self.options} if ddp else self.options
        self._in_step = False  # (a fit that raised before left it set)
        if isinstance(_optimizer_of(trainer), torch.optim.LBFGS):
            raise ConfigError("GockptCallback: LBFGS needs its closure inside the step; gockpt "
                              "records the gradients before it")
        try:  # Lightning's state and what hooks add to it, storable without pickle: now
            tree.encode(_loop_state(trainer), {}, "extra_state")
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"GockptCallback: Lightning's checkpoint state cannot be stored "
                              f"without pickle: {exc}") from exc
        self.ck = gockpt.Checkpointer(pl_module, _optimizer_of(trainer), self.directory,
                                      scheduler=_scheduler_of(trainer),
                                      interval=self.every or _asked_every(trainer), **options)
        self._stepped_at, self._pending = trainer.global_step, None
        self._pointers = Pointers(trainer.is_global_zero)
        last = trainer.estimated_stepping_batches  # (max_steps, or the epochs' steps)
        if isinstance(last, int) and last > trainer.global_step:
            self.ck.plan_checkpoint(last)  # the trained model, copied over its last steps

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._begin_step()

    def _begin_step(self) -> None:
        """backward_begin, once per optimizer step (its first backward, or its update when
        ``training_step`` returned None and no backward ran)."""
        if self.ck is not None and not self._in_step:
            self.ck.backward_begin()
            self._in_step = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.ck is None or trainer.global_step == self._stepped_at:
            return  # (accumulating: no optimizer step in this batch)
        step = self._stepped_at = trainer.global_step
        self._in_step = False
        # The boundary waits for the saves of this step (ModelCheckpoint's come after this
        # hook, some at the validation's end, and its state in a checkpoint is the one after
        # its last save): taken at the next batch's or epoch's start. Lightning's state is
        # taken now where gockpt's own interval checkpoints the step (the next batch's start
        # finds its loops a batch further on)
        self._pending = [step, _loop_state(trainer) if self.ck.schedule.due(step) else None,
                         []]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._boundary()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._boundary()  # (before the epoch's data loader draws from the RNG)

    def _boundary(self) -> None:
        """The step boundary taken last: a gockpt checkpoint of it where one was asked for
        (its files written once it is durable) or gockpt's interval says so."""
        if self.ck is None or self._pending is None:
            return
        (step, state, files), self._pending = self._pending, None
        handle = self.ck.save_checkpoint(step, extra_state=state, force=bool(files))
        if files and handle is None:
            warnings.warn(f"gockpt: the checkpoint of step {step} did not start (the previous "
                          f"one is still busy): {', '.join(files)} not written", RuntimeWarning)
        elif files:
            self._pointers.add(handle, files)

    def _asked(self, filepath) -> bool:
        """``trainer.save_checkpoint(filepath)`` (every rank): a gockpt checkpoint of the step
        just taken, ``filepath`` pointing to it once it is durable; False when there is no
        such step (no fit, or mid-step) or the save is Lightning's SLURM requeue
        (``hpc_ckpt_*``, which must be on disk before the job is requeued): Lightning's own
        save then."""
        trainer = self._trainer
        if self.ck is None or self._pending is None or \
                self._pending[0] != trainer.global_step or \
                os.path.basename(os.fspath(filepath)).startswith("hpc_ckpt"):
            return False
        self._pending[1] = _loop_state(trainer)  # (the newest: callbacks' states after theirs)
        self._pending[2].append(os.fspath(filepath))
        return True

    def wait(self) -> None:
        """Block until the checkpoints in flight are durable and the files
        ``ModelCheckpoint`` asked for are written."""
        if self.ck is not None:
            self.ck.wait()
        if self._pointers is not None:
            self._pointers.flush()

    def on_train_end(self, trainer, pl_module) -> None:
        self._resume = None
        self._boundary()  # (the last step's)
        self.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._in_step, self._resume, self._pending = False, None, None
        if self.ck is not None:
            ck, self.ck = self.ck, None
            ck.close_at_exit(failing=True)
        if self._pointers is not None:  # (what is durable still gets its files)
            self._pointers.close(wait=False)

    def close(self) -> None:
        """Finish the checkpoints in flight (durable), write the files ``ModelCheckpoint``
        asked for, and stop gockpt's threads."""
        if self.ck is not None:
            ck, self.ck = self.ck, None
            ck.close()
        if self._pointers is not None:
            self._pointers.close()


def _optimizer_of(trainer) -> torch.optim.Optimizer:
    if len(trainer.optimizers) != 1:
        raise ConfigError(f"GockptCallback: {len(trainer.optimizers)} optimizers; gockpt "
                          "checkpoints a loop with one")
    return trainer.optimizers[0]


def _scheduler_of(trainer):
    configs = trainer.lr_scheduler_configs
    if len(configs) > 1:
        raise ConfigError("GockptCallback: more than one LR scheduler is not supported")
    return configs[0].scheduler if configs else None


def _asked_every(trainer) -> Optional[int]:
    """The interval at which ``ModelCheckpoint`` saves (``every_n_train_steps``, when every one
    that saves by steps says the same): gockpt then copies each checkpoint ahead of its step."""
    every = {c._every_n_train_steps for c in trainer.checkpoint_callbacks
             if getattr(c, "_every_n_train_steps", 0)}
    return every.pop() if len(every) == 1 else None


def _save_through(callback: GockptCallback, lightning_save):
    """``trainer.save_checkpoint``: gockpt's checkpoint of the step just taken (during ``fit``,
    between steps), else Lightning's own save."""
    def save_checkpoint(trainer, filepath, weights_only=None, storage_options=None):
        if not callback._asked(filepath):
            lightning_save(filepath, weights_only, storage_options)
    return save_checkpoint


def _closure_first(callback: GockptCallback):
    """The precision plugin's ``optimizer_step``: the closure (training step, backward),
    Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, then gockpt's
    ``update_begin``, then the step itself."""
    def optimizer_step(plugin, optimizer, model, closure, **kwargs):
        closure_result = closure()
        plugin._after_closure(model, optimizer)
        callback._begin_step()
        if callback.ck is not None:
            callback.ck.update_begin()
        optimizer.step(**kwargs)
        return closure_result
    return optimizer_step


def _load_through(callback: GockptCallback, strategy_load):
    """ModelParallelStrategy's ``load_checkpoint`` (it reads checkpoints itself, after its
    setup and ``on_fit_start``): a gockpt checkpoint restored there, anything else its own."""
    def load_checkpoint(strategy, checkpoint_path, weights_only=None):
        io = strategy.checkpoint_io
        path = None if not isinstance(io, _GockptIO) else io.gockpt_path(checkpoint_path)
        if path is None or os.path.isfile(os.path.join(path, "meta.pt")):
            # (not gockpt's; "meta.pt": the strategy's own distributed checkpoint, a folder)
            return strategy_load(checkpoint_path, weights_only)
        loaded = io.load_checkpoint(path, weights_only=weights_only)
        if callback._resume is not None:
            callback._restore(callback._trainer, loaded)
        return loaded
    return load_checkpoint


def _loop_state(trainer) -> dict:
    """Lightning's own state at F (what ``trainer.save_checkpoint`` writes), less what gockpt's
    checkpoint holds itself (under FSDP2 not even gathered: ModelParallelStrategy's state dicts
    are the whole model's, on every checkpoint)."""
    strategy = trainer.strategy
    skip = type(strategy).__name__ == "ModelParallelStrategy"
    if skip:
        strategy.lightning_module_state_dict = lambda: {}
        strategy.optimizer_state = lambda optimizer: {}
    try:
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    finally:
        if skip:
            del strategy.lightning_module_state_dict, strategy.optimizer_state
    return {k: v for k, v in state.items() if k not in _OWN}


class _GockptIO(CheckpointIO):
    """The trainer's CheckpointIO: a gockpt run or checkpoint directory given as ``ckpt_path``
    gives Lightning its own state at F (the model's, optimizer's and scheduler's are put in
    place by ``gockpt.load`` in ``on_fit_start``); anything else goes to Lightning's own."""

    def __init__(self, callback: GockptCallback, inner: CheckpointIO):
        self.callback, self.inner = callback, inner

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def remove_checkpoint(self, path) -> None:
        if self.callback._pointers is not None:  # (not written once its checkpoint is durable)
            self.callback._pointers.removed(path)
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()

    @staticmethod
    def gockpt_path(path) -> Optional[str]:
        """The gockpt run or checkpoint directory ``path`` names (itself, or a file
        ``ModelCheckpoint`` named pointing to one); None for anything else."""
        path = os.fspath(path)
        if os.path.isfile(path):
            path = pointed(path) or path  # (a file ModelCheckpoint named: its checkpoint)
        return path if os.path.isdir(path) else None

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        ours = self.gockpt_path(path)
        if ours is None:
            return self.inner.load_checkpoint(path, map_location=map_location,
                                              weights_only=weights_only)
        top, rest = extra_state_of(ours)
        if not isinstance(rest, dict) or "loops" not in rest:
            raise ConfigError(f"{top} holds no Lightning loop state (not written by "
                              "GockptCallback): load it with gockpt.load instead")
        module = self.callback._trainer.lightning_module
        if self.callback._trainer.state.fn != "fit":  # validate / test / predict: the weights
            gockpt.load(top, module, restore_rng=False)
            return {**rest, "state_dict": module.state_dict()}
        self.callback._resume = top
        # the model's own state: Lightning loads it into the model before gockpt.load runs
        return {**rest, "state_dict": module.state_dict(),
                "optimizer_states": [], "lr_schedulers": []}
