"""Reading a manifest: one parser of the untrusted JSON into :mod:`.schema`'s typed view,
strict (every field's type and every relation between entries checked before anyone uses it;
:class:`~gockpt.core.errors.CorruptCheckpointError` naming the checkpoint and the field) or
tolerant (a best-effort view for the tools that describe or check a damaged checkpoint, never
for restoring one); and finding this rank's part of a checkpoint written by several ranks.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Tuple

from ..core.digest import is_hex
from ..core.errors import CorruptCheckpointError, LoadError
from .manifest_file import read_manifest
from .refs import TensorRef
from .schema import (ABSENT, SMALL_SECTIONS, WRITTEN_BY_DCP, Manifest, ModelSection, OptimizerSection,
                     SmallSection, check_part_name, optim_tensor, pack_prefix)


def parse(path: str, data: dict, *, tolerant: bool = False) -> Manifest:
    """The typed view of a manifest read by :func:`gockpt.storage.read_manifest`.

    Strict: raises CorruptCheckpointError naming ``path`` and the field when a section is
    missing, malformed, or contradicts another (a manifest that is not gockpt's, or was
    damaged). ``tolerant``: raises nothing; ``step``, ``start_step``, ``mode``,
    ``overlap_steps``, ``rank`` and ``world_size`` are as found (None when absent),
    ``metrics`` None unless a dict, a malformed model section reads as empty, a malformed
    optimizer section as None (malformed ``aligned``: empty), a missing small section as
    :data:`~.schema.ABSENT`."""
    def bad(msg):
        return CorruptCheckpointError(f"checkpoint {path!r}: manifest: {msg}; is this a "
                                      "gockpt checkpoint?")

    def check(ok: bool, msg: str) -> bool:
        """Whether a field is usable: ``ok``, or raise (strict) / False (tolerant)."""
        if ok or tolerant:
            return ok
        raise bad(msg)

    for key in ("step", "start_step", "overlap_steps"):
        check(_is_int(data.get(key)), f"{key!r} is {data.get(key)!r:.40}, expected an int")
    check(isinstance(data.get("mode"), str), "'mode' is missing")
    for key in ("rank", "world_size"):
        check(key not in data or _is_int(data[key]),
              f"{key!r} is {data.get(key)!r:.40}, expected an int")
    check(isinstance(data.get("replicated", False), bool),
          f"'replicated' is {data.get('replicated')!r:.40}, expected true or false")
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    params, aliases = _refs(model.get("params")), model.get("aliases", {})
    if not check(params is not None and _str_map(aliases),
                 "the 'model' section is missing or malformed"):
        params = params or {}
        aliases = aliases if _str_map(aliases) else {}
    model_digests = _digests(model.get("digests", {}))
    if not check(model_digests is not None and set(model_digests) <= set(params),
                 "the model's 'digests' are malformed or name parameters it does not have"):
        model_digests = model_digests or {}
    slices = model.get("slices", {})
    if not check(_slices_fit(slices, params, data.get("tensors", {})),
                 "the model's 'slices' are malformed or do not fit the parameters they name"):
        slices = {}
    small = data.get("small") if isinstance(data.get("small"), dict) else {}
    check(all(s in small for s in SMALL_SECTIONS), "the 'small' section is missing or incomplete")
    optimizer = _optimizer(data.get("optimizer"), check)
    # (DCP's save: rank 0's part names every parameter with state, wherever it lies)
    if optimizer is not None and data.get("mode") != WRITTEN_BY_DCP and not check(
            set(optimizer.params.values()) <= set(params), "the optimizer's 'params' name "
            "parameters the model section does not store"):
        optimizer.params = {}
    m = Manifest(
        **{k: data.get(k, default) for k, default in
           (("step", None), ("start_step", None), ("mode", None), ("overlap_steps", None),
            ("rank", None if tolerant else 0), ("world_size", None if tolerant else 1),
            ("replicated", False))},
        model=ModelSection(params, dict(aliases), model_digests, dict(slices)),
        small=SmallSection(**{s: small.get(s, ABSENT) for s in SMALL_SECTIONS}),
        optimizer=optimizer, tensors=data.get("tensors", {}),
        metrics=data["metrics"] if isinstance(data.get("metrics"), dict) else
        (None if tolerant else {}))
    return m if tolerant else _checked(m, bad)


def _optimizer(opt, check) -> Optional[OptimizerSection]:
    """The optimizer section (None: none, or tolerantly unusable)."""
    if opt is None:
        return None
    aligned = _aligned(opt.get("aligned", {})) if isinstance(opt, dict) else None
    if not check(aligned is not None and isinstance(opt.get("class"), (str, type(None))),
                 "the 'optimizer' section is malformed"):
        if not isinstance(opt, dict):
            return None
        aligned = aligned or {}
    digests = _state_digests(opt.get("digests", {}))
    if not check(digests is not None and all(set(d) <= set(aligned.get(i, {}))
                                             for i, d in digests.items()),
                 "the optimizer's 'digests' are malformed or name state it does not store"):
        digests = digests or {}
    params = opt.get("params", {})
    if not check(isinstance(params, dict) and all(_is_index(i) and isinstance(n, str)
                                                  for i, n in params.items()),
                 "the optimizer's 'params' are malformed"):
        params = {}
    return OptimizerSection(opt.get("class") if isinstance(opt.get("class"), str) else "",
                            aligned, digests, {int(i): n for i, n in params.items()})


def _checked(self: Manifest, bad) -> Manifest:
    """Every reference must point into a stored tensor of its role (a parameter into its
    own ``model/<name>`` or a pack of parameters, a state tensor into its own
    ``optim/<index>/<key>`` or a pack of that key), within its bounds, and no two may
    share a byte: a swapped, duplicated or renamed reference is refused here, before
    anything is read."""
    spans: Dict[str, list] = {}
    for own, what, ref, (idx, key) in self.stored_refs():
        pack = pack_prefix(None if idx is None else key)
        entry = self.tensors.get(ref.tensor)
        if entry is None:
            raise bad(f"{what} refers to tensor {ref.tensor!r}, which is not stored")
        # whole: its own tensor; packed: a pack of its role; a share: either
        if not (ref.tensor == own if ref.shape is None else ref.tensor.startswith(pack)
                or ref.extent is not None and ref.tensor == own):
            raise bad(f"{what} refers to tensor {ref.tensor!r}; it is stored as {own!r} "
                      f"or in a {pack}* pack")
        problem = ref.check(entry["shape"])
        if problem:
            raise bad(f"{what}: reference into {ref.tensor!r}: {problem}")
        first = ref.offset if ref.shape is not None else 0
        n = ref.stored_numel
        spans.setdefault(ref.tensor, []).append(
            (first, first + (math.prod(entry["shape"]) if n is None else n), what))
    for tensor, taken in spans.items():
        taken.sort()
        for (_, end, what), (start, _, other) in zip(taken, taken[1:]):
            if start < end:
                raise bad(f"{what} and {other} share elements of stored tensor {tensor!r}")
    return self



def _slices_fit(slices, params: Dict[str, TensorRef], tensors) -> bool:
    """Whether ``slices`` (a part's ``model.slices``) gives each parameter it names a global
    shape and offsets where the stored shape fits (a parameter this part does not store --
    its replicas hold all of it -- an empty block at the offsets)."""
    if not isinstance(slices, dict):
        return False
    for name, s in slices.items():
        ref = params.get(name)
        if not isinstance(s, dict) or set(s) != {"shape", "offsets"}:
            return False
        shape, offsets = s["shape"], s["offsets"]
        if ref is None:  # not stored here: an empty block at its offsets
            lengths = [0] * len(offsets) if isinstance(offsets, list) else None
        elif ref.shape is not None:
            lengths = list(ref.shape)
        else:
            entry = tensors.get(ref.tensor) if isinstance(tensors, dict) else None
            lengths = entry.get("shape") if isinstance(entry, dict) else None
        if ref is not None and ref.shape is None and ref.dims and isinstance(lengths, list) \
                and len(lengths) == len(ref.dims):  # stored in memory order: the logical shape
            logical = [0] * len(lengths)
            for i, d in enumerate(ref.dims):
                logical[d] = lengths[i]
            lengths = logical
        if not all(isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)
                   for v in (shape, offsets, lengths)) \
                or not len(shape) == len(offsets) == len(lengths) \
                or any(o + n > d for o, n, d in zip(offsets, lengths, shape)):
            return False
    return True


def parts_of(path: str, data: dict) -> Optional[List[str]]:
    """The validated part names of a multi-rank checkpoint's manifest; None for one rank."""
    ranks = data.get("ranks")
    if ranks is None:
        return None
    if not isinstance(ranks, list) or not ranks:
        raise CorruptCheckpointError(f"checkpoint {path!r}: manifest 'ranks' is {ranks!r:.60}, "
                                     "expected a non-empty list of part directory names")
    return [check_part_name(path, p) for p in ranks]


def read(path: str, rank: Optional[int] = None, live_world: int = 1, live_rank: int = 0,
         target_replicated: bool = False) -> Tuple[str, Manifest]:
    """(directory, typed manifest) of the checkpoint at ``path``, or of one rank's part of it
    when several ranks wrote it: ``rank``'s when given (any world size: the caller chose),
    else the loading rank's (``live_rank`` of ``live_world`` ranks).

    The world size must be the one that wrote it -- unless the checkpoint records replicated
    state (each rank then reads part ``live_rank % parts``), or one rank wrote it and the
    target is a replica (``target_replicated``: every rank loads the whole state). Anything
    else is a LoadError: per-rank state is not resharded (yet), never guessed."""
    data = read_manifest(path)
    parts = parts_of(path, data)
    written = len(parts) if parts is not None else 1
    if rank is None:
        if live_world != written and not (data.get("replicated") is True
                                          or (written == 1 and target_replicated)):
            raise LoadError(
                f"{path} was written by {written} rank{'s' if written > 1 else ''} and holds "
                f"per-rank state; this job has {live_world}. Load it on {written} "
                f"rank{'s' if written > 1 else ''} (loading on another number of ranks needs "
                "the state to be replicated, e.g. DistributedDataParallel, or "
                "Config(replicated=True)), or pass rank=R to read one rank's part on purpose")
        rank = live_rank % written
    if parts is not None:
        if not _is_int(rank) or not rank < len(parts):
            raise LoadError(f"{path} has parts for ranks 0..{len(parts) - 1}; rank {rank!r} asked")
        path = os.path.join(path, parts[rank])
        data = read_manifest(path)
    return path, parse(path, data)


def _is_int(x) -> bool:
    return type(x) is int and x >= 0


def _is_index(x) -> bool:
    """An optimizer state index: an int, or its decimal string (JSON object keys)."""
    return isinstance(x, str) and x.isascii() and x.isdigit() or _is_int(x)


def _aligned(x) -> Optional[Dict[int, Dict[str, TensorRef]]]:
    """An optimizer section's ``aligned`` map with int indices; None if malformed. The format
    of earlier checkpoints lists only the keys, stored under :func:`optim_tensor` names."""
    if not isinstance(x, dict) or not all(_is_index(i) for i in x):
        return None
    out = {}
    for i, keys in x.items():
        if isinstance(keys, list) and all(isinstance(k, str) for k in keys):
            out[int(i)] = {k: TensorRef(optim_tensor(int(i), k)) for k in keys}
        else:
            refs = _refs(keys)
            if refs is None:
                return None
            out[int(i)] = refs
    return out


def _refs(x) -> Optional[Dict[str, TensorRef]]:
    """A map of names to references; None if malformed."""
    if not isinstance(x, dict):
        return None
    out = {k: TensorRef.from_json(v) for k, v in x.items() if isinstance(k, str)}
    return None if len(out) != len(x) or None in out.values() else out


def _digests(x) -> Optional[Dict[str, str]]:
    """A map of names to digests; None if malformed."""
    if not isinstance(x, dict) or not all(isinstance(k, str) and is_hex(v) for k, v in x.items()):
        return None
    return dict(x)


def _state_digests(x) -> Optional[Dict[int, Dict[str, str]]]:
    """An optimizer section's ``digests``: index -> key -> digest; None if malformed."""
    if not isinstance(x, dict) or not all(_is_index(i) for i in x):
        return None
    out = {int(i): _digests(d) for i, d in x.items()}
    return None if None in out.values() else out


def _str_map(x) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and isinstance(v, str)
                                       for k, v in x.items())
