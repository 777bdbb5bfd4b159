"""What of a DeepSpeed engine a checkpoint holds, and putting it back.

The tensors: the base optimizer's fp32 master partitions (this rank's part under ZeRO) and the
module's weights and buffers, gathered in one :class:`EngineState` module so that the ordinary
Checkpointer plans, copies and verifies them; the base optimizer's moments and step come with
it.  The rest -- engine counters, loss-scaler settings, ``client_state`` -- is small state taken
at version F (:func:`engine_record`) and put back by :func:`restore_engine`.  The record also
holds the engine's DeepSpeed config (:func:`ds_config_record`), which nothing puts back: it is
for ``gockpt export --to deepspeed``, which stores it as DeepSpeed does (``ds_config``) and
takes the ZeRO stage, precision and gradient clipping from it.
"""

from __future__ import annotations

import collections
import logging
import numbers
import weakref

import torch

from ...core.errors import LoadError
from ...storage import tree
from .adapter import run_cpu_adam_op

log = logging.getLogger("gockpt")

COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
# Where the optimizer wrappers keep their loss scaling (ZeRO 1/2 and BF16_Optimizer:
# loss_scaler; FP16_Optimizer: loss_scale_config).
SCALERS = ("loss_scaler", "loss_scale_config")


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The optimizer that owns the fp32 master weights (DeepSpeed's wrapper holds it)."""
    wrapper = engine.optimizer
    base = getattr(wrapper, "optimizer", wrapper)
    if not isinstance(base, torch.optim.Optimizer):
        raise TypeError(f"the engine's optimizer {type(wrapper).__name__} wraps no "
                        "torch.optim.Optimizer")
    return base


class EngineState(torch.nn.Module):
    """The engine's training tensors as one module: ``master_g{group}_p{index}`` are the base
    optimizer's parameters (fp32 master, this rank's partition), ``module.*`` the model.

    For the step log's replay (:func:`gockpt.steplog.replay`), what the engine's step does
    beyond its base optimizer's: :meth:`before_replay`, :meth:`after_replayed_step`; and each
    rank logs its own partition (``ranks_hold_their_own``)."""

    ranks_hold_their_own = True

    def __init__(self, engine):
        super().__init__()
        for gi, group in enumerate(base_optimizer(engine).param_groups):
            for pi, p in enumerate(group["params"]):
                # The very tensor objects the optimizer updates (not nn.Parameter copies): the
                # Checkpointer maps optimizer state to names through them.
                self._parameters[f"master_g{gi}_p{pi}"] = p
        self.module = engine.module
        self._engine = weakref.ref(engine)  # (weak: the patch's registry lets engines go)

    def before_replay(self) -> None:
        """The base optimizer's state was just loaded: DeepSpeed's links to it, and its CPU
        Adam's running products at the loaded step, before the logged steps run."""
        engine = self._engine()
        relink(engine)
        warm_cpu_adam(base_optimizer(engine))

    def after_replayed_step(self) -> None:
        """After a logged step's update: the module's weights from the fp32 masters, gathered
        from every rank's partition, as the engine's step does (a collective)."""
        self._engine().optimizer.update_lp_params()


def step_written(engine, state: EngineState) -> list:
    """The module's parameters the base optimizer does not update (``Config.step_written``):
    DeepSpeed's step writes the trained ones from their fp32 masters, nothing writes the
    frozen ones -- no forward or backward does (ZeRO 0-2) -- so their copies ride with the
    last capture group under the next forward/backward instead of blocking the save."""
    updated = {id(p) for group in base_optimizer(engine).param_groups for p in group["params"]}
    return [n for n, p in state.named_parameters() if n.startswith("module.")
            and id(p) not in updated]


def parallel_options(engine, state: EngineState) -> dict:
    """What the ranks hold alike (``Config.replicated``) and where each rank's fp32 partition
    lies (``Config.global_slices``) when every rank is a data-parallel replica: ZeRO 0 holds
    everything on every rank (split into shares); ZeRO 1/2 hold the module's weights on every
    rank (shares) and one partition of each flat fp32 group per rank -- rank r's is the 1-D
    slice at r x its size of a group of world x size elements (DeepSpeed pads the groups so).
    ``{}`` (each rank its own state, as written before) on one rank, or where the data-parallel
    group is not the whole world (pipeline or tensor parallelism)."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world < 2 or getattr(engine, "dp_world_size", None) != world:
        return {}
    if engine.zero_optimization_stage() == 0:
        return {"replicated": True}
    rank = dist.get_rank()
    masters = {n: p for n, p in state.named_parameters(remove_duplicate=False)
               if n.startswith("master_")}
    return {"replicated": [n for n, _ in state.named_parameters() if n.startswith("module.")],
            "global_slices": {n: ((world * p.numel(),), (rank * p.numel(),))
                              for n, p in masters.items()}}


def fp32_layout(engine) -> dict:
    """Where each module parameter's fp32 master lives on this rank:
    ``{name: [group, start in master_g{group}_p0, start in the parameter, numel, shape]}``
    (one fragment per rank under ZeRO; what ``gockpt export --to fp32`` reassembles)."""
    wrapper, names = engine.optimizer, {id(p): n for n, p in engine.module.named_parameters()}
    out = {}
    groups = partitioned_groups(engine)
    if groups is not None:  # ZeRO 1/2, BF16_Optimizer: DeepSpeed's own fragment mapping
        for gi, group in enumerate(groups):
            for p in group:
                hp = getattr(p, "_hp_mapping", None)
                if hp is not None:
                    out[names[id(p)]] = [gi, hp.hp_fragment_address.start,
                                         hp.lp_fragment_address.start,
                                         hp.hp_fragment_address.numel, list(p.shape)]
        return out
    for gi, group in enumerate(getattr(wrapper, "fp16_groups", [])):  # stage 0: flat, in order
        offset = 0
        for p in group:
            out[names[id(p)]] = [gi, offset, 0, p.numel(), list(p.shape)]
            offset += p.numel()
    return out


def partitioned_groups(engine):
    """The module's parameters in the flat groups whose fp32 masters the ranks partition
    (ZeRO 1/2's ``bit16_groups``, BF16_Optimizer's ``bf16_groups``), as lists of parameters
    per group of the base optimizer; None for an optimizer that keeps whole masters."""
    wrapper = engine.optimizer
    return getattr(wrapper, "bit16_groups", None) or getattr(wrapper, "bf16_groups", None)


def engine_record(engine, client_state, layout: dict) -> dict:
    """The engine's small per-step state at version F (called at F's boundary).
    ``ds_config``/``ds_config_dropped``: see :func:`ds_config_record` (taken at each save, as
    DeepSpeed stores its config with each checkpoint)."""
    wrapper = engine.optimizer
    config, dropped = ds_config_record(engine)
    return {
        "fp32_layout": layout,
        "counters": {name: int(getattr(engine, name)) for name in COUNTERS},
        "scalers": {name: _numbers_of(getattr(wrapper, name)) for name in SCALERS
                    if getattr(wrapper, name, None) is not None},
        "client_state": client_state() if callable(client_state) else client_state,
        "ds_config": config,
        "ds_config_dropped": dropped,
    }


_DROP = object()                     # a value ds_config_record leaves out
_warned: dict = {}  # id -> weak reference: engines whose config was recorded with a loss


def ds_config_record(engine) -> tuple:
    """``(config, dropped)``: the engine's DeepSpeed config as DeepSpeed stores it in its own
    checkpoint (``ds_config``: ``engine.config``, the dict given to ``deepspeed.initialize``;
    its parsed ``_param_dict`` where an older DeepSpeed kept a file name there), as a copy that
    :func:`gockpt.storage.tree.encode` stores (plain data, tuples, bytes, tensors -- never
    pickle).  Whatever it cannot store (an object of another type, a dict key it cannot write,
    a structure containing itself) is left out: a dict entry goes, a list or tuple holding such
    an item goes whole.  ``dropped`` names each: ``{"path": [key, ...], "type": type name}``
    (``path`` ``[]``: no config could be taken, ``config`` is None).  Logged once per engine;
    never raises (a failing record would fail the save and stop training)."""
    try:
        config = getattr(engine, "config", None)
        if not isinstance(config, dict):
            config = getattr(getattr(engine, "_config", None), "_param_dict", None)
        dropped: list = []
        if not isinstance(config, dict):
            config, dropped = None, [{"path": [], "type": type(config).__name__}]
        else:
            config = _storable(config, [], dropped, set())
            _trial_encode(config)  # the walk left only what encodes; checked by the encoder
    except Exception as exc:  # noqa: BLE001 -- never fail the save for the config
        config, dropped = None, [{"path": [], "type": f"{type(exc).__name__}: {exc}"[:200]}]
    if dropped:
        try:
            _warn_dropped(engine, dropped)
        except Exception:  # noqa: BLE001 -- (logging itself failed)
            pass
    return config, dropped


def _storable(value, path: list, dropped: list, active: set):
    """``value`` with what tree.encode refuses left out (``_DROP``: the whole value)."""
    if isinstance(value, dict):
        if id(value) in active:
            dropped.append({"path": path, "type": "the dict containing it (a cycle)"})
            return _DROP
        active.add(id(value))
        try:
            out = collections.OrderedDict() if type(value) is collections.OrderedDict \
                else {}  # (a dict subclass: its items, as a dict)
            for key, item in value.items():
                where = path + [_path_key(key)]
                if not _encodes({key: None}):
                    dropped.append({"path": where, "type": f"dict key {type(key).__name__}"})
                    continue
                item = _storable(item, where, dropped, active)
                if item is not _DROP:
                    out[key] = item
            return out
        finally:
            active.discard(id(value))
    if isinstance(value, (list, tuple)):
        if id(value) in active:
            dropped.append({"path": path, "type": "the list containing it (a cycle)"})
            return _DROP
        active.add(id(value))
        try:
            inner: list = []
            items = [_storable(item, path + [i], inner, active) for i, item in enumerate(value)]
        finally:
            active.discard(id(value))
        if inner:  # a position cannot be left out: the sequence goes whole
            what = ", ".join(sorted({d["type"] for d in inner}))
            dropped.append({"path": path, "type": f"{type(value).__name__} holding {what}"})
            return _DROP
        return items if isinstance(value, list) else tuple(items)
    if _encodes(value):
        return value
    dropped.append({"path": path, "type": type(value).__qualname__})
    return _DROP


def _path_key(key):
    """A dict key as a path component (str or int: the record must encode whatever the key)."""
    return key if type(key) in (str, int) else repr(key)[:80]


def _encodes(value) -> bool:
    try:
        _trial_encode(value)
        return True
    except Exception:  # noqa: BLE001 -- TypeError/ValueError mostly; whatever it is: left out
        return False


def _trial_encode(value) -> None:
    tree.encode(value, {}, "ds_config", inline_scalars=True)


def _warn_dropped(engine, dropped: list) -> None:
    seen = _warned.get(id(engine))
    if seen is not None and seen() is engine:
        return
    try:
        key = id(engine)
        _warned[key] = weakref.ref(engine, lambda _ref: _warned.pop(key, None))
    except TypeError:  # an engine that takes no weak reference: said at every save
        pass
    where = "; ".join(f"{'.'.join(map(str, d['path'])) or '(the config)'} ({d['type']})"
                      for d in dropped[:5])
    more = f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
    log.warning("gockpt: the DeepSpeed config is recorded in the checkpoint without what "
                "cannot be stored without pickle: %s%s. `gockpt export --to deepspeed` of "
                "these checkpoints may need --ds-config", where, more)


def restore_engine(engine, record: dict) -> None:
    """Put back what :func:`engine_record` took (not the DeepSpeed config: the engine has its
    own; a record of an older gockpt has none). Check it first with :func:`check_record`."""
    for name, value in record["counters"].items():
        setattr(engine, name, value)
    for name, values in record["scalers"].items():
        scaler = getattr(engine.optimizer, name, None)
        if scaler is None:
            continue  # (bf16: check_record let it go)
        for key, value in values.items():
            setattr(scaler, key, value)


def check_record(engine, record: dict, where: str) -> None:
    """LoadError (naming ``where``) when the engine cannot take the record's loss scaling: the
    checkpoint scaled its loss (fp16) and this engine's optimizer has no such scaler. A bf16
    engine scales nothing, so a bf16 record's scaler (ZeRO 1/2 keep one at 1) may go to an
    optimizer without one (BF16_Optimizer) and is left out."""
    for name in record["scalers"]:
        if getattr(engine.optimizer, name, None) is None and not engine.bfloat16_enabled():
            raise LoadError(f"{where}: the checkpoint holds the loss scaler {name} but the "
                            f"engine's optimizer {type(engine.optimizer).__name__} has none")


def relink(engine) -> None:
    """After the base optimizer's state was replaced: DeepSpeed's fragment mappings
    (``param._hp_mapping``, read by ``safe_get_full_optimizer_state`` and the like) point at
    the moments again, as DeepSpeed's own load does it."""
    link = getattr(engine.optimizer, "_link_all_hp_params", None)
    if link is not None:
        link()


def _numbers_of(obj) -> dict:
    """The plain number attributes of a loss scaler (its whole state)."""
    out = {}
    for key, value in vars(obj).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (bool, numbers.Number)):
            out[key] = value if isinstance(value, bool) else (
                int(value) if isinstance(value, numbers.Integral) else float(value))
    return out


def warm_cpu_adam(base: torch.optim.Optimizer) -> int:
    """Bring DeepSpeed's CPU Adam to the live run's arithmetic state after a load.

    Its op keeps ``beta1^t``/``beta2^t`` as float32 running products in a process-wide object
    and recomputes them with ``pow`` only on a jump of t; the product and ``pow`` differ from
    t ~ 6, so a fresh process would continue with other bias corrections.  Stepping the op on a
    one-element scratch tensor through t = 1..T (the live run's history from its first step,
    betas constant) rebuilds the same product.  Returns the number of scratch steps."""
    steps = [st.get("step") for st in base.state.values()]
    if getattr(base, "multi_tensor_adam", None) is None or not steps or \
            base.param_groups[0]["params"][0].device.type != "cpu":
        return 0
    t = int(max(int(s) for s in steps))
    group = base.param_groups[0]
    scratch = [torch.zeros(1) for _ in range(4)]  # param, exp_avg, exp_avg_sq, grad
    for step in range(1, t + 1):
        run_cpu_adam_op(base, *scratch, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                        weight_decay=group["weight_decay"], step=step)
    if t > 1000:
        log.info("gockpt: DeepSpeed CPU Adam brought to step %d (%d scratch steps)", t, t)
    return t
