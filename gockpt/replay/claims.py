"""Which state tensors each arithmetic profile reproduces bit for bit, and under which
conditions: the replay's claims, per tensor.

A checkpoint needs every byte equal to the live state at F, not every tensor replayed: where a
profile reproduces the moments (``exp_avg``, ``exp_avg_sq``: 8 of the 12 bytes per parameter)
but not the parameter line, the moments are replayed over the window and the parameter is
copied at F.  A moment that reads the parameter (Adam's L2 term ``grad + weight_decay *
param``) is only as exact as the parameter, so without an exact parameter line it is not
claimed either.  Facts and their proofs: docs/arithmetics.md.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

#: The state tensors an update writes, in the order ``replay_step`` takes them.
STATE_TENSORS = ("param", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")

_FAST_MATH = ("DeepSpeed builds its CUDA FusedAdam with --use_fast_math: the parameter line "
              "divides with div.approx.ftz.f32 and takes sqrt.approx.ftz.f32 (hardware "
              "approximations that are not specified bit for bit)")
_LANES = ("torch's fused CUDA kernel with weight_decay != 0 is proven for numel % 4 == 0 only "
          "(its vector path; the weight-decay line rounds differently per vector lane)")


def moments_weight_decay(decoupled: bool, weight_decay: float) -> float:
    """The weight decay a replay of the moments alone is run with: AdamW's decoupled decay
    acts on the parameter line only (the moments are the same without it, and a kernel whose
    parameter line is unproven for this element count then takes them); Adam's L2 term adds
    the parameter to the gradient and stays."""
    return 0.0 if decoupled else weight_decay


def replay_claims(arithmetic: str, numel: Optional[int] = None,
                  weight_decay: float = 0.0) -> Dict[str, Optional[str]]:
    """Per state tensor (``STATE_TENSORS``): None when the profile ``arithmetic`` reproduces
    it bit for bit for a parameter of ``numel`` elements (None: any) and this
    ``weight_decay``, else why not.  The profile name is not checked here (``replay_step``
    refuses unknown ones)."""
    device, source, optimizer, impl = (arithmetic.split("/") + ["", "", "", ""])[:4]
    param: Optional[str] = None
    if (device, source) == ("cuda", "deepspeed"):
        param = _FAST_MATH
    elif (device, source, impl) == ("cuda", "torch", "fused") and weight_decay != 0.0 \
            and (numel is None or numel % 4 != 0):
        param = _LANES if numel is not None else _LANES + "; the element count is not known"
    if param is None:
        return dict.fromkeys(STATE_TENSORS)
    reads_param = weight_decay != 0.0 and (
        optimizer == "Adam" or impl == "adam_w_mode=False")  # L2: grad + wd * param
    moments = None if not reads_param else (
        f"its moments read the parameter (L2 weight decay: grad + weight_decay * param), "
        f"whose update is not reproduced ({param})")
    return {"param": param, "exp_avg": moments, "exp_avg_sq": moments}


def claimed(arithmetic: str, numel: Optional[int] = None,
            weight_decay: float = 0.0) -> Tuple[str, ...]:
    """The state tensors :func:`replay_claims` claims, in ``STATE_TENSORS`` order."""
    claims = replay_claims(arithmetic, numel, weight_decay)
    return tuple(t for t in STATE_TENSORS if claims[t] is None)


def check_tensors(arithmetic: str, tensors, numel: int, weight_decay: float) -> Tuple[str, ...]:
    """The state tensors a replay asked for (``tensors``; None: all three), checked against
    the claims: ValueError naming each one not claimed, with why.  The moments go together
    (each reads the same gradient; neither is worth replaying alone)."""
    wanted = STATE_TENSORS if tensors is None else tuple(tensors)
    unknown = [t for t in wanted if t not in STATE_TENSORS]
    if unknown or not wanted:
        raise ValueError(f"tensors must name some of {STATE_TENSORS}, got {tensors!r}")
    if set(wanted) not in (set(STATE_TENSORS), set(MOMENTS)):
        raise ValueError(f"tensors must be {STATE_TENSORS} or the moments {MOMENTS}, got "
                         f"{tensors!r}")
    claims = replay_claims(arithmetic, numel, weight_decay)
    refused = [f"{t}: {claims[t]}" for t in wanted if claims[t] is not None]
    if refused:
        ok = claimed(arithmetic, numel, weight_decay)
        hint = f"; replay only {ok} (tensors={ok!r}) and copy the rest" if ok else \
            "; nothing of it is replayed: copy the state at F"
        raise ValueError(f"{arithmetic} does not reproduce bit for bit " +
                         "; ".join(refused) + hint)
    return tuple(t for t in STATE_TENSORS if t in wanted)
