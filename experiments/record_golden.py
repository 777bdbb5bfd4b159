"""Record golden vectors of this machine's Adam/AdamW kernels, for the replay's golden tests.

    python3 experiments/record_golden.py OUT.safetensors [--deepspeed]        # on a CUDA GPU
    GOCKPT_GOLDEN=OUT.safetensors python3 -m pytest tests/replay/test_replay_arithmetic_golden.py

The replay is exact only if it computes what the GPU's optimizer computes, bit for bit; the
vectors in tests/data were recorded once on an H100. This records them again wherever it runs
(the GPU round does, so that every replay profile is checked against the kernels of the GPU,
driver and torch at hand). Per optimizer configuration -- torch's Adam and AdamW in their
forloop, foreach and fused implementations with three sets of hyperparameters, the fused kernel
with a GradScaler's scale, and with ``--deepspeed`` DeepSpeed's FusedAdam in both modes -- it
records a 6-step trajectory from zero state and three single steps from its end with the step
count set to 100, 1000 and 10000, from the inputs of the stored vectors.

The layout (what the golden tests read): ``input/param``, ``input/grad{t}``;
``CASE/t{t}/{param,exp_avg,exp_avg_sq}`` after step t; ``CASE/jump{J}/...`` after the single step
numbered J; and a JSON description under the metadata key ``golden``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Dict, List

import torch
from safetensors.torch import load_file, save_file

STEPS, JUMPS = 6, (100, 1000, 10000)
HYPERPARAMETERS = [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
                   dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
                   dict(lr=0.07, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
GRAD_SCALE = 65536.0
# The inputs: those of the vectors recorded on an H100, so that vectors recorded anywhere else
# answer the same question (they hold zeros, -0.0, subnormals, huge and tiny values, and
# gradients whose exponents spread over the whole range; regenerating them is not an option:
# torch's exp on the CPU differs in the last bit between versions).
STORED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                      "data", "cuda-adam-h100.safetensors")


def inputs(path: str = STORED):
    """The starting parameters and the gradients of the STEPS steps (on the CPU)."""
    tensors = load_file(path)
    return tensors["input/param"], [tensors[f"input/grad{t}"] for t in range(1, STEPS + 1)]


class Recorder:
    """Runs one optimizer over ``inputs()`` on ``device`` and keeps its state after each step."""

    def __init__(self, device: str, param: torch.Tensor, grads: List[torch.Tensor]):
        self.device, self.param0, self.grads = device, param, grads

    def _give(self, opt, p, grad: torch.Tensor, scaled: bool) -> None:
        if scaled:  # as a GradScaler does it: the fused kernel unscales the gradient itself
            opt.grad_scale = torch.tensor(GRAD_SCALE, device=self.device)
            opt.found_inf = torch.tensor(0.0, device=self.device)
            grad = grad * GRAD_SCALE
        p.grad = grad.to(self.device)

    @staticmethod
    def _state(opt, p) -> Dict[str, torch.Tensor]:
        st = opt.state[p]
        return {"param": p.detach().cpu().clone(), "exp_avg": st["exp_avg"].detach().cpu().clone(),
                "exp_avg_sq": st["exp_avg_sq"].detach().cpu().clone()}

    @staticmethod
    def _set_step(opt, p, count: int) -> None:
        """The step count before the next step (the optimizer adds one): in the state (torch),
        or in the param group (DeepSpeed's FusedAdam)."""
        st = opt.state[p]
        if "step" in st:
            if torch.is_tensor(st["step"]):
                st["step"].fill_(float(count))
            else:
                st["step"] = count
        for group in opt.param_groups:
            if "step" in group:
                group["step"] = count

    def record(self, make: Callable, scaled: bool = False) -> Dict[str, torch.Tensor]:
        p = torch.nn.Parameter(self.param0.clone().to(self.device))
        opt = make([p])
        out = {}
        for t, grad in enumerate(self.grads, start=1):
            self._give(opt, p, grad, scaled)
            opt.step()
            out.update({f"t{t}/{k}": v for k, v in self._state(opt, p).items()})
        last = [out[f"t{STEPS}/{k}"] for k in ("param", "exp_avg", "exp_avg_sq")]
        for jump in JUMPS:
            with torch.no_grad():
                p.copy_(last[0])
                opt.state[p]["exp_avg"].copy_(last[1])
                opt.state[p]["exp_avg_sq"].copy_(last[2])
            self._set_step(opt, p, jump - 1)
            self._give(opt, p, self.grads[0], scaled)
            opt.step()
            out.update({f"jump{jump}/{k}": v for k, v in self._state(opt, p).items()})
        return out


def torch_cases():
    """(name, description, factory, scaled) of every torch case."""
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        for impl in ("forloop", "foreach", "fused"):
            kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
            for i, hp in enumerate(HYPERPARAMETERS):
                yield (f"torch/{cls.__name__}/{impl}/h{i}",
                       {"optimizer": f"torch.optim.{cls.__name__}", "impl": impl, **hp},
                       lambda ps, cls=cls, kw=kw, hp=hp: cls(ps, **hp, **kw), False)
    hp = HYPERPARAMETERS[1]
    yield ("torch/AdamW/fused-gradscale/h1",
           {"optimizer": "torch.optim.AdamW", "impl": "fused", "grad_scale": GRAD_SCALE,
            "note": f"grads given multiplied by {GRAD_SCALE:g}; optimizer.grad_scale="
                    f"{GRAD_SCALE:g}, found_inf=0", **hp},
           lambda ps: torch.optim.AdamW(ps, **hp, fused=True), True)


def deepspeed_cases():
    import deepspeed
    from deepspeed.ops.adam import FusedAdam
    for adamw in (True, False):
        for i, hp in enumerate(HYPERPARAMETERS):
            yield (f"deepspeed/FusedAdam/adam_w_mode={adamw}/h{i}",
                   {"optimizer": "deepspeed.ops.adam.FusedAdam", "adam_w_mode": adamw,
                    "deepspeed": deepspeed.__version__, **hp},
                   lambda ps, adamw=adamw, hp=hp: FusedAdam(ps, adam_w_mode=adamw, **hp), False)


def record(out_path: str, device: str, with_deepspeed: bool) -> dict:
    """Records every case into ``out_path``; returns the metadata written (as read back)."""
    param, grads = inputs()
    recorder = Recorder(device, param, grads)
    tensors = {"input/param": param, **{f"input/grad{t}": g for t, g in enumerate(grads, 1)}}
    cases = []
    sources = [torch_cases()]
    if with_deepspeed:
        sources.append(deepspeed_cases())
    for source in sources:
        try:
            for name, description, make, scaled in source:
                out = recorder.record(make, scaled)
                tensors.update({f"{name}/{k}": v for k, v in out.items()})
                cases.append({"name": name, **description})
                print("recorded", name, flush=True)
        except Exception as exc:  # noqa: BLE001 -- DeepSpeed's op may not build here
            if source is sources[0]:
                raise
            print(f"DeepSpeed's FusedAdam not recorded: {type(exc).__name__}: "
                  f"{str(exc)[:2000]}", flush=True)
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "device": device, "n": param.numel(), "trajectory_steps": STEPS, "jumps": list(JUMPS),
            "cases": cases}
    text = json.dumps(meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_path,
              metadata={"golden": text})
    print(f"wrote {out_path}: {len(cases)} cases, {len(tensors)} tensors", flush=True)
    return json.loads(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the .safetensors file to write")
    ap.add_argument("--deepspeed", action="store_true", help="also DeepSpeed's FusedAdam")
    ap.add_argument("--device", default="cuda",
                    help="where the kernels run (cuda; cpu only to try this script)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("record_golden: no CUDA GPU here", file=sys.stderr)
        return 2
    record(args.out, args.device, args.deepspeed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
