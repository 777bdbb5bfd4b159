"""Optimizer adapters: one per optimizer arithmetic the replay reproduces bitwise.

An adapter refuses, at attach time, any setting it cannot reproduce exactly; at each optimizer
step it turns the live param groups and state into plain scalars (:mod:`gockpt.core.records`);
and it applies a recorded step to a block of the host copy through the C++ kernel
(:mod:`.arithmetic`).

torch's Adam and AdamW are adapted here. Other optimizers plug in through the entry point group
``gockpt.optimizer_adapters``: the entry's name is the optimizer class's qualified name
(``module.Class``), its value an adapter class taking ``(optimizer, refuse)`` -- how gockpt's
own DeepSpeed integration registers DeepSpeed's FusedAdam (setup.py), without the core naming
it. An entry is loaded only when an optimizer of its class is attached.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Dict, Mapping, Optional

import numpy as np
import torch

from .. import _tensors
from ..core.lists import has_none
from ..core.memory import is_dtensor, local
from ..core.modes import NO_REPLAY_MODES
from ..core.errors import UnsupportedOptimizerError
from . import arithmetic
from .probe import probe
from ..core.plan import Plan
from ..core.records import GroupScalars, Kernel, StepCounts, StepRecord
from .claims import moments_weight_decay, replay_claims


log = logging.getLogger("gockpt")


#: Values read as they are (immutable): a change of one is a change of its param group's dict.
_PLAIN_NUMBERS = (float, int, bool)


def _refuse(optimizer, why: str):
    modes = ", ".join(NO_REPLAY_MODES)
    raise UnsupportedOptimizerError(
        f"{type(optimizer).__name__}: {why}. The gockpt modes replay optimizer steps and only "
        "do so where the replay is bitwise exact (torch.optim.Adam/AdamW with float lr and "
        "betas, no amsgrad/maximize/capturable/differentiable, float32 parameters). Use one of "
        f"the modes that need no replay: {modes}.")


class AdamAdapter:
    """torch.optim.Adam and torch.optim.AdamW on float32 tensors, in every implementation:
    on the CPU torch's single-tensor (default), foreach and fused kernels; on a CUDA GPU its
    for-loop, foreach (default) and fused kernels (torch >= 2.11; docs/arithmetics.md)."""

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, optimizer: torch.optim.Optimizer):
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            _refuse(optimizer, "no bitwise replay exists for this optimizer class")
        self.optimizer = optimizer
        self.device = _device_of(optimizer)
        self._not_replayed: Dict[int, str] = {}  # id(param) -> why (see params_not_replayed)
        self._steps = _tensors.DictValues("step")  # (each dict looked up again once changed)
        self._groups_seen = _tensors.DictVersions()  # (the param groups of the last scalars())
        self._scalars: Optional[Dict[int, GroupScalars]] = None
        self._like = next((p for g in optimizer.param_groups for p in g["params"]
                           if is_dtensor(p)), None)  # FSDP2: the probe steps DTensors
        for gi, g in enumerate(optimizer.param_groups):
            for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
                if g.get(flag, False):
                    _refuse(optimizer, f"param group {gi} sets {flag}=True")
            for key in ("lr", "eps", "weight_decay"):
                if isinstance(g.get(key), torch.Tensor):
                    _refuse(optimizer, f"param group {gi} has a tensor {key}")
            if any(isinstance(b, torch.Tensor) for b in g["betas"]):
                _refuse(optimizer, f"param group {gi} has tensor betas")
            for p in g["params"]:
                if p.dtype != torch.float32:
                    _refuse(optimizer, f"a parameter of group {gi} is {p.dtype}, not float32")
        if self.device.type == "cuda":
            self._check_cuda()
        elif self.device.type == "cpu":
            ok, reason = arithmetic.exactness_supported()
            if not ok:
                _refuse(optimizer, f"this torch build cannot be replayed exactly ({reason})")
        else:
            _refuse(optimizer, f"no replay arithmetic is proven for {self.device.type} tensors")
        for gi, sc in self.scalars().items():
            if not probe(type(optimizer), sc, self.device, like=self._like):
                _refuse(optimizer, f"a probe replay of param group {gi}'s settings ({sc}) "
                                   f"differs from torch {torch.__version__} on "
                                   f"{_device_name(self.device)}")

    def _check_cuda(self) -> None:
        """What the CUDA profiles are proven for (docs/arithmetics.md), refused otherwise."""
        version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        for gi, (g, sc) in enumerate(zip(self.optimizer.param_groups, self.scalars().values())):
            if sc.impl is Kernel.CUDA_FUSED and version < (2, 11):
                _refuse(self.optimizer, f"param group {gi}: torch {torch.__version__}'s fused "
                                        "CUDA kernel computes in double (proven: torch >= 2.11)")
            if sc.impl in (Kernel.CUDA_FORLOOP, Kernel.CUDA_FOREACH) and not sc.beta1 > 0.5:
                _refuse(self.optimizer, f"param group {gi}: beta1 <= 0.5 takes a lerp branch "
                                        "with no proof on CUDA")
            if sc.impl is Kernel.CUDA_FUSED and sc.weight_decay != 0.0:
                odd = [p for p in g["params"] if local(p).numel() % 4]
                if odd and not sc.decoupled:  # Adam's moments read the parameter (L2)
                    _refuse(self.optimizer, f"param group {gi}: fused CUDA Adam with weight "
                                            "decay is proven for parameters of numel % 4 == 0; "
                                            f"shapes {[tuple(p.shape) for p in odd[:3]]} are "
                                            "not (use foreach=True for that group, or AdamW)")
                if odd and not probe(type(self.optimizer), sc, self.device,
                                     moments_only=True, like=self._like):
                    _refuse(self.optimizer, f"param group {gi}: a probe replay of the moments "
                                            "of fused CUDA AdamW at an odd element count "
                                            f"differs on {_device_name(self.device)}")
                self._not_replayed.update(
                    (id(p), replay_claims("cuda/torch/AdamW/fused", local(p).numel(),
                                          sc.weight_decay)["param"]) for p in odd)

    def params_not_replayed(self) -> Dict[int, str]:
        """``id(parameter)`` -> why its update is not reproduced bit for bit, for the
        parameters whose moments are (a checkpoint copies such a parameter at F and replays
        its moments: torch's fused CUDA AdamW with weight decay at numel % 4 != 0)."""
        return dict(self._not_replayed)

    def scalars(self) -> Dict[int, GroupScalars]:
        """The scalars every group's update uses right now (call inside the step pre-hook):
        those of the last call where the param groups are the very dicts then, none changed
        since, and every value read was a plain number (a tensor's value may change in place)."""
        groups = self.optimizer.param_groups
        unchanged = self._groups_seen.same(groups)  # (notes them as they are before the read)
        if unchanged and self._scalars is not None:
            return dict(self._scalars)
        out = self._read_scalars()
        plain = all(type(g[k]) in _PLAIN_NUMBERS for g in groups
                    for k in ("lr", "eps", "weight_decay")) and \
            all(type(g["betas"]) is tuple and all(type(b) in _PLAIN_NUMBERS for b in g["betas"])
                for g in groups)
        self._scalars = out if plain else None
        return out

    def _read_scalars(self) -> Dict[int, GroupScalars]:
        out = {}
        cuda = self.device.type == "cuda"
        for gi, g in enumerate(self.optimizer.param_groups):
            foreach = g.get("foreach")
            if foreach is None:  # torch's default: foreach on CUDA, single-tensor on the CPU
                foreach = cuda
            if g.get("fused"):
                impl = Kernel.CUDA_FUSED if cuda else Kernel.FUSED
            elif foreach:
                impl = Kernel.CUDA_FOREACH if cuda else Kernel.FOREACH
            else:
                impl = Kernel.CUDA_FORLOOP if cuda else Kernel.SINGLE
            decoupled = bool(g.get("decoupled_weight_decay",
                                   isinstance(self.optimizer, torch.optim.AdamW)))
            out[gi] = GroupScalars(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                                   float(g["eps"]), float(g["weight_decay"]), impl, decoupled)
        return out

    def step_count(self, param: torch.Tensor) -> float:
        """t of the update about to run on ``param`` (torch increments before using it)."""
        return self.step_counts({0: param}, [self.optimizer.state.get(param)])[0]

    def step_counts(self, slots, states) -> Mapping[int, float]:
        """t of the update about to run, for every slot in ``slots`` whose optimizer state is
        ``states[slot]`` (None: none yet): the step counters read on the CPU in one C++ pass
        (:class:`gockpt._tensors.DictValues`: a state dict not changed since the last step is
        not looked up again), elsewhere with one stack, not one read (a device
        synchronisation on a GPU) each."""
        if not isinstance(slots, (list, np.ndarray)):
            slots = list(slots)
        counts = self._steps.scalar_floats(states, 0.0, slots)  # (usual: on the CPU)
        if counts is not None:  # (+1 where the replay thread reads them: not a numpy op here)
            return StepCounts(slots, counts, plus=1.0)
        slots = slots.tolist() if isinstance(slots, np.ndarray) else slots
        steps = _tensors.values(list(map(states.__getitem__, slots)), "step")
        out = dict.fromkeys(slots, 1.0)
        if has_none(steps):  # no state yet (their first update)
            slots = [si for si, t in zip(slots, steps) if t is not None]
            steps = [t for t in steps if t is not None]
        if steps:
            stacked = _tensors.stack_scalars(steps)
            if stacked is None:
                stacked = torch.stack(steps)
            counts = stacked.to("cpu", torch.float64).reshape(-1).numpy()
            out.update(zip(slots, (counts + 1.0).tolist()))
        return out

    def close(self) -> None:
        """Nothing to undo (the DeepSpeed adapter removes its step hook here)."""

    def skipped_by_scaler(self) -> bool:
        """A fused step with GradScaler's found_inf set returns before touching any state."""
        found_inf = getattr(self.optimizer, "found_inf", None)
        return found_inf is not None and float(found_inf) != 0.0

    def unsupported_step(self) -> Optional[str]:
        """Why the step about to run cannot be replayed (None if it can)."""
        if getattr(self.optimizer, "grad_scale", None) is not None:
            return ("the fused optimizer is unscaling gradients itself (GradScaler.step without "
                    "unscale_); call scaler.unscale_(optimizer) before ck.update_begin()")
        return None

    def apply(self, record: StepRecord, host, threads: Optional[int]) -> None:
        """Apply one recorded step to every block of the record, in place in the host copy:
        one batched kernel call, with the scalars of each (param group, step count) pair."""
        t = record.table
        if not len(t):
            return
        combos: Dict[tuple, int] = {}
        slot_arg = np.zeros(len(host.slots), dtype=np.int64)
        full = np.zeros(len(host.slots), dtype=np.int64)
        for si in t.slots.tolist():
            slot = host.slots[si]
            key = (slot.group, record.steps[si], slot.param_at_f)
            slot_arg[si] = combos.setdefault(key, len(combos))
            full[si] = slot.numel
        args = [(record.scalars[g], step, moments_only) for g, step, moments_only in combos]
        p, m, v = (host.bases(key)[0][t.slot] + t.start * 4
                   for key in (None, "exp_avg", "exp_avg_sq"))
        if any(moments_only for _, _, moments_only in args):
            p = self.scratch_params(host, t, p)
        wd = [moments_weight_decay(sc.decoupled, sc.weight_decay) if mo else sc.weight_decay
              for sc, _, mo in args]
        bf16 = record.grad_dtype == torch.bfloat16
        g = record.grad_base[t.slot] + t.start * record.grad_dtype.itemsize
        arithmetic.replay_batch(
            p, m, v, g, t.numel, t.start, full[t.slot],
            slot_arg[t.slot], [sc.impl for sc, _, _ in args],
            [sc.decoupled for sc, _, _ in args], [sc.lr for sc, _, _ in args],
            [sc.beta1 for sc, _, _ in args], [sc.beta2 for sc, _, _ in args],
            [sc.eps for sc, _, _ in args], wd, [step for _, step, _ in args],
            threads=threads, check_overlap=False,
            beta_powers=[(sc.beta1_power, sc.beta2_power) for sc, _, _ in args],
            grad_dtype=record.grad_dtype, grad_mul=[record.grad_mul] * len(args) if bf16 else None)


    _scratch = None  # float32 parameters the kernel writes and nobody reads (moments only)

    def scratch_params(self, host, t, p: np.ndarray) -> np.ndarray:
        """``p`` with the blocks of slots whose parameter is copied at F pointed into a scratch
        buffer: the kernel writes a parameter, and the host one is the copy taken at F (which
        may land before this replay)."""
        late = np.fromiter((s.param_at_f for s in host.slots), bool, len(host.slots))[t.slot]
        sizes = t.numel[late]
        need = int(sizes.sum())
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(max(need, 1), dtype=torch.float32)
        p = p.copy()
        p[late] = self._scratch.data_ptr() + 4 * (np.cumsum(sizes) - sizes)
        return p


def _device_of(optimizer) -> torch.device:
    devices = {p.device for g in optimizer.param_groups for p in g["params"]}
    if len(devices) > 1:
        _refuse(optimizer, f"its parameters live on several devices ({sorted(map(str, devices))})")
    return next(iter(devices), torch.device("cpu"))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return "this machine's CPU"


def attach_adapter(plan: Plan, optimizer: torch.optim.Optimizer):
    """The replay adapter of ``optimizer`` (:func:`adapter_for`), with ``plan`` told which
    parameters to copy at F because the adapter does not reproduce their update."""
    adapter = adapter_for(optimizer)
    by_id = plan.slot_of_id
    late = {plan.slots[by_id[i]].name: why for i, why in adapter.params_not_replayed().items()
            if i in by_id}
    if plan.copy_param_at_f(late):
        log.info("gockpt: %d parameters are copied at F, their moments replayed (%s)",
                 len(late), next(iter(late.values())))
    return adapter


ENTRY_POINTS = "gockpt.optimizer_adapters"


def adapter_for(optimizer: torch.optim.Optimizer):
    """The replay adapter for ``optimizer``; raises UnsupportedOptimizerError if none is exact."""
    plugin = registered_adapter(type(optimizer))
    if plugin is not None:
        return plugin(optimizer, _refuse)
    return AdamAdapter(optimizer)


def registered_adapter(cls: type):
    """The adapter class an entry point registers for optimizer class ``cls`` (None: none)."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if ep.name == name:
            return ep.load()
    return None


def state_keys_of(optimizer: torch.optim.Optimizer) -> tuple:
    """The state tensors, shaped like its parameter, that every stepped parameter of
    ``optimizer`` holds when a replay adapter knows its arithmetic (empty otherwise): what a
    checkpoint of it cannot lack."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return AdamAdapter.state_keys
    plugin = registered_adapter(type(optimizer))
    return tuple(getattr(plugin, "state_keys", ())) if plugin is not None else ()
