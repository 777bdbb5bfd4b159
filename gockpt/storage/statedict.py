"""The model's and the optimizer's state dicts as a checkpoint stores them, for the tools that
hand them to other programs (``gockpt export``, the DeepSpeed export): what ``gockpt.load``
would restore, without a model or optimizer to restore it into."""

from __future__ import annotations

from ..core.errors import CorruptCheckpointError
from .manifest import Manifest


def model_state(path: str, m: Manifest, tensors: dict) -> tuple:
    """(state_dict, tied aliases) of the model; tied names share their canonical tensor."""
    try:
        small = m.small.decode("model", tensors)
        values = {name: ref.resolve(tensors) for name, ref in m.model.params.items()}
        values.update({a: values[c] for a, c in m.model.aliases.items()})  # tied: one tensor
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: manifest has no usable model section ({_one_line(exc)}); "
                            "is this a checkpoint written by gockpt.Checkpointer?") from None
    values.update(small)
    # Group names by owning module in order of first appearance (params come in optimizer
    # order, buffers after them): close to model.state_dict()'s order; load_state_dict ignores it.
    order = {}
    for name in list(m.model.params) + list(m.model.aliases) + list(small):
        order.setdefault(name.rsplit(".", 1)[0] if "." in name else "", len(order))
    names = sorted(values, key=lambda n: order[n.rsplit(".", 1)[0] if "." in n else ""])
    return {n: values[n] for n in names}, dict(m.model.aliases)


def optimizer_state(path: str, m: Manifest, tensors: dict) -> dict:
    """The optimizer's ``state_dict`` at F, its state in index order."""
    try:
        osd = m.optimizer_state_dict(path, tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: manifest has no usable optimizer section "
                            f"({_one_line(exc)})") from None
    state = osd["state"]
    return {"state": {i: state[i] for i in sorted(state)}, "param_groups": osd["param_groups"]}


def _one_line(exc) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
