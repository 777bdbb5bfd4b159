"""Loading a checkpoint onto another shape than the one that saved it -- another number of
ranks, another sharding (FSDP2 on M ranks, DDP <-> FSDP2, FSDP2 sharded along another
dimension) -- through torch.distributed.checkpoint's own planner and gockpt's StorageReader
(:mod:`gockpt.storage.dcp`): every rank reads only the byte ranges of the stored tensors its
shards overlap.

The targets are the live tensors: the model's state dict (its parameters and buffers, loaded
in place) and, for the optimizer, tensors placed like each parameter (a DTensor's shard) for
its per-element state. Everything is checked against the checkpoint's metadata first -- names
on both sides, global shapes, dtypes, the optimizer's class, groups and moments -- so a
refusal leaves the live state untouched. The checkpoint's digests of the live state at F are
of whole stored tensors: this path checks every chunk's crc32c, not the digests.
"""

from __future__ import annotations

import collections

from typing import Dict, Optional, Tuple

import torch

from . import storage
from .core.errors import CorruptCheckpointError, LoadError
from .core.memory import global_slice, local
from .core.names import Names
from .agree import agreed
from .replay.adapters import state_keys_of
from .restored import (Restored, apply_rest, decode_rest, partly_overwritten, restoring,
                       warn_rng_not_restored)
from .storage import manifest as manifest_mod
from .storage.manifest import parts_of
from .storage.manifest_file import read_manifest
from .storage.schema import WRITTEN_BY_DCP, Manifest, is_small_tensor
from .storage.statedict import optimizer_state_dict


def rank_and_world() -> Tuple[int, int]:
    """(this process's rank, the number of ranks) of torch.distributed (0, 1 without it)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def written_by(top: str) -> int:
    """How many ranks wrote the checkpoint at ``top``."""
    parts = parts_of(top, read_manifest(top))
    return len(parts) if parts is not None else 1


def needs_resharding(top: str, model: torch.nn.Module, written: int) -> bool:
    """Whether the checkpoint at ``top`` (a checkpoint directory) lies otherwise on the ranks
    than ``model`` on this job's: saved sharded (a DTensor's shards, ``model.slices``) or
    loaded into DTensors on another number of ranks, or a parameter whose stored block is not
    this rank's (FSDP2 placed otherwise, DDP <-> FSDP2). The same answer on every rank (a load
    that reshards is a collective). ``written``: how many ranks saved it."""
    rank, world = rank_and_world()
    _, m = manifest_mod.read(top, rank % written)
    if m.mode == WRITTEN_BY_DCP:
        return True  # (GockptWriter's: each rank's part holds what DCP's planner gave it)
    state = model.state_dict()
    live = {name: state[ours] for name, ours in Names(model).clean_all(state).items()}
    dtensors = any(global_slice(t) is not None for t in live.values())
    if not (m.model.slices or dtensors):
        return False  # replicated on both sides: every rank reads the whole state
    differs = written != world or any(_elsewhere(m, name, ref, live.get(name))
                                      for name, ref in m.model.expected().items())
    # DTensors: every rank is in the load (DCP's is a collective, as FSDP2 is): agreed, lest a
    # rank whose block happens to match wait alone. Plain tensors decide alike without it
    # (and a load on one rank alone -- an evaluation on rank 0 -- must not wait for others).
    return any_rank(differs) if world > 1 and dtensors else differs


# The tensors of the last collectives of ours on the training's own group, kept from being
# freed by the gloo worker that ran one (it drops its reference after the caller returns): a
# worker freeing the last reference needs the GIL, and a process whose interpreter is being
# torn down right then ends in std::terminate (a load right before the end of a script).
_KEPT: "collections.deque" = collections.deque(maxlen=16)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (a collective: every rank calls it; ``flag`` itself
    without torch.distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    _KEPT.append(t)
    return bool(t.item())



def _elsewhere(m: Manifest, name: str, ref, t: Optional[torch.Tensor]) -> bool:
    """Whether this rank's live tensor ``t`` of parameter ``name`` is another block of the
    global tensor than the one part ``m`` stored of it."""
    if t is None:
        return False  # (a missing parameter is refused by the load that follows)
    stored = m.model.slices.get(m.model.aliases.get(name, name))
    shape = tuple(m.logical_shape(ref))
    live = global_slice(t)
    if live is not None:  # a DTensor: its block, against the stored one (or the whole)
        at = (tuple(stored["shape"]), tuple(stored["offsets"])) if stored else \
            (shape, (0,) * len(shape))
        return (tuple(live[0]), tuple(live[1])) != at or tuple(local(t).shape) != shape
    # a plain tensor that is the whole of what was stored as a block (FSDP2 -> DDP); one of
    # the block's shape is the training's own partition (Config.global_slices: ZeRO)
    return stored is not None and tuple(t.shape) == tuple(stored["shape"]) != shape


def load_resharded(top: str, model: torch.nn.Module, optimizer=None, *, scheduler=None,
                   restore_rng: bool = True, verify: bool = True, map_location=None,
                   written: int) -> Restored:
    """:func:`gockpt.load` of the checkpoint directory ``top`` onto another shape (see the
    module's docstring); a collective on every rank (a failure before DCP's load, on any
    rank, raises on every rank). Scheduler and ``extra_state`` come from this rank's part on
    as many ranks as saved, else (and from GockptWriter's) from rank 0's; RNG states only on
    as many ranks (a warning says when they are not restored). ``written``: how many ranks
    saved it."""
    from .storage import dcp  # (torch.distributed.checkpoint: imported only by who uses it)
    world = rank_and_world()[1]
    try:
        prepared, failed = _prepare(top, model, optimizer, scheduler, restore_rng, verify,
                                    written == world), None
    except Exception as exc:  # noqa: BLE001 -- raised below, on every rank alike
        prepared, failed = None, exc
    # before DCP's load, a collective: a rank failing alone would leave the others in it
    failed, _ = agreed(failed, top)
    if failed is not None:
        raise failed
    reader, state, opt_sd, rest, manifest, with_rng, dcp_saved, after = prepared
    with restoring(top):
        try:  # (straight into the model's tensors)
            dcp.load(state, reader, alone=world == 1)
        except CorruptCheckpointError as exc:
            raise partly_overwritten(exc) from exc
        for target, value in after:
            target.copy_(value)
        if optimizer is not None:
            optimizer.load_state_dict(opt_sd)
        extra = apply_rest(rest, scheduler, map_location)
        if dcp_saved:  # the larger tensors of the rest of DCP's state, under their names
            extra = {**(extra or {}), **{n: t for n, t in state.items()
                                          if n not in ("model", "optimizer")}}
    if restore_rng and not with_rng:
        warn_rng_not_restored(top, written, world, dcp_saved=dcp_saved)
    return Restored(step=manifest.step, extra_state=extra, path=top, manifest=manifest,
                    rng_restored=with_rng, resharded=True)


def _prepare(top: str, model, optimizer, scheduler, restore_rng: bool, verify: bool,
             same_ranks: bool) -> tuple:
    """What :func:`load_resharded` checks and reads before DCP's load: (the reader, DCP's
    state dict of targets, the optimizer's state dict to load after, the decoded rest of the
    small state, the manifest it came from, whether RNG states are restored, whether DCP's
    save wrote the checkpoint)."""
    from .storage import dcp  # (torch.distributed.checkpoint: imported only by who uses it)
    rank = rank_and_world()[0]
    # the small state: this rank's part on as many ranks, else rank 0's (GockptWriter's:
    # always rank 0's, the only part that holds it)
    dcp_saved = read_manifest(top).get("mode") == WRITTEN_BY_DCP
    path, manifest = manifest_mod.read(top, rank if same_ranks and not dcp_saved else 0)
    reader = dcp.GockptReader(top, verify=verify)
    md = reader.read_metadata().state_dict_metadata
    live = model.state_dict()
    clean = Names(model)
    own = clean.clean_all(live)  # stored name -> the model's own
    targets = {name: live[ours] for name, ours in own.items()}
    small = storage.read_tensors(path, manifest, [n for n in manifest.tensors
                                                  if is_small_tensor(n)], verify=verify)
    state, opt_sd, after = {}, None, []
    if dcp_saved:
        targets, state, after = _split_dcp_saved(top, md, targets, manifest, small)
    check_model(top, md, targets, more=dcp_saved)
    state["model"] = targets
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        params = {clean.clean(names[id(p)]) if id(p) in names else None: p
                  for g in optimizer.param_groups for p in g["params"]}
        if None in params:
            raise LoadError(f"{top}: the optimizer steps a parameter that is not the model's")
        opt_sd, opt_targets = _optimizer_targets(top, md, reader.owners, manifest, path, small,
                                                 optimizer, params)
        state["optimizer"] = {"state": opt_targets}
    with_rng = restore_rng and same_ranks and not dcp_saved  # (DCP's save keeps none)
    rest = decode_rest(path, manifest, small, scheduler, with_rng)
    return reader, state, opt_sd, rest, manifest, with_rng, dcp_saved, after


def _split_dcp_saved(top: str, md: dict, targets: dict, manifest: Manifest, small: dict):
    """Of a checkpoint DCP's save wrote (GockptWriter: a tensor's place follows its DCP name,
    not the model): (the model's targets DCP loads; fresh tensors for the stored tensors the
    model does not have -- the rest of DCP's state, returned in ``extra_state`` --; (target,
    value) of the model's tensors kept with the rest of the state, a 0-dim buffer, copied
    after the load)."""
    extra = manifest.small.decode("extra_state", small) or {}
    after, loaded = [], {}
    for name, t in list(targets.items()):
        value = extra.get(f"model.{name}", extra.get(name))
        if f"model.{name}" not in md and isinstance(value, torch.Tensor):
            if value.shape != t.shape or value.dtype != t.dtype:
                raise LoadError(f"{top}: the model's {name!r} is {t.dtype} of {list(t.shape)}, "
                                f"the checkpoint's {value.dtype} of {list(value.shape)}")
            after.append((targets.pop(name), value))
    for key, entry in md.items():
        name = key[len("model."):]
        if key.startswith("model.") and name not in targets and hasattr(entry, "size"):
            loaded[name] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return targets, loaded, after


def check_model(top: str, md: dict, targets: Dict[str, torch.Tensor],
                 prefix: str = "model.", more: bool = False) -> None:
    """The model's state dict against the checkpoint's: every name on both sides, each
    tensor's global shape and dtype (a DTensor's are its global tensor's). ``prefix``: DCP's
    name of a target is ``prefix`` + its name (and the checkpoint's names under it are the
    model's; ``more``: the checkpoint may hold more)."""
    stored = {k[len(prefix):] for k in md if k.startswith(prefix)}
    extra = sorted(stored - set(targets))
    if extra and not more:
        raise LoadError(f"{top}: the checkpoint has parameter {extra[0]!r} that the model does "
                        "not have; load into a model of the same architecture")
    for name, t in targets.items():
        entry = md.get(prefix + name)
        if entry is None or not hasattr(entry, "size"):
            raise LoadError(f"{top}: the model's {name!r} is not in the checkpoint")
        _check_tensor(top, f"parameter {name!r}", entry, t)


def _check_tensor(top: str, what: str, entry, t: torch.Tensor) -> None:
    if tuple(entry.size) != tuple(t.shape):
        raise LoadError(f"{top}: {what} has shape {list(entry.size)} in the checkpoint but "
                        f"{list(t.shape)} in the model")
    if entry.properties.dtype != t.dtype:
        raise LoadError(f"{top}: {what} is {entry.properties.dtype} in the checkpoint but "
                        f"{t.dtype} in the model")


def _optimizer_targets(top: str, md: dict, owners: Dict[int, str], manifest: Manifest,
                       path: str, small: dict, optimizer, params: Dict[str, torch.Tensor]):
    """(the optimizer's state dict to load once DCP has filled it, DCP's targets: parameter
    name -> key -> a tensor placed like the parameter) after checking the checkpoint's
    optimizer against ``optimizer`` (``owners``: the checkpoint's state index -> parameter;
    ``params``: parameter name -> the parameter it steps):
    class, groups and their parameters, every per-element state tensor's shape, both moments
    of an Adam-like optimizer."""
    stored: Dict[str, Dict[str, object]] = {}  # parameter -> per-element key -> its metadata
    for key, entry in md.items():
        if key.startswith("optimizer.state.") and hasattr(entry, "size"):
            param, _, k = key[len("optimizer.state."):].rpartition(".")
            stored.setdefault(param, {})[k] = entry
    unknown = sorted(set(stored) - set(params))
    if unknown:
        raise LoadError(f"{top}: the checkpoint holds optimizer state of {unknown[0]!r}, which "
                        "the optimizer does not step")
    dcp_saved = manifest.mode == WRITTEN_BY_DCP
    saved = optimizer_state_dict(manifest, path, small, None if dcp_saved else optimizer,
                                 aligned=False)
    if dcp_saved:  # (DCP's flattened settings are per parameter: the live groups decide)
        saved["param_groups"] = _regrouped(top, saved["param_groups"], owners, optimizer,
                                           list(params))
    moments = set(state_keys_of(optimizer))
    index = {n: i for i, n in enumerate(params)}  # the live optimizer's state indices
    state: Dict[int, dict] = {}
    targets: Dict[str, Dict[str, torch.Tensor]] = {}
    for idx, values in saved["state"].items():  # the small state (step counters)
        if owners.get(idx) in index:
            state[index[owners[idx]]] = dict(values)
    for name, keys in stored.items():
        p = params[name]
        for key, entry in keys.items():
            if key in state.get(index[name], {}):
                continue  # a small value (a step counter), put back as saved
            _check_tensor(top, f"optimizer state {key!r} of {name!r}", entry, p)
            t = torch.empty_like(p, dtype=entry.properties.dtype)  # a DTensor like its param
            targets.setdefault(name, {})[key] = t
            state.setdefault(index[name], {})[key] = t
    for name, i in index.items():
        missing = moments - set(targets.get(name, {}))
        if moments and state.get(i) and missing:
            raise LoadError(f"{top}: the optimizer state of {name!r} lacks {sorted(missing)}")
    groups = []
    names = list(params)
    at = 0
    for g, (group, live) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        mine = names[at:at + len(live["params"])]
        theirs = {owners.get(i) for i in group["params"]}
        if theirs - {None} - set(mine):
            raise LoadError(f"{top}: param group {g} holds other parameters in the "
                            f"checkpoint ({sorted(theirs - {None})[:3]}...) than in the "
                            f"optimizer ({mine[:3]}...)")
        groups.append({**group, "params": list(range(at, at + len(mine)))})
        at += len(mine)
    return {"state": state, "param_groups": groups}, targets


def _regrouped(top: str, groups: list, owners: Dict[int, str], optimizer, names: list) -> list:
    """The saved param groups of a checkpoint DCP's save wrote, as the live optimizer groups
    its parameters (``names``, in its order): each live group takes its parameters' saved
    settings, which must be alike (LoadError otherwise, or when a parameter has none)."""
    index = {n: i for i, n in owners.items()}
    settings = {owners.get(i): {k: v for k, v in g.items() if k != "params"}
                for g in groups for i in g["params"]}
    out, at = [], 0
    for live in optimizer.param_groups:
        mine = names[at:at + len(live["params"])]
        at += len(mine)
        found = [settings.get(n) for n in mine]
        if any(f is None for f in found) or any(f != found[0] for f in found):
            n = next((m for m, f in zip(mine, found) if f is None or f != found[0]), mine[0])
            raise LoadError(f"{top}: the checkpoint's param group settings of {n!r} are "
                            f"missing or differ from those of {mine[0]!r}, which the optimizer "
                            "groups it with")
        out.append({**(found[0] if found else {}), "params": [index[n] for n in mine]})
    return out
