"""The optimizer state codec: how the small per-parameter state of an optimizer (Adam's step
counters) is gathered by key into columns when a checkpoint takes it
(:func:`gockpt.capture.smallstate.optimizer_small`), and put back in place when one is loaded."""

from __future__ import annotations


def expand_columns(small: dict) -> dict:
    """The per-parameter state of a decoded optimizer small section, with the gathered
    scalar columns (see gockpt.capture.smallstate.optimizer_small) put back in place as 0-dim
    tensors of their own."""
    state = small["state"]
    for key, groups in (small.get("columns") or {}).items():
        for group in groups:
            values = group["values"]
            if len(group["index"]) != values.numel():
                raise ValueError(f"scalar column {key!r}: {len(group['index'])} indices for "
                                 f"{values.numel()} values")
            for i, idx in enumerate(group["index"]):
                state.setdefault(idx, {})[key] = values[i].clone()
    return state
