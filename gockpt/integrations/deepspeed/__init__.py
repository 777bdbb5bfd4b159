"""DeepSpeed integration: the engine's own ``save_checkpoint``/``load_checkpoint`` go through
gockpt, and its ``forward``/``backward``/``step`` carry the hooks. Two lines::

    from gockpt.integrations import deepspeed as gockpt_ds
    gockpt_ds.install()          # before deepspeed.initialize(); or gockpt_ds.patch(engine)

    engine.save_checkpoint(save_dir, client_state={"data_pos": pos})   # returns at once
    load_path, client_state = engine.load_checkpoint(save_dir)        # unchanged call

A checkpoint holds the engine's training state at one step, bitwise: the base optimizer's
fp32 master weights (this rank's ZeRO partition) and moments, its step, the module's weights
and buffers, the LR scheduler, the engine's counters (``global_steps``, ``global_samples``,
``skipped_steps``, ``micro_steps``), the loss scaler, RNG states and ``client_state`` (a dict
taken at the call, or a callable called at the checkpoint's step; tensors, numbers, strings,
lists and dicts -- never pickled).  It also records the engine's DeepSpeed config as DeepSpeed
stores it with its own checkpoints (``ds_config``; what cannot be stored without pickle is
left out with a warning, never failing the save), which a load does not put back: it is for
``gockpt export --to deepspeed``.  Every rank writes its own part; the checkpoint commits
(and ``latest`` names it) when every part is durable.  Data-parallel ranks write what they
hold alike once, in shares (:func:`.state.parallel_options`): ZeRO 0 all of it, ZeRO 1/2 the
module's weights, each rank its fp32 partition as its slice of the flat group.

Options (keyword arguments of :func:`patch`/:func:`install`, or a ``"gockpt": {...}`` section of
the DeepSpeed config; arguments win) are :class:`gockpt.Config` fields: ``mode`` (default
``"async-o"``), ``block_bytes``, ``keep_last``, ``on_busy``, ``max_host_bytes``, ...; the
directory is the ``save_dir`` of each call.  Give ``directory`` (the ``save_dir`` your saves
will name) with ``interval`` (their spacing) to have the Checkpointer made with the engine, at
its first ``forward``: the first checkpoint is then copied ahead like every other one (without
it the Checkpointer is made at the first save, which is copied under the next step at once); a
save to another ``save_dir`` moves to a Checkpointer there.  Modes ``sync``, ``async`` and ``async-o`` copy
the state; the replay modes (``gockpt``, ``gockpt-o``: the state copied over K steps, the fp32
gradients of the steps between replayed on the CPU) need a bitwise replay of the base
optimizer: DeepSpeed's ``FusedAdam`` on the CPU (its CPU Adam op), on CUDA its moments (built
with fast math, its parameter line is not reproduced: the parameters are copied at F; Adam mode
with weight decay refused), or torch's Adam/AdamW; anything else is refused, or with
``fallback=True`` replaced by ``async-o`` with one warning.  ZeRO stage 3 is refused.
With ZeRO 1/2 in bf16 on a GPU (or an emulated link) the replayed gradients cross as bf16
plus the one coefficient DeepSpeed unscaled/clipped them by (``grad_transport="bf16"``, checked
exact on the device every step; ``grad_transport="fp32"`` turns it off, ``"bf16"`` turns it on
elsewhere); otherwise in fp32.  With the memory tier (``memory=...``, ``memory_dir``),
``load_checkpoint(save_dir)`` without a tag takes its copy of the newest checkpoint as
``gockpt.load`` does (checked the same way; a damaged copy falls back to the disk's).
"""

from __future__ import annotations

import functools
import warnings
import weakref

from ...core.config import Config, GradTransport
from ...exit import first_at_exit
from ...core.errors import ConfigError, UnsupportedOptimizerError
from ...core.modes import POLICIES
from ...replay.adapters import adapter_for
from .patch import EnginePatch, holds_gockpt_checkpoint, zero_bf16
from .state import base_optimizer

DEFAULT_MODE = "async-o"

_installed = {}                      # method name -> the original, while install() is active
# engine -> its EnginePatch, kept beside the engine rather than on it (an attribute of
# ours on DeepSpeed's object could collide with its own names); weak: a dropped engine
# takes its patch along.  wait() at exit walks it.
_patches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def patch(engine, **options) -> None:
    """Route this engine's checkpoints through gockpt (see the module docstring for options).

    Raises :class:`gockpt.ConfigError` for a configuration gockpt cannot checkpoint exactly."""
    if engine in _patches:
        return
    _patches[engine] = EnginePatch(engine, _options(engine, options))
    _wait_at_exit()
    if not _installed:  # per engine: wrap the bound methods of this instance only
        for name, wrapper in _WRAPPERS.items():
            setattr(engine, name, functools.partial(wrapper, getattr(engine, name), engine))


def install(**options) -> None:
    """Patch ``deepspeed.DeepSpeedEngine`` itself: every engine built afterwards (and before,
    at its next call) checkpoints through gockpt with ``options``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    global _install_options
    _install_options = options
    _wait_at_exit()
    if _installed:
        return
    for name, wrapper in _WRAPPERS.items():
        original = getattr(DeepSpeedEngine, name)
        _installed[name] = original

        def method(self, *args, _w=wrapper, _o=original, **kwargs):
            if self not in _patches:
                patch(self, **_install_options)
            return _w(functools.partial(_o, self), self, *args, **kwargs)
        functools.update_wrapper(method, original)
        setattr(DeepSpeedEngine, name, method)


def uninstall() -> None:
    """Undo :func:`install` (engines already patched keep their state until :func:`wait`)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name, original in _installed.items():
        setattr(DeepSpeedEngine, name, original)
    _installed.clear()


def wait(engine=None) -> None:
    """Block until every checkpoint ``engine`` (default: every patched engine) started is
    durable, and re-raise a background error.  Runs at interpreter exit too."""
    for e in [engine] if engine is not None else list(_patches.keys()):
        p = _patches.get(e)
        if p is not None:
            p.close()


_install_options: dict = {}


def _options(engine, options: dict) -> dict:
    """Options from the config's ``gockpt`` section and the arguments, checked now."""
    section = dict(getattr(getattr(engine, "_config", None), "_param_dict", {}).get("gockpt", {}))
    merged = {**section, **options}
    fallback = bool(merged.pop("fallback", False))
    merged.setdefault("mode", DEFAULT_MODE)
    if engine.zero_optimization_stage() == 3:
        raise ConfigError("gockpt_ds: ZeRO stage 3 is not supported (parameters partitioned "
                          "across ranks); use stage 0, 1 or 2, or DeepSpeed's own checkpoints")
    if merged.get("memory_log") is not None and \
            not hasattr(engine.optimizer, "update_lp_params"):
        # (the log's replay runs the base optimizer, then the engine's own update of the
        # module's weights from the fp32 masters: update_lp_params)
        raise ConfigError(f"gockpt_ds: memory_log needs ZeRO 1/2 or bf16 (the engine's "
                          f"optimizer {type(engine.optimizer).__name__} has no update of the "
                          "module's weights a replay can call); memory= alone works")
    replays = merged["mode"] in POLICIES and POLICIES[merged["mode"]].replays
    why = _replay_refusal(engine) if replays else None
    if why is None and replays and zero_bf16(engine) and (
            _on_gpu(engine) or merged.get("emulate_link_gbps")):
        # 2 bytes per element across a link; on the CPU the copy is a memcpy on the copy
        # thread and the encoding would cost the training thread more than it saves
        merged.setdefault("grad_transport", GradTransport.BF16)
    if why is not None:
        why = f"gockpt_ds: mode {merged['mode']!r} cannot replay this engine's optimizer: {why}"
        if not fallback:
            raise ConfigError(f"{why}. Use mode='async-o' (the default), 'async' or 'sync', or "
                              "pass fallback=True to get async-o with a warning")
        warnings.warn(f"{why}; using async-o", stacklevel=3)
        merged["mode"] = DEFAULT_MODE
    Config(**{"directory": ".", **merged})  # every option checked here, not at the first save
    return merged


def _on_gpu(engine) -> bool:
    return any(p.is_cuda for g in base_optimizer(engine).param_groups for p in g["params"])


def _replay_refusal(engine):
    """Why the base optimizer has no bitwise replay (None: it has one)."""
    try:
        adapter_for(base_optimizer(engine)).close()
    except UnsupportedOptimizerError as exc:
        return str(exc)
    except (AttributeError, TypeError) as exc:
        return f"the engine has no optimizer gockpt can use ({exc})"
    return None


# ---------------------------------------------------------------------- the wrapped methods
# Each gets the original bound method first, then the engine, then the caller's arguments.

def _forward(original, engine, *args, **kwargs):
    _patches[engine].before_forward()
    return original(*args, **kwargs)


def _backward(original, engine, *args, **kwargs):
    _patches[engine].before_backward()
    return original(*args, **kwargs)


def _step(original, engine, *args, **kwargs):
    real = _patches[engine].before_step()
    out = original(*args, **kwargs)
    _patches[engine].after_step(real)
    return out


def _save_checkpoint(original, engine, save_dir, tag=None, client_state={}, save_latest=True,
                     exclude_frozen_parameters=False):
    if exclude_frozen_parameters:
        raise ConfigError("gockpt_ds: exclude_frozen_parameters is not supported (gockpt "
                          "checkpoints hold every parameter)")
    return _patches[engine].save(save_dir, tag, client_state, save_latest)


def _load_checkpoint(original, engine, load_dir, tag=None, load_module_strict=True,
                     load_optimizer_states=True, load_lr_scheduler_states=True,
                     load_module_only=False, custom_load_fn=None):
    if not holds_gockpt_checkpoint(load_dir, tag):  # a native checkpoint: DeepSpeed's own
        _patches[engine].close()
        return original(load_dir, tag=tag, load_module_strict=load_module_strict,
                        load_optimizer_states=load_optimizer_states,
                        load_lr_scheduler_states=load_lr_scheduler_states,
                        load_module_only=load_module_only, custom_load_fn=custom_load_fn)
    if custom_load_fn is not None or not load_module_strict:
        raise ConfigError("gockpt_ds: custom_load_fn and load_module_strict=False are not "
                          "supported for gockpt checkpoints")
    return _patches[engine].load(load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                               load_module_only)


_WRAPPERS = {"forward": _forward, "backward": _backward, "step": _step,
             "save_checkpoint": _save_checkpoint, "load_checkpoint": _load_checkpoint}


def _wait_at_exit() -> None:
    """Make the end of the process wait for the patched engines' checkpoints (registered once,
    by the first install() or patch(): importing the integration changes nothing), before
    gockpt's own exit hook closes what is left (``gockpt.exit``)."""
    first_at_exit(_close_at_exit)


def _close_at_exit(failing: bool) -> None:
    for p in list(_patches.values()):
        p.close(failing)
