"""What every load restores the same way, whatever shape it loads onto: the small state that
is not a tensor of the model or the optimizer (the scheduler's state, RNG states,
``extra_state``), decoded and checked before anything is changed, then put back; and what a
load returns (:class:`Restored`)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .capture import smallstate
from .core.errors import CorruptCheckpointError, GockptError, LoadError
from .storage.format import MANIFEST_FILE
from .storage.schema import Manifest


@dataclass
class Restored:
    """What :func:`gockpt.load` restored."""

    step: int
    """The user's step number at version F (what was passed to ``save_checkpoint``)."""
    extra_state: Any
    """The ``extra_state`` given at F, decoded (tensors come back as CPU tensors)."""
    path: str
    """The checkpoint directory that was loaded."""
    manifest: Manifest
    """The validated manifest (mode, K, metrics, ...) of the part whose small state was
    restored."""
    rng_restored: bool = False
    """Whether RNG states were restored: asked (``restore_rng``) and meaningful -- a rank's
    RNG states come back only on as many ranks as saved them."""
    resharded: bool = False
    """Whether the checkpoint was loaded onto another shape than the one that saved it
    (another number of ranks or another sharding: through DCP's planner)."""


def decode_rest(path: str, manifest: Manifest, tensors: dict, scheduler, with_rng: bool) -> dict:
    """The scheduler's state (if ``scheduler``), the RNG states (if ``with_rng``) and
    ``extra_state`` of the small state, decoded and checked against what takes them:
    section -> value. LoadError when a scheduler is given but none was saved;
    CorruptCheckpointError when a value does not decode."""
    out = {}
    try:
        if scheduler is not None:
            out["scheduler"] = manifest.small.decode("scheduler", tensors)
            if out["scheduler"] is None:
                raise LoadError(f"{path} holds no scheduler state; pass scheduler=None")
            if not isinstance(out["scheduler"], dict):
                raise ValueError("the scheduler state is not a dict")
        if with_rng:
            out["rng"] = manifest.small.decode("rng", tensors)
            smallstate.check_rng(out["rng"])
        out["extra_state"] = manifest.small.decode("extra_state", tensors)
    except GockptError:
        raise
    except Exception as exc:  # malformed values a writer of gockpt's never produces
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE}: the small state does not "
                                     f"decode: {type(exc).__name__}: {exc}") from exc
    return out


def apply_rest(rest: dict, scheduler, map_location):
    """Put back what :func:`decode_rest` decoded: the scheduler's state, the RNG states
    (when decoded); returns ``extra_state`` (its tensors moved to ``map_location``)."""
    if scheduler is not None:
        scheduler.load_state_dict(rest["scheduler"])
    if "rng" in rest:
        smallstate.restore_rng(rest["rng"])
    extra = rest["extra_state"]
    return extra if map_location is None else to_device(extra, torch.device(map_location))


@contextlib.contextmanager
def restoring(path: str):
    """Around putting a checked state into the live objects: what they refuse (or a decoder
    finds malformed) becomes a LoadError naming the checkpoint; gockpt's own errors pass."""
    try:
        yield
    except GockptError:
        raise
    except Exception as exc:
        raise LoadError(f"{path}: cannot restore this checkpoint into the given objects: "
                        f"{type(exc).__name__}: {exc}") from exc


def partly_overwritten(exc: CorruptCheckpointError) -> CorruptCheckpointError:
    """``exc`` (found while reading straight into the live model) saying what it left."""
    return CorruptCheckpointError(
        f"{exc}; the model's parameters may be partly overwritten: load an intact "
        "checkpoint (gockpt.load(..., tag=...)) before training on")


def warn_rng_not_restored(top: str, written: int, world: int, dcp_saved: bool = False) -> None:
    """The warning of a load asked to restore RNG states that it leaves alone: ``written``
    ranks saved them, ``world`` load (``dcp_saved``: DCP's save, which keeps none, wrote it).
    It names the user's line that asked for the load (the first frame outside gockpt:
    ``gockpt.load``'s caller, or the one of a patched DeepSpeed engine's ``load_checkpoint``)."""
    why = "was written by torch.distributed.checkpoint's save, which keeps no RNG states: " \
        "none were" if dcp_saved else f"was saved by {written} rank(s), loaded on {world}: " \
        "RNG states are per rank and were not"
    warnings.warn(f"gockpt: {top} {why} restored (seed them yourself; restore_rng=False says "
                  "so without this warning)", stacklevel=_frames_inside_gockpt() + 1)


def _frames_inside_gockpt() -> int:
    """How many frames from the caller's on lie in gockpt's package (warnings' stacklevel of
    the first one outside it, counted from the caller)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, n = sys._getframe(1), 0
    while frame is not None and not frame.f_code.co_filename.startswith("<") and \
            os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, n = frame.f_back, n + 1
    return n


def to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
