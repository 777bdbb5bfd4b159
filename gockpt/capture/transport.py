"""How the replay modes carry gradients across the link (``Config.grad_transport``).

``fp32`` copies the consumed gradient as it is.  ``bf16`` copies a bfloat16 *image* of it and
one float32 multiplier per step: the replay consumes ``float(image) * multiplier``, one float
rounding, which is bit for bit the gradient the optimizer consumed wherever that gradient was
computed the same way -- bf16 gradients made float32 and multiplied once by an unscale/clip
coefficient (DeepSpeed's ZeRO 1/2 in bf16).  Whether it is, is checked on the device every
step (a pass at device memory speed, against the link's 2 bytes saved per element); a step
whose images do not give back every bit goes in fp32 instead.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Tuple

import torch

from .. import _C

log = logging.getLogger("gockpt")


class Bf16Transport:
    """Encodes one step's consumed gradients as bfloat16 images and one multiplier."""

    name = "bf16"

    def __init__(self, multiplier: Optional[Callable[[], Optional[torch.Tensor]]] = None,
                 says_fallback: bool = True):
        self.multiplier = multiplier
        self.fallbacks = 0  # steps carried in fp32 because the images were not exact
        self.says_fallback = says_fallback  # (the first fallback, at the info level)

    def encode(self, grads: Dict[int, torch.Tensor],
               ranges: Optional[Dict[int, Tuple[int, int]]] = None
               ) -> Optional[Tuple[Dict[int, torch.Tensor], float]]:
        """(slot -> bfloat16 image, the float32 multiplier as a Python float), or None when
        some gradient is not ``float(image) * multiplier`` bit for bit (carry it in fp32).

        ``ranges``: per slot, the elements ``[lo, hi)`` of its flat gradient that are copied
        (the blocks captured so far), for contiguous gradients: only those are made and
        checked, the rest of the image is left unwritten (a window's steps copy a growing
        part of each gradient; encoding all of it at every step cost DeepSpeed's flat
        partitions K - 1 full passes per window)."""
        if not grads:
            return {}, 1.0
        mul = self.multiplier() if self.multiplier is not None else None
        if mul is not None:
            mul = torch.as_tensor(mul).reshape(()).to(torch.float32)
        ranges = ranges or {}
        if all(g.device.type == "cpu" and g.is_contiguous() for g in grads.values()):
            return self._cpu_images(grads, mul, ranges)
        images, wrong = {}, []
        for si, g in grads.items():
            m = None if mul is None else mul.to(g.device)
            part = ranges.get(si) if g.is_contiguous() else None
            if part is not None:
                image = torch.empty(g.shape, dtype=torch.bfloat16, device=g.device)
                g, out = g.view(-1)[part[0]:part[1]], image.view(-1)[part[0]:part[1]]
                out.copy_((g if m is None else g / m).to(torch.bfloat16))
            else:
                image = out = (g if m is None else g / m).to(torch.bfloat16)
            back = out.float() if m is None else out.float() * m
            wrong.append((back.view(torch.int32) != g.view(torch.int32)).any())
            images[si] = image
        # one device read for the whole step (not one per tensor)
        if bool(torch.stack(wrong).any()):
            return self._fall_back()
        return images, 1.0 if mul is None else float(mul)

    def _cpu_images(self, grads: Dict[int, torch.Tensor], mul: Optional[torch.Tensor],
                    ranges: Dict[int, Tuple[int, int]]):
        """:meth:`encode` of CPU gradients: each image made and checked in one pass of gockpt's
        C++ core (``csrc/digest.cpp``; the same rounding and arithmetic as the torch ops a
        device runs, and the check is what makes an image valid), not six torch ops on the
        training thread."""
        m = 1.0 if mul is None else float(mul)
        images = {}
        for si, g in grads.items():
            image = torch.empty(g.shape, dtype=torch.bfloat16)
            lo, hi = ranges.get(si, (0, g.numel()))
            if not _C.bf16_images(g.data_ptr() + 4 * lo, image.data_ptr() + 2 * lo, hi - lo,
                                  mul is not None, m):
                return self._fall_back()
            images[si] = image
        return images, m

    def _fall_back(self) -> None:
        """This step's images are not exact: it goes in fp32 (said once)."""
        self.fallbacks += 1
        if self.fallbacks == 1 and self.says_fallback:
            log.info("gockpt: a step's gradients are not bf16 values times one scale; "
                     "carried in fp32 (grad_transport='bf16' falls back per step)")

