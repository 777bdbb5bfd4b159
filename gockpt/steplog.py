"""Every step recoverable (``Config.memory_log``): the memory tier's step log.

Between checkpoints, each training step leaves an entry in host shared memory
(:mod:`gockpt.storage.steplog`): the gradients its update consumed (copied in the optimizer's
step pre-hook, exactly what the update reads), the param groups' settings the update used and
those after the step (a scheduler may have changed them), the step's small state (buffers,
scheduler, RNG, ``extra_state``, as a checkpoint takes them) and the digests of every
parameter and optimizer state tensor after the update (taken behind the training work by the
digest thread; the next update waits for their reads). A process restarted after a crash
loads the newest checkpoint and then, in :func:`replay`, runs the very optimizer over the
logged steps -- the same update on the same inputs, so the same bits -- restores the last
step's small state and checks the state against that step's digests before training sees
it; anything that does not match (a damaged entry, a digest) loads the checkpoint again. A
crash then costs the step in progress (and the last one, when its entry was not written yet),
not the steps since the checkpoint.

On several ranks each rank logs its own steps -- with sharded parameters (FSDP2) its shards'
gradients and digests --, and a restart replays on every rank the steps every rank has logged
whole (alike, for DDP's replicas), on the ranks and shards that logged them. The log is off
where it is not asked for.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from typing import Callable, List, Optional, Tuple

import torch

from . import _tensors
from .agree import common_prefix, everyone, several
from .capture import smallstate
from .capture.transport import Bf16Transport
from .core.digest import LiveDigests, as_pairs, digests, to_hex
from .core.errors import ConfigError, CorruptCheckpointError
from .core.memory import is_dtensor, like, local
from .core.names import Names
from .restored import Restored, apply_rest
from .storage import reader, tree
from .storage.manifest_file import read_manifest
from .storage.steplog import LogWriter, entries_after, log_root


def live_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                 ) -> List[Tuple[str, torch.Tensor]]:
    """Every parameter and every optimizer state tensor shaped like it, named as the log
    names them (``param/<name>``, ``state/<name>/<key>``), in a fixed order: what a step's
    digests cover, on both sides."""
    names, state, out = Names(model), optimizer.state, []
    for name, p in model.named_parameters():
        clean = names.clean(name)
        out.append((f"param/{clean}", local(p.detach())))  # (FSDP2: this rank's shard)
        st = state.get(p) or {}
        for key in sorted(k for k in st if isinstance(k, str)):
            v = st[key]
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                out.append((f"state/{clean}/{key}", local(v.detach())))
    return out


def _gradients_of(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """Every parameter under the name its gradient has in an entry (``grad/<name>``)."""
    names = Names(model)
    return [(f"grad/{names.clean(name)}", p) for name, p in model.named_parameters()]


def _groups(groups: list) -> list:
    """The settings of param groups ``groups`` (everything but the parameters)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def log_spacing(model: torch.nn.Module, limit: int) -> int:
    """The most steps between two checkpoints that keeps a step log of ``limit`` bytes from
    filling: half the entries it holds (the other half covers the steps while a checkpoint is
    written and committed, which prunes the log). An entry is estimated as the parameters'
    gradients, the buffers and 64 KiB of the rest -- the same on every rank of DDP, which must
    all start the same checkpoints. ConfigError when the log holds fewer than 4 entries."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    entry = grads + buffers + (64 << 10)
    held = limit // entry
    if held < 4:
        raise ConfigError(f"memory_log={limit} holds {held} step(s) of about {entry} bytes "
                          "each; give it room for at least 4 (a checkpoint every half of them "
                          "keeps it from filling)")
    return held // 2


class StepLog:
    """The capture side: called by the Checkpointer's hooks on the training thread."""

    def __init__(self, model, optimizer, scheduler, memory_root: str, limit: int, device,
                 planned_ids, rank: Optional[int] = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.device, self.planned_ids = device, planned_ids
        self._walks = _tensors.ModuleWalkCache()  # the model's small state, walked each step
        self._params = _gradients_of(model)
        self.writer = LogWriter(log_root(memory_root, rank), limit)  # rank: each its own
        self.digester = LiveDigests(device)
        # (gradients by name, the groups' settings, the groups stepped one at a time or None)
        # of this step's update
        self._pending = None
        self._groups_all = optimizer.param_groups  # (a step may see one of them: DeepSpeed)
        self._ticket = None  # the digests of the last step, on their way
        self._first = True
        self._written: Optional[threading.Event] = None  # set once the last entry is done
        self._live: Optional[list] = None  # live_tensors, read again when the state grows
        self._live_for = -1
        self._bf16 = Bf16Transport(says_fallback=False)  # the gradients' images, when exact
        self._steps = 0

    def before_update(self) -> None:
        """``update_begin``: the last step's digests must have read the state first."""
        if self._ticket is not None:
            self.device.order_after_digests(self._ticket)

    def consumed(self) -> None:
        """The optimizer's step pre-hook: the gradients this update consumes, and the groups'
        settings it uses, copied -- float32 ones as bfloat16 where every one of them is a
        bfloat16 value (bf16 autocast's: half the log's bytes, and made float32 again at the
        replay, exactly)."""
        grads, now = {}, self.optimizer.param_groups
        part = self._part(now)
        stepped = {id(p) for g in now for p in g["params"]}
        for key, p in self._params:
            if id(p) in stepped and p.grad is not None:
                grads[key] = local(p.grad.detach())
        grads.update(self._bf16_images(grads))
        tensors = {key: g.to("cpu", copy=True) for key, g in grads.items()}
        order = part
        if self._pending is not None:  # another group of the same update (DeepSpeed's ZeRO)
            before, _, order = self._pending
            tensors = {**before, **tensors}
            order = (order or []) + (part or list(range(len(self._groups_all))))
        self._pending = (tensors, tree.encode(_groups(self._groups_all), tensors, "used/"),
                         order)

    def _part(self, now: list) -> Optional[list]:
        """The indices of the param groups ``now`` when the optimizer steps some of them alone
        (DeepSpeed's ZeRO 1/2 steps one group at a time, ``param_groups`` set to it); None
        when it steps them all."""
        every = self._groups_all
        if now is every:
            return None
        at = {id(g): i for i, g in enumerate(every)}
        if all(id(g) in at for g in now):
            return [at[id(g)] for g in now]
        self._groups_all = now  # (the list replaced: these are the optimizer's groups now)
        return None

    def _bf16_images(self, grads: dict) -> dict:
        """The float32 gradients of ``grads`` as their exact bfloat16 images (one check pass,
        at memory speed), or {} when one is not a bfloat16 value. Tried at every step while
        they are; after a step whose were not, at every 16th (a float32 model's never are)."""
        self._steps += 1
        fp32 = [key for key, g in grads.items() if g.dtype == torch.float32]
        if not fp32 or (self._bf16.fallbacks and self._steps % 16):
            return {}
        encoded = self._bf16.encode(dict(enumerate(grads[key] for key in fp32)))
        if encoded is None:
            return {}
        self._bf16.fallbacks = 0  # (they hold: tried at every step again)
        return {key: encoded[0][i] for i, key in enumerate(fp32)}

    def boundary(self, step: int, extra_state) -> None:
        """``save_checkpoint(step)``: the entry of this step (its update, if it ran: GradScaler
        may skip it), its digests queued behind the training work."""
        tensors, used, order = self._pending if self._pending is not None else ({}, None, None)
        self._pending = None
        rng = smallstate.capture_rng()
        small = {"model": smallstate.model_small(self.model, self.planned_ids, self._walks),
                 "scheduler": smallstate.scheduler_state(self.scheduler),
                 "rng": rng, "extra_state": extra_state}
        manifest = {"step": step, "stepped": used is not None, "groups_used": used,
                    "stepped_groups": order,
                    "groups_after": tree.encode(_groups(self._groups_all), tensors, "after/"),
                    "small": tree.encode(small, tensors, "small/",
                                         fresh=smallstate.fresh_ids(rng, {}))}
        if len(self.optimizer.state) != self._live_for:  # (states made at the first update)
            self._live = live_tensors(self.model, self.optimizer)
            self._live_for = len(self.optimizer.state)
        names = [n for n, _ in self._live]
        self._ticket = ticket = self.digester.submit([t for _, t in self._live])
        # (the digests are waited for on the log's thread, not here)
        if self._written is not None:  # a crash after this boundary loses one step at most
            self._written.wait()
        self._written = threading.Event()
        self.writer.write(step, tensors, manifest, self._first,
                          lambda: dict(zip(names, map(to_hex, ticket.pairs()))), self._written)
        self._first = False

    def committed(self, step: int) -> None:
        """A checkpoint of ``step`` is committed: its entries and older are not needed."""
        self.writer.prune(step)

    def close(self) -> None:
        """Finish writing what is queued and stop (twice: nothing more)."""
        if self.writer is not None:
            self.writer.close()
            self.digester.close()
            self.writer = None


# ------------------------------------------------------------------------------ the restart

class LogMismatch(CorruptCheckpointError):
    """A replayed step's state differs from the digests logged for it."""


def resume(root: Optional[str], restored: Restored, model, optimizer, scheduler,
           restore_rng: bool, map_location, reload: Callable[[], Restored]) -> Restored:
    """``gockpt.load``'s step log, after the checkpoint ``restored`` was loaded: the steps after
    it that every rank logged whole under the memory tier's ``root`` (None: none), replayed;
    or ``restored`` as it is (nothing logged), or ``reload()`` (the checkpoint loaded again
    over the replay) when the replay failed on some rank, with a warning. Every rank calls it
    alike (its gathers)."""
    rank = torch.distributed.get_rank() if several() else None
    entries, failed = [], None
    try:
        entries = read_log(root, restored.step, rank) if root is not None else []
    except Exception as exc:  # noqa: BLE001 -- unreadable: nothing to replay
        failed = exc
    # the steps every rank logged whole, of one run: DDP's replicas end each step with the
    # same state, so the same digests (entries a crashed run left behind on one rank differ);
    # FSDP2's ranks hold other shards: the same steps (each checked against its own digests)
    sharded = any(is_dtensor(p) for p in model.parameters()) or \
        getattr(model, "ranks_hold_their_own", False)
    keys = [json.dumps([m["step"], None if sharded else m["digests"]], sort_keys=True)
            for _, m, _ in entries]
    entries = entries[:common_prefix(keys)]
    replayed = None
    if entries:
        try:
            replayed = replay(entries, restored, model, optimizer, scheduler, restore_rng,
                              map_location)
        except Exception as exc:  # noqa: BLE001 -- anything: the checkpoint is a safe point
            failed = exc
    if not everyone(failed is None):
        why = failed if failed is not None else "it failed on another rank"
        warnings.warn(f"gockpt: the step log after step {restored.step} cannot be replayed "
                      f"({why}); resuming at the checkpoint of step {restored.step}",
                      RuntimeWarning, stacklevel=3)
        return reload() if entries else restored
    return replayed if replayed is not None else restored


def read_log(memory_root: str, step: int, rank: Optional[int] = None) -> List[tuple]:
    """The logged steps after ``step`` (the checkpoint a restart loaded), each read and checked
    whole: ``(path, manifest, tensors)`` up to the first missing or damaged entry (a warning
    says which was damaged). ``rank``: this rank's log on several ranks."""
    out = []
    for path in entries_after(log_root(memory_root, rank), step):
        try:
            manifest = read_manifest(path)
            tensors = reader.read_tensors(path, manifest, verify=True)
        except CorruptCheckpointError as exc:
            warnings.warn(f"gockpt: the step log's entry {path} is damaged ({exc}); the "
                          "replay stops before it", RuntimeWarning, stacklevel=3)
            break
        out.append((path, manifest, tensors))
    return out


def replay(entries: List[tuple], restored: Restored, model, optimizer, scheduler,
           restore_rng: bool, map_location) -> Optional[Restored]:
    """After ``restored`` (the checkpoint of step S) was loaded: run the logged steps S + 1,
    S + 2, ... (``entries``, from :func:`read_log`) through ``optimizer`` and restore the last
    one's small state, checked against its digests; what it restored (None: no entry).
    Raises CorruptCheckpointError (the caller loads S again) when a digest differs."""
    if not entries:
        return None
    params = dict(_gradients_of(model))
    # a model that stands for an engine (the DeepSpeed patch's EngineState): what its step
    # does beyond the optimizer's -- made ready for the replay, the weights after each update
    before = getattr(model, "before_replay", None)
    after = getattr(model, "after_replayed_step", None)
    if before is not None:
        before()
    try:
        with _without_step_hooks(optimizer):
            for path, manifest, tensors in entries:
                if manifest["stepped"]:
                    for key, p in params.items():
                        p.grad = _gradient(tensors.get(key), p, path, key)
                    _set_groups(optimizer, tree.decode(manifest["groups_used"], tensors))
                    _step(optimizer, manifest.get("stepped_groups"))
                    if after is not None:
                        after()
                _set_groups(optimizer, tree.decode(manifest["groups_after"], tensors))
    finally:
        for p in params.values():
            p.grad = None
    path, manifest, tensors = entries[-1]
    small = tree.decode(manifest["small"], tensors)
    with torch.no_grad():
        live = model.state_dict()
        own = Names(model).clean_all(live)
        for name, value in (small["model"] or {}).items():
            live[own[name]].copy_(value)
    rest = {"scheduler": small["scheduler"], "extra_state": small["extra_state"],
            **({"rng": small["rng"]} if restore_rng else {})}
    extra = apply_rest(rest, scheduler if small["scheduler"] is not None else None,
                       map_location)
    now = live_tensors(model, optimizer)
    got = dict(zip([n for n, _ in now], map(to_hex, as_pairs(digests([t for _, t in now])))))
    logged = manifest["digests"]
    if got != logged:
        wrong = sorted(n for n in set(got) | set(logged) if got.get(n) != logged.get(n))
        raise LogMismatch(f"{path}: the state replayed to step {manifest['step']} differs from "
                          f"its logged digests ({', '.join(wrong[:3])}"
                          f"{' ...' if len(wrong) > 3 else ''})")
    return Restored(step=manifest["step"], extra_state=extra, path=path,
                    manifest=restored.manifest, rng_restored=restore_rng, resharded=False)


def _gradient(logged: Optional[torch.Tensor], p: torch.Tensor, path: str, key: str):
    """The logged gradient ``logged`` as ``p``'s: on its device and dtype, and for a DTensor
    (FSDP2) the local shard on its mesh; a shard of another shape (the ranks resharded since)
    is a CorruptCheckpointError (the caller loads the checkpoint again)."""
    if logged is None:
        return None
    mine = local(p)
    if logged.shape != mine.shape:
        raise CorruptCheckpointError(f"{path}: {key} was logged as {tuple(logged.shape)}, this "
                                     f"rank holds {tuple(mine.shape)} (logged on other ranks)")
    return like(p, logged.to(mine.device, mine.dtype))


def _step(optimizer, order: Optional[list]) -> None:
    """``optimizer.step()``, or one step of each param group of ``order`` alone, as the logged
    update ran (DeepSpeed's ZeRO 1/2)."""
    if order is None:
        optimizer.step()
        return
    every = optimizer.param_groups
    try:
        for gi in order:
            optimizer.param_groups = [every[gi]]
            optimizer.step()
    finally:
        optimizer.param_groups = every


def _set_groups(optimizer, groups) -> None:
    for g, settings in zip(optimizer.param_groups, groups):
        g.update(settings)


@contextlib.contextmanager
def _without_step_hooks(optimizer):
    """The optimizer's own step, without the hooks registered on it (a Checkpointer's: the
    replay is not a training step)."""
    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    saved = (dict(pre), dict(post))
    pre.clear()
    post.clear()
    try:
        yield
    finally:
        pre.update(saved[0])
        post.update(saved[1])
