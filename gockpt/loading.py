"""Restore a committed checkpoint into a model, its optimizer and scheduler."""

from __future__ import annotations

import time
import warnings
from typing import Optional

import torch

from . import storage
from .core import runlog
from .core.digest import as_pairs, digests, to_hex
from .replay.adapters import state_keys_of
from .core.names import Names, is_replicated
from .core.memory import global_slice, like, local, memory_order
from .storage import manifest as manifest_mod, shares
from .core.errors import CorruptCheckpointError, GockptError, LoadError
from .resharding import load_resharded, needs_resharding, written_by
from .restored import (Restored, apply_rest, decode_rest, partly_overwritten, restoring,
                       warn_rng_not_restored)
from .core.paths import directory_to_read, is_remote
from . import steplog
from .agree import CORRUPT, agreed, outcome, several
from .storage import memory_tier
from .tiers import newest
from .storage.format import MANIFEST_FILE
from .storage.schema import Manifest, is_small_tensor
from .storage.statedict import optimizer_state_dict


def load(directory: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         *, scheduler=None, tag: Optional[str] = None, restore_rng: bool = True,
         verify: bool = True, map_location=None, rank: Optional[int] = None,
         memory_dir: Optional[str] = None) -> Restored:
    """Load the latest committed checkpoint in ``directory`` (or the one named ``tag``) into
    ``model``, ``optimizer`` and ``scheduler``, and restore RNG states unless
    ``restore_rng=False``. Parameters and optimizer state land on the device of the model's
    parameters; ``map_location`` (a device) moves the tensors of ``extra_state``.

    On the shape that saved it (as many ranks, each parameter the same block on each), a
    rank loads its own part -- or, where the ranks wrote replicated state in shares (DDP),
    every part's share of it -- and checks what it read against the digests of the live
    state at F. On another shape -- another number of ranks, FSDP2 sharded otherwise, DDP
    <-> FSDP2 -- it loads through torch.distributed.checkpoint's planner
    (:mod:`gockpt.resharding`: a collective, each rank reading only the byte ranges it needs,
    checksums checked); replicated state (DDP) loads on any number of ranks either way.
    ``rank`` reads that rank's part on purpose (no resharding). On several ranks a load
    without ``tag`` and ``rank`` is a collective (every rank calls it: the memory tier's
    copies and step log are agreed on); one rank loading alone (an evaluation on rank 0)
    passes ``tag=`` or ``rank=``. Scheduler and
    ``extra_state`` come from this rank's part (rank 0's on another number of ranks); RNG
    states only on as many ranks as saved them (else a warning, and
    ``Restored.rng_restored`` is False).

    Names, shapes and dtypes are checked against the targets before any byte is read;
    checksums are verified unless ``verify=False``. Never unpickles.

    The memory tier (``Config(memory=...)``; ``memory_dir`` as it was given there, default
    ``/dev/shm``): without ``tag`` or ``rank``, its copy of the checkpoint the disk's ``latest``
    names (on several ranks: when every rank has it; a part a rank's host lost is taken from
    its peer's memory on another host) is loaded instead, checked as a disk one is
    (every chunk's checksum as it is read, then the digests of the live state at F); a
    damaged or incomplete copy is never what a load returns: a warning says why, and the
    disk's checkpoint is loaded over whatever it had put in place. ``Restored.path`` says
    which was loaded. With the step log (``Config(memory_log=...)``, one process), the
    logged steps after that checkpoint are then replayed through ``optimizer`` and checked
    against the last one's digests (``Restored.step`` is that step; anything that does not
    match: a warning, and the checkpoint is loaded again).

    Raises:
        CheckpointNotFoundError: nothing committed at ``directory`` / ``tag``.
        CorruptCheckpointError: a checksum, file or manifest is wrong (names file and tensor).
        LoadError: the checkpoint does not fit ``model`` / ``optimizer``.
    """
    started = time.time()
    path = directory_to_read(directory)
    run, top, disk = newest(path, tag, memory_dir, memory=rank is None)
    # the memory tier's step log: the run's newest state asked for (the same on every rank)
    replays_log = rank is None and tag is None and run == path and not is_remote(path)
    _record_load(run, top, "loading")
    args = (model, optimizer, scheduler, restore_rng, verify, map_location, rank)
    # several ranks going on to the step log's gathers: a load that fails on one rank fails
    # on every rank (the others would wait in those gathers for it)
    alike = replays_log and several()
    restored, failed, worst_level = _attempt(top, args, alike)
    if worst_level == CORRUPT and top != disk:
        # the memory tier's copy is damaged (on some rank: every rank loads the disk's, which
        # overwrites whatever the copy put in place)
        warnings.warn(f"gockpt: the memory copy {top} does not verify ({failed}); loading "
                      f"{disk} from disk instead", RuntimeWarning, stacklevel=2)
        top = disk
        restored, failed, _ = _attempt(top, args, alike)
    if failed is not None:
        raise failed
    if replays_log and optimizer is not None:  # (every rank alike: its collectives)
        try:
            root = memory_tier.owned_root(run, memory_dir)
        except Exception:  # noqa: BLE001 -- a damaged run file: no log here, ranks still agree
            root = None
        restored = steplog.resume(root, restored, model, optimizer, scheduler, restore_rng,
                                  map_location, reload=lambda: _load_checkpoint(top, *args))
    _record_load(run, top, "load", step=restored.step, time_start=started)
    return restored


def _load_checkpoint(top: str, model, optimizer, scheduler, restore_rng: bool, verify: bool,
                     map_location, rank: Optional[int]) -> Restored:
    """:func:`load` of the checkpoint ``top``."""
    written = written_by(top)
    if rank is None and needs_resharding(top, model, written):
        return load_resharded(top, model, optimizer, scheduler=scheduler,
                              restore_rng=restore_rng, verify=verify,
                              map_location=map_location, written=written)
    return _load_own(top, written, model, optimizer, scheduler, restore_rng, verify,
                     map_location, rank)


def _attempt(top: str, args: tuple, alike: bool) -> tuple:
    """(Restored or None, the error or None, the worst outcome: :mod:`gockpt.agree`'s levels)
    of loading ``top``; ``alike``: agreed by every rank (an error on every rank when a load
    failed on any, so that none waits for another in a later gather)."""
    try:
        restored, failed = _load_checkpoint(top, *args), None
    except Exception as exc:  # noqa: BLE001 -- re-raised by the caller, on every rank alike
        restored, failed = None, exc
    failed, level = agreed(failed, top) if alike else (failed, outcome(failed))
    return (None if failed is not None else restored), failed, level


def _record_load(run: str, top: str, kind: str, **fields) -> None:
    """Rank 0 notes a load's start (``loading``: a process that dies in it still counts) and
    its end (``load``: the step a restart goes on from) in the run directory's metrics.jsonl
    (goodput's restore time: :mod:`gockpt.core.runlog`); not for a remote checkpoint."""
    dist = torch.distributed
    if is_remote(top) or (dist.is_available() and dist.is_initialized() and dist.get_rank()):
        return
    runlog.record(run, kind, quiet=True, **fields)


def _load_own(top: str, written: int, model, optimizer, scheduler, restore_rng: bool,
              verify: bool, map_location, rank: Optional[int]) -> Restored:
    """:func:`load` on the shape that saved it (or one rank's part, ``rank``)."""
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    path, manifest = manifest_mod.read(
        top, rank, live_world=world, live_rank=dist.get_rank() if distributed else 0,
        target_replicated=is_replicated(model))
    # a rank's RNG states mean something only on as many ranks (or where one was asked for)
    with_rng = restore_rng and (rank is not None or written == world)
    tensors = None
    if path != top:  # replicas that wrote one state in shares: every part's, put together
        shared = shares.gather(top, manifest, verify=verify, check=check_digests)
        if shared is not None:
            manifest, tensors = shared  # (with this rank's small state)
    live = model.state_dict()
    # Stored names carry no wrapper prefix (DDP's module., compile's _orig_mod.): the same
    # checkpoint loads into the wrapped and the unwrapped model. ``own``: stored -> live name.
    own = Names(model).clean_all(live)
    target = {name: live[ours] for name, ours in own.items()}
    expected = manifest.model.expected()
    _check_params(path, target, expected, manifest)

    # Small state first (cheap): everything small decoded and checked against the targets
    # before any parameter is read (parameters are read straight into the model).
    if tensors is None:
        tensors = storage.read_tensors(path, manifest,
                                       [n for n in manifest.tensors if is_small_tensor(n)],
                                       verify=verify)
    small = _check_small(path, manifest, tensors, target, expected, optimizer, scheduler,
                         with_rng)
    _read_params(path, manifest, tensors, target, verify)
    if verify:
        check_digests(path, manifest, tensors)
    with restoring(path):
        # a DTensor (FSDP2) gets its local shard back as a DTensor placed like the live one
        sd = {name: like(target[name], ref.resolve(tensors)) for name, ref in expected.items()}
        sd.update(small["model"])
        model.load_state_dict({own[name]: value for name, value in sd.items()})
        if optimizer is not None:
            optimizer.load_state_dict(_placed_like_params(
                optimizer_state_dict(manifest, path, tensors, optimizer), optimizer))
        extra = apply_rest(small, scheduler, map_location)
    if restore_rng and not with_rng:
        warn_rng_not_restored(top, written, world)
    return Restored(step=manifest.step, extra_state=extra, path=top, manifest=manifest,
                    rng_restored=with_rng)


def _check_small(path, manifest, tensors, target, expected, optimizer, scheduler,
                 with_rng: bool) -> dict:
    """Decode every small section and check that it fits the targets (the model's buffers,
    the optimizer's state, a scheduler state, RNG states a generator takes): section -> the
    decoded value."""
    out = {}
    try:
        out["model"] = model_small = manifest.small.decode("model", tensors)
        missing = sorted(set(target) - set(expected) - set(model_small))
        unexpected = sorted((set(expected) | set(model_small)) - set(target))
        if missing or unexpected:
            raise LoadError(f"{path}: model state does not match: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
        for name, value in model_small.items():
            _check_shape(path, name, target[name], value)
        if optimizer is not None:
            sd = optimizer_state_dict(manifest, path, tensors, optimizer, aligned=False)
            _check_optimizer_state(path, manifest, sd, optimizer, target)
    except GockptError:
        raise
    except Exception as exc:  # malformed values a writer of gockpt's never produces
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE}: the small state does not "
                                     f"decode: {type(exc).__name__}: {exc}") from exc
    out.update(decode_rest(path, manifest, tensors, scheduler, with_rng))
    return out


def _keeps_param_dtype(optimizer) -> bool:
    """Whether ``optimizer`` allocates its state like its parameters (zeros_like): torch's own,
    and those a replay adapter knows (which keep their moments in the parameter's dtype)."""
    return type(optimizer).__module__.startswith("torch.optim") or bool(state_keys_of(optimizer))


def _check_optimizer_state(path, manifest, sd: dict, optimizer, target) -> None:
    """The optimizer state of the checkpoint against the optimizer it goes into, before
    anything is read: every parameter index listed once; every stored state tensor belongs
    to a parameter, has its shape and (for optimizers that keep state like their
    parameters) its dtype -- ``load_state_dict`` would cast or broadcast what does not --
    and an Adam-like state has both moments."""
    def bad(msg):
        return CorruptCheckpointError(f"checkpoint {path}: {MANIFEST_FILE}: {msg}")

    listed = [i for g in sd["param_groups"] for i in g["params"]]
    if sorted(listed) != list(range(len(listed))) or not all(type(i) is int for i in listed):
        raise bad(f"the optimizer's param groups list parameters {listed[:8]}..., not each of "
                  f"0..{len(listed) - 1} once")
    live = {i: p for saved, group in zip(sd["param_groups"], optimizer.param_groups)
            for i, p in zip(saved["params"], group["params"])}
    names = {id(t): n for n, t in target.items()}
    aligned = manifest.optimizer.aligned if manifest.optimizer is not None else {}
    same_dtype = _keeps_param_dtype(optimizer)
    for idx, by_key in aligned.items():
        if idx not in live:
            raise bad(f"optimizer state [{idx}] belongs to no parameter of the optimizer")
        of = f"its parameter {names.get(id(live[idx]), f'[{idx}]')!r}"
        p = local(live[idx])
        for key, ref in by_key.items():
            what = f"optimizer state [{idx}][{key!r}] (stored in {ref.tensor!r})"
            shape = list(manifest.logical_shape(ref))
            if shape != list(p.shape):
                raise bad(f"{what} has shape {shape}, {of} {list(p.shape)}")
            code = manifest.tensors[ref.tensor]["dtype"]
            if same_dtype and storage.CODE_TO_DTYPE[code] != p.dtype:
                raise bad(f"{what} is {code}, {of} is {p.dtype} ({type(optimizer).__name__} "
                          "keeps its state in the parameter's dtype)")
    moments = set(state_keys_of(optimizer))
    if moments:
        for idx, st in sd["state"].items():
            missing = moments - set(aligned.get(idx, {})) - set(st)
            if st and missing:
                raise bad(f"optimizer state [{idx}] has {sorted(st)} but not "
                          f"{sorted(missing)}: the checkpoint lost its moments")


def _read_params(path, manifest, tensors, target, verify) -> None:
    """Read every large tensor; parameters straight into the model's (CPU) tensors: names,
    dtypes and shapes were validated, so only a checksum failure can interrupt a read."""
    direct = {}
    for name, ref in manifest.model.params.items():
        t = local(target.get(name))
        if t is None or ref.shape is not None:  # packed: read with its pack
            continue
        if t.device.type == "cpu" and memory_order(t) == ref.dims:
            direct[ref.tensor] = t.permute(ref.dims) if ref.dims else t  # contiguous
        elif t.device.type == "cuda":  # pinned staging: the copy to the GPU is a fast DMA
            shape = manifest.tensors[ref.tensor]["shape"]
            direct[ref.tensor] = torch.empty(shape, dtype=t.dtype, pin_memory=True)
    try:
        tensors.update(storage.read_tensors(
            path, manifest, [n for n in manifest.tensors if n not in tensors],
            verify=verify, out=direct))
    except CorruptCheckpointError as exc:
        raise partly_overwritten(exc) from exc


def check_digests(path: str, manifest: Manifest, tensors: dict) -> None:
    """The tensors read (``tensors``: stored name -> the stored tensor) against the digests
    the checkpoint recorded of the live state at F: CorruptCheckpointError naming those that
    differ. The checksums prove the bytes are the ones written; this proves they are the
    training state, whatever path they took (copy, replay, layout, write, read)."""
    bad = [what for what, ok in digest_matches(manifest, tensors) if not ok]
    if bad:
        raise CorruptCheckpointError(
            f"checkpoint {path}: {', '.join(bad[:5])}{' and others' if len(bad) > 5 else ''} "
            "do not hold the training state the checkpoint was taken from (their digest differs "
            "from the live tensors' at that step, though their checksums match): do not train "
            "on it; load an earlier checkpoint (tag=...) and please report this")


def digest_matches(manifest: Manifest, tensors: dict):
    """(what, whether its digest matches) of every parameter and optimizer state tensor with
    a recorded digest whose stored tensor is in ``tensors``."""
    checks = [c for c in manifest.digest_checks() if c[1].tensor in tensors]
    with torch.no_grad():
        got = as_pairs(digests([ref.resolve(tensors) for _, ref, _ in checks]))
    return [(what, to_hex(pair) == want) for (what, _, want), pair in zip(checks, got)]


def _placed_like_params(sd: dict, optimizer) -> dict:
    """``sd`` (an optimizer state dict of local tensors) with each state tensor shaped like
    a DTensor parameter's local shard made a DTensor placed like it: torch's optimizers step a
    DTensor parameter with DTensor state (FSDP2)."""
    params = {i: p for saved, group in zip(sd["param_groups"], optimizer.param_groups)
              for i, p in zip(saved["params"], group["params"])}
    for idx, st in sd["state"].items():
        p = params.get(idx)
        if p is not None and local(p) is not p:
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and value.shape == local(p).shape:
                    st[key] = like(p, value)
    return sd


def _check_params(path, target, expected, manifest) -> None:
    """Names, shapes, dtypes and (DTensors) global slices of the parameters, from the
    manifest alone."""
    for name, ref in expected.items():
        if name not in target:
            raise LoadError(f"{path}: the checkpoint has parameter {name!r} that the model "
                            "does not have; load into a model of the same architecture")
        entry = manifest.tensors[ref.tensor]  # every reference was checked on reading
        want, shape = local(target[name]), list(manifest.logical_shape(ref))
        # where this rank's tensor lies in the global one: a DTensor says it; a plain tensor
        # is all of it -- or a block of a tensor the training partitions itself
        # (Config.global_slices, which the load does not see: its rank's part is its block)
        stored = manifest.model.slices.get(manifest.model.aliases.get(name, name))
        live = global_slice(target[name])
        stored = (stored["shape"], stored["offsets"]) if stored else (shape, [0] * len(shape))
        if live is not None and ([list(v) for v in live] != [list(v) for v in stored]
                                 or list(want.shape) != shape):
            raise LoadError(
                f"{path}: parameter {name!r} was stored as the block at {list(stored[1])} "
                f"(of {shape}) of the global {list(stored[0])}, but this rank holds the block "
                f"at {list(live[1])} (of {list(want.shape)}) of {list(live[0])}: the model is "
                "sharded otherwise than when it was saved (FSDP2 / DTensor placements, mesh "
                "or number of ranks); gockpt.load without rank= reshards it")
        if list(want.shape) != shape:
            raise LoadError(f"{path}: parameter {name!r} has shape {shape} in the checkpoint "
                            f"but {list(want.shape)} in the model")
        if storage.DTYPE_TO_CODE.get(want.dtype) != entry["dtype"]:
            raise LoadError(f"{path}: parameter {name!r} is {entry['dtype']} in the checkpoint "
                            f"but {want.dtype} in the model")


def _check_shape(path, name, want, got) -> None:
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        if want.shape != got.shape:
            raise LoadError(f"{path}: buffer {name!r} has shape {list(got.shape)} in the "
                            f"checkpoint but {list(want.shape)} in the model")
        if want.dtype != got.dtype:  # load_state_dict would cast it without a word
            raise LoadError(f"{path}: buffer {name!r} is {got.dtype} in the checkpoint but "
                            f"{want.dtype} in the model")
