"""Checking committed checkpoints without loading them: every block checksum of every tensor,
the digests of the parameters and optimizer state against those of the live tensors at F,
that the manifest's references resolve and the small state decodes, and, for a checkpoint
written by several ranks, that every listed part is there and consistent with the others.

:func:`verify` never stops at the first problem: it reports each bad tensor (with its file),
each missing or unreadable part and each other problem, as a :class:`VerifyReport`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from ..core.digest import as_pairs, digests, to_hex
from ..core.errors import CheckpointNotFoundError, CorruptCheckpointError
from ..core.paths import directory_to_read, is_remote, shown
from .commit import is_committed, list_checkpoints, resolve
from .manifest import parse as parse_manifest, parts_of
from .schema import ABSENT, SMALL_SECTIONS, Manifest, is_small_tensor
from .index import index_problems
from .shares import coverage_problems
from .manifest_file import read_manifest
from .reader import read_tensors

__all__ = ["verify", "VerifyReport", "CheckpointReport", "PartReport", "BadTensor",
           "MissingPart", "Part", "read_parts", "world_size_problems"]


@dataclass
class BadTensor:
    """A tensor whose data does not verify (checksum mismatch, truncated or unreadable file)."""

    tensor: str
    file: str
    """Its data file, relative to the checkpoint (``rank-00001/data.safetensors`` in a part)."""
    error: str
    """What is wrong, one line naming the checkpoint, file and tensor."""
    rank: Optional[int] = None
    """The rank whose part holds it (None: a single-rank checkpoint)."""


@dataclass
class MissingPart:
    """A part listed by a multi-rank checkpoint's manifest that is missing or unreadable."""

    rank: int
    part: str
    error: str


@dataclass
class PartReport:
    """The result for one rank's part of a checkpoint written by several ranks."""

    rank: int
    name: str
    path: str
    ok: bool = False
    tensors: int = 0
    """Tensors that verified."""
    bytes: int = 0
    """Bytes of the tensors that verified."""
    bad: int = 0
    problems: int = 0
    error: Optional[str] = None
    """Why the part could not be checked (it is missing or its manifest unreadable)."""


@dataclass
class CheckpointReport:
    """The result for one checkpoint."""

    path: str
    step: Optional[int] = None
    """The checkpoint's step (None if its manifest, or a data file it points into, is
    unreadable)."""
    tensors: int = 0
    """Tensors that verified (over all parts)."""
    bytes: int = 0
    bad: List[BadTensor] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    """Everything else that is wrong: an unreadable manifest, a reference to a missing tensor,
    small state that does not decode, parts that disagree with the checkpoint."""
    world_size: Optional[int] = None
    """Number of parts of a checkpoint written by several ranks (None: one rank, or the list
    of parts is malformed)."""
    parts: Optional[List[PartReport]] = None
    """One per listed part, in rank order; None for a single-rank checkpoint."""
    missing: List[MissingPart] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether everything verified."""
        return not self.bad and not self.problems and not self.missing

    def to_json(self) -> dict:
        """Plain JSON data (the multi-rank fields only for a multi-rank checkpoint)."""
        out = {"path": self.path, "step": self.step, "ok": self.ok, "tensors": self.tensors,
               "bytes": self.bytes, "bad": [_drop_none(asdict(b), "rank") for b in self.bad],
               "problems": list(self.problems)}
        if self.parts is not None:
            out.update(world_size=self.world_size,
                       parts=[_drop_none(asdict(p), "error") for p in self.parts],
                       missing=[asdict(m) for m in self.missing])
        return out


@dataclass
class VerifyReport:
    """What :func:`verify` found: one :class:`CheckpointReport` per checkpoint checked."""

    checkpoints: List[CheckpointReport]

    @property
    def ok(self) -> bool:
        """Whether every checkpoint verified."""
        return all(c.ok for c in self.checkpoints)


def verify(path: str, *, all: bool = False) -> VerifyReport:
    """Check a committed checkpoint without loading it, and report everything wrong with it.

    ``path`` is a checkpoint directory, or a run directory (then its latest checkpoint, as
    :func:`gockpt.load` picks it); with ``all=True``, a run directory whose committed
    checkpoints are all checked, oldest first. Every tensor's block checksums are verified
    (one tensor at a time: a bad one does not hide the next), then that the parameters and
    optimizer state the manifest names exist and that the small state decodes. A checkpoint
    written by several ranks is checked part by part; a listed part that is missing or
    unreadable is reported in :attr:`CheckpointReport.missing`.

    Damage is reported, not raised: check :attr:`VerifyReport.ok`. Raises
    ``CheckpointNotFoundError`` only if ``path`` holds no committed checkpoint. ``path`` is
    resolved as ``gockpt.load`` resolves it (:mod:`gockpt.core.paths`).
    """
    path = directory_to_read(path)
    if all:
        if not is_remote(path) and not os.path.isdir(path):
            raise CheckpointNotFoundError(f"{path}: not a directory")
        names = list_checkpoints(path)
        if not names:
            raise CheckpointNotFoundError(f"{path}: no committed checkpoints to verify")
        paths = [os.path.join(path, n) for n in names]
    else:
        paths = [path if is_committed(path) else resolve(path)]
    return VerifyReport([_verify_checkpoint(p) for p in paths])


# ---------------------------------------------------------------------------------- parts


@dataclass
class Part:
    """One part of a checkpoint written by several ranks, as its top-level manifest lists it."""

    rank: int
    name: str
    path: str
    """Absolute path of the part's directory."""
    data: Optional[dict]
    """The part's manifest (:func:`~gockpt.storage.read_manifest`); None if missing or
    unreadable."""
    error: Optional[str] = None
    """Why ``data`` is None."""
    problems: List[str] = field(default_factory=list)
    """Where the part disagrees with the checkpoint (rank, world size, step)."""


def read_parts(path: str, data: dict) -> Optional[List[Part]]:
    """The parts of the checkpoint at ``path`` whose manifest is ``data``, each with its own
    manifest read and checked against the checkpoint; None for a single-rank checkpoint.

    Raises CorruptCheckpointError if the manifest's list of parts is malformed."""
    names = parts_of(path, data)
    if names is None:
        return None
    top = parse_manifest("", tolerant=True, data=data)
    out = []
    for r, name in enumerate(names):
        part = Part(r, name, shown(os.path.join(path, name)), None)
        try:
            part.data = read_manifest(part.path)
        except CheckpointNotFoundError:
            part.error = f"directory {name}/ does not exist"
        except CorruptCheckpointError as exc:
            part.error = _one_line(exc)
        else:
            part.problems = _part_problems(part, top, len(names))
        out.append(part)
    return out


def _part_problems(part: Part, top: Manifest, world: int) -> List[str]:
    m, name, problems = parse_manifest("", tolerant=True, data=part.data), part.name, []
    if _is_multi(part.path, part.data):
        problems.append(f"{name}: is itself a multi-rank checkpoint")
    if m.rank not in (None, part.rank):
        problems.append(f"{name}: its manifest says rank {m.rank!r}, listed as rank {part.rank}")
    if m.world_size not in (None, world):
        problems.append(f"{name}: its manifest says world_size {m.world_size!r}, the checkpoint "
                        f"has {world} parts")
    if top.step is not None and m.step != top.step:
        problems.append(f"{name}: step {m.step!r}, the checkpoint's step is {top.step!r}")
    return problems


def world_size_problems(data: dict, parts: List[Part]) -> List[str]:
    """What is wrong with a multi-rank checkpoint's own manifest ``data`` given its parts."""
    ws = parse_manifest("", tolerant=True, data=data).world_size
    if ws is not None and ws != len(parts):
        return [f"manifest world_size is {ws!r} but it lists {len(parts)} parts"]
    return []


# ---------------------------------------------------------------------------------- checks


def _verify_checkpoint(path: str, *, parts: bool = True, share: bool = False
                       ) -> CheckpointReport:
    """Check ``path`` (a multi-rank checkpoint part by part, unless ``parts=False``; ``share``:
    a part that holds a share of its replicas' state)."""
    report = CheckpointReport(shown(path))
    try:
        data = read_manifest(path)
    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
        report.problems.append(_one_line(exc))
        return report
    m = parse_manifest("", tolerant=True, data=data)
    report.step = m.step
    if parts and _is_multi(path, data):
        _verify_parts(path, data, report)
        return report
    small = _verify_tensors(path, m, report)
    report.problems += _reference_problems(m, share)
    report.problems += _small_problems(m, {b.tensor for b in report.bad}, small)
    return report


def _verify_tensors(path: str, m: Manifest, report: CheckpointReport) -> dict:
    """Read and checksum every tensor into ``report``, and check the digests of the
    parameters and optimizer state tensors stored in it; returns the small-state tensors."""
    small = {}
    by_tensor: dict = {}
    for check in m.digest_checks():
        entry = m.tensors.get(check[1].tensor)
        if isinstance(entry, dict) and check[1].check(entry["shape"]) is None:
            by_tensor.setdefault(check[1].tensor, []).append(check)  # else a reference problem
    for name, e in m.tensors.items():
        try:
            t = read_tensors(path, m, names=[name], verify=True)[name]
        except CorruptCheckpointError as exc:
            report.bad.append(BadTensor(name, e["file"], _one_line(exc)))
            continue
        except OSError as exc:
            report.bad.append(BadTensor(name, e["file"], f"cannot read: {_one_line(exc)}"))
            continue
        wrong = _digest_mismatches(m, name, t, by_tensor.get(name, []))
        if wrong:
            report.bad.append(BadTensor(
                name, e["file"], f"checkpoint {path!r}: tensor {name!r}: {', '.join(wrong[:5])}"
                f"{' and others' if len(wrong) > 5 else ''} differ from the live state at step "
                f"{m.step} (their digest; the checksums match)"))
            continue
        report.tensors += 1
        report.bytes += e["nbytes"]
        if is_small_tensor(name):
            small[name] = t
    return small


def _digest_mismatches(m: Manifest, name: str, t, checks) -> List[str]:
    """What of ``checks`` (refs into stored tensor ``name``, read as ``t``) does not match
    the digest recorded at F."""
    if not checks:
        return []
    got = as_pairs(digests([ref.resolve({name: t}) for _, ref, _ in checks]))
    return [what for (what, _, want), pair in zip(checks, got) if to_hex(pair) != want]


def _reference_problems(m: Manifest, share: bool) -> List[str]:
    """Parameters, tied aliases and optimizer state that name tensors or parameters that the
    checkpoint does not have."""
    refs = [(f"parameter {p!r}", r) for p, r in m.model.params.items()]
    for idx, by_key in (m.optimizer.aligned if m.optimizer else {}).items():
        refs += [(f"optimizer state [{idx}][{k!r}]", r) for k, r in by_key.items()]
    problems = []
    for what, r in refs:
        entry = m.tensors.get(r.tensor)
        why = "is missing" if entry is None else r.check(entry["shape"])
        if why:
            problems.append(f"{what}: its reference into tensor {r.tensor!r}: {why}")
    if not share:  # (a share's aliases: checked across the shares, _verify_parts)
        problems += _alias_problems([m])
    return problems


def _alias_problems(parts: List[Manifest]) -> List[str]:
    """Tied aliases whose parameter none of ``parts`` holds (a replica's share holds the
    aliases of every parameter, some of them in another rank's share)."""
    held = {name for m in parts for name in m.model.params}
    return sorted({f"tied alias {a!r} refers to unknown parameter {c!r}"
                   for m in parts for a, c in m.model.aliases.items() if c not in held})


def _small_problems(m: Manifest, bad: set, small: dict) -> List[str]:
    """Small-state sections that do not decode (those holding a bad tensor are skipped: it is
    reported already)."""
    problems = []
    for section in SMALL_SECTIONS:
        if getattr(m.small, section) is ABSENT or bad & set(m.small.tensor_refs(section)):
            continue
        try:
            m.small.decode(section, small)
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"small/{section} does not decode: {_one_line(exc)}")
    return problems


def _verify_parts(path: str, data: dict, report: CheckpointReport) -> None:
    """Verify every part into ``report``: bad tensors are named with their part (``file`` is
    ``rank-00001/data.safetensors``, ``rank`` 1); a listed part whose directory or manifest is
    gone or unreadable is a missing part."""
    report.parts = []
    try:
        parts = read_parts(path, data)
    except CorruptCheckpointError as exc:
        report.problems.append(_one_line(exc))
        return
    report.world_size = len(parts)
    report.problems += world_size_problems(data, parts)
    for part in parts:
        row = PartReport(part.rank, part.name, part.path)
        report.parts.append(row)
        if part.data is None:
            row.error = part.error
            report.missing.append(MissingPart(part.rank, part.name, part.error))
            continue
        sub = _verify_checkpoint(part.path, parts=False, share=data.get("shares") is True)
        report.bad += [BadTensor(b.tensor, f"{part.name}/{b.file}", b.error, part.rank)
                       for b in sub.bad]
        problems = part.problems + [f"{part.name}: {x}" for x in sub.problems]
        report.problems += problems
        report.tensors += sub.tensors
        report.bytes += sub.bytes
        row.ok, row.tensors, row.bytes = sub.ok and not part.problems, sub.tensors, sub.bytes
        row.bad, row.problems = len(sub.bad), len(problems)
    if ("index" in data or data.get("shares") is True) \
            and all(p.data is not None for p in parts):
        try:  # (a part's own problems are reported above)
            manifests = [parse_manifest(p.path, p.data) for p in parts]
            if "index" in data:  # the global index: each tensor's slices cover it once
                report.problems += index_problems(data["index"], manifests)
            if data.get("shares") is True:  # the shares: each element of each tensor once
                report.problems += coverage_problems(manifests) + _alias_problems(manifests)
        except CorruptCheckpointError as exc:
            report.problems.append(_one_line(exc))


def _is_multi(path: str, data: dict) -> bool:
    """Whether ``data`` is the manifest of a checkpoint written by several ranks (a malformed
    list of parts counts: it is reported when the parts are read)."""
    try:
        return parts_of(path, data) is not None
    except CorruptCheckpointError:
        return True


def _drop_none(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key or v is not None}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
