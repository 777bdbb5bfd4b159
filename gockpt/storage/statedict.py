"""The model's and the optimizer's state dicts as a checkpoint stores them, for the tools that
hand them to other programs (``gockpt export``, the DeepSpeed export): what ``gockpt.load``
would restore, without a model or optimizer to restore it into."""

from __future__ import annotations

from ..core.errors import CorruptCheckpointError
from ..core.errors import LoadError
from ..core.optstate import expand_columns
from .schema import Manifest


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
        osd = optimizer_state_dict(m, path, tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: manifest has no usable optimizer section "
                            f"({_one_line(exc)})") from None
    state = osd["state"]
    return {"state": {i: state[i] for i in sorted(state)}, "param_groups": osd["param_groups"]}


def _one_line(exc) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def optimizer_state_dict(m: Manifest, path: str, tensors: dict, optimizer=None,
                     aligned: bool = True) -> dict:
    """The optimizer's ``state_dict`` at F from the small state and the aligned tensors
    (``aligned=False``: without the aligned tensors, to check the structure cheaply).

    With ``optimizer`` given, raises LoadError if its class, number of param groups or
    of parameters differs from the checkpoint's."""
    opt = m.optimizer
    if optimizer is not None and opt is not None and opt.cls \
            and opt.cls != type(optimizer).__name__:
        raise LoadError(f"{path}: saved with optimizer {opt.cls}, loading into "
                        f"{type(optimizer).__name__}")
    small = m.small.decode("optimizer", tensors)
    if optimizer is not None:
        n_live = sum(len(g["params"]) for g in optimizer.param_groups)
        n_saved = sum(len(g["params"]) for g in small["param_groups"])
        if n_live != n_saved or len(small["param_groups"]) != len(optimizer.param_groups):
            raise LoadError(f"{path}: the optimizer has {len(optimizer.param_groups)} "
                            f"groups / {n_live} parameters, the checkpoint "
                            f"{len(small['param_groups'])} / {n_saved}")
    state = expand_columns(small)
    if aligned and opt is not None:
        for idx, refs in opt.aligned.items():
            for key, ref in refs.items():
                t = ref.resolve(tensors)  # a packed one gets storage of its own
                state.setdefault(idx, {})[key] = t if ref.shape is None else t.clone()
    return {"state": state, "param_groups": small["param_groups"]}
