"""State-dict names without the prefixes that wrappers add.

``DistributedDataParallel`` / ``DataParallel`` put the model under ``module.``,
``torch.compile`` under ``_orig_mod.``, activation checkpointing under
``_checkpoint_wrapped_module.``, FSDP1 under ``_fsdp_wrapped_module.``. A checkpoint stores the
names the model has without them -- what ``torch.distributed.checkpoint.state_dict.
get_model_state_dict`` gives -- so that it loads into the wrapped and the unwrapped model alike.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
from torch import nn

#: Children that are always a wrapper's inner module (private names of torch's wrappers).
WRAPPED_CHILDREN = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
#: The wrappers whose child ``module`` is the module they wrap.
MODULE_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def is_wrapper_child(parent: nn.Module, child: str) -> bool:
    """Whether ``parent``'s submodule ``child`` is the module a wrapper wraps (its name is
    not part of the framework-independent names)."""
    if child == "module":
        return isinstance(parent, MODULE_WRAPPERS)
    return child in WRAPPED_CHILDREN


class Names:
    """Maps the state-dict names of ``model`` (wrapped or not) to the framework-independent
    ones and back. ``identity`` when the model has no wrapper (the common case: no work)."""

    def __init__(self, model: nn.Module):
        self._prefixes: Dict[str, str] = {}  # wrapped module path + "." -> unwrapped one
        self._walk(model, "", "")
        self.identity = all(k == v for k, v in self._prefixes.items())

    def _walk(self, module: nn.Module, wrapped: str, clean: str) -> None:
        self._prefixes[wrapped] = clean
        for name, child in module._modules.items():
            if child is None:
                continue
            inner = clean if is_wrapper_child(module, name) else clean + name + "."
            self._walk(child, wrapped + name + ".", inner)

    def clean(self, name: str) -> str:
        """The framework-independent name of the state-dict entry ``name``."""
        if self.identity:
            return name
        head, dot, leaf = name.rpartition(".")
        prefix = head + dot
        return self._prefixes.get(prefix, prefix) + leaf

    def clean_all(self, names: Iterable[str]) -> Dict[str, str]:
        """framework-independent name -> the model's own name, for each of ``names``."""
        return {self.clean(n): n for n in names}


def is_replicated(model: nn.Module) -> bool:
    """Whether ``model`` is a data-parallel replica (every rank holds the same state)."""
    return isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or (
        type(model).__name__ == "OptimizedModule"
        and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module)
        and is_replicated(model._orig_mod))
