"""Where a logical tensor (a parameter, an aligned optimizer state tensor) lives among the
stored tensors of a checkpoint.

Most are stored whole, one stored tensor each. Two cases need more than a name:

* **packs**: small tensors of one role and dtype are stored back to back in one 1-D stored
  tensor (``pack/...``), so that thousands of small parameters cost one write and one manifest
  entry; the reference gives the element ``offset`` and the logical ``shape``;
* **memory layouts**: a tensor that is dense but not contiguous (``channels_last``, a
  transpose) is stored in memory order, as its permutation ``stored = logical.permute(dims)``,
  which is contiguous; loading permutes it back, restoring the strides;
* **shares**: replicas that split a replicated state each store a contiguous run of its
  elements in memory order (``extent`` [lo, hi)), flat, at element ``offset`` of the stored
  tensor; ``shape`` is then the whole tensor's (the part is put in place by whoever loads).

In the manifest a plain reference is just the stored tensor's name (the format of earlier
checkpoints); the others are objects ``{"tensor", "offset", "shape", "dims", "extent"}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class TensorRef:
    """One logical tensor: ``tensor`` (the stored name), at element ``offset`` of it with
    logical ``shape`` (None: the whole stored tensor), stored in memory order ``dims``; with
    ``extent`` (lo, hi), only those elements of it (in memory order) are stored here."""

    tensor: str
    offset: int = 0
    shape: Optional[Tuple[int, ...]] = None
    dims: Tuple[int, ...] = ()
    extent: Optional[Tuple[int, int]] = None

    def to_json(self):
        if self.offset == 0 and self.shape is None and not self.dims:
            return self.tensor
        out = {"tensor": self.tensor}
        if self.offset:
            out["offset"] = self.offset
        if self.shape is not None:
            out["shape"] = list(self.shape)
        if self.dims:
            out["dims"] = list(self.dims)
        if self.extent is not None:
            out["extent"] = list(self.extent)
        return out

    @property
    def stored_numel(self) -> Optional[int]:
        """How many elements of the stored tensor this reference covers (None: all of it)."""
        if self.shape is None:
            return None
        return self.extent[1] - self.extent[0] if self.extent is not None \
            else math.prod(self.shape)

    @classmethod
    def from_json(cls, x) -> Optional["TensorRef"]:
        """The reference encoded by ``x``; None if ``x`` is malformed (untrusted input)."""
        if isinstance(x, str):
            return cls(x)
        if not isinstance(x, dict) or not isinstance(x.get("tensor"), str) \
                or set(x) - {"tensor", "offset", "shape", "dims", "extent"}:
            return None
        offset, shape, dims = x.get("offset", 0), x.get("shape"), x.get("dims", [])
        extent = x.get("extent")
        if extent is not None and not (shape is not None and isinstance(extent, list)
                                       and len(extent) == 2 and all(map(_nat, extent))
                                       and extent[0] <= extent[1] <= math.prod(shape)):
            return None
        if not _nat(offset) or not isinstance(dims, list) or not all(map(_nat, dims)) \
                or (shape is not None and not (isinstance(shape, list)
                                               and all(map(_nat, shape)))):
            return None
        if dims and sorted(dims) != list(range(len(dims))):
            return None
        if dims and shape is not None and len(dims) != len(shape):
            return None
        return cls(x["tensor"], offset, None if shape is None else tuple(shape), tuple(dims),
                   None if extent is None else tuple(extent))

    def logical_shape(self, stored_shape: Sequence[int]) -> Tuple[int, ...]:
        """The tensor's shape, given the shape of the stored tensor it refers to."""
        if self.shape is not None:
            return self.shape
        return permuted(stored_shape, inverse(self.dims)) if self.dims else tuple(stored_shape)

    def check(self, stored_shape: Sequence[int]) -> Optional[str]:
        """What is wrong with this reference into a stored tensor of ``stored_shape``."""
        if self.shape is None:
            if self.offset:
                return "an offset without a shape"
            if self.dims and len(self.dims) != len(stored_shape):
                return f"dims {list(self.dims)} do not fit shape {list(stored_shape)}"
            return None
        if self.offset + self.stored_numel > math.prod(stored_shape):
            return (f"elements {self.offset}..{self.offset + self.stored_numel} lie beyond "
                    f"its {math.prod(stored_shape)} elements")
        return None

    def resolve(self, tensors: dict) -> torch.Tensor:
        """The logical tensor, a view of ``tensors[self.tensor]`` (checked references only);
        of a share (``extent``), its elements: flat, in memory order."""
        t = tensors[self.tensor]
        if self.extent is not None:
            return t.reshape(-1)[self.offset:self.offset + self.stored_numel]
        if self.shape is not None:
            mem = permuted(self.shape, self.dims) if self.dims else self.shape
            t = t.reshape(-1)[self.offset:self.offset + math.prod(self.shape)].view(mem)
        return t.permute(inverse(self.dims)) if self.dims else t


def permuted(shape: Sequence[int], dims: Sequence[int]) -> Tuple[int, ...]:
    return tuple(shape[d] for d in dims)


def inverse(dims: Sequence[int]) -> Tuple[int, ...]:
    out = [0] * len(dims)
    for i, d in enumerate(dims):
        out[d] = i
    return tuple(out)


def _nat(x) -> bool:
    return type(x) is int and x >= 0
