"""One rank of the goodput benchmark's training job (experiments/goodput.py), started by
``torchrun --max-restarts``: restores the latest checkpoint of its scheme if there is one, trains
the demo's model to ``--steps``, checkpoints as its scheme says, and logs for the benchmark's
own accounting (rank 0, ``bench-<pid>.jsonl`` in the run directory, one flushed line per step:
when it could train, each step's end and the seconds its checkpoint calls took, each
checkpoint's commit). At the last step every rank saves its state snapshot
(:func:`gockpt.testing.snapshot`) for the bitwise comparison with the uninterrupted run.

Schemes: ``none`` (a restart begins again at step 0), gockpt's ``sync``, ``async``, ``async-o``,
``gockpt-o`` (a fixed interval) and ``gockpt-o-auto`` (``interval="auto"`` with the MTBF), and
``dcp`` (``torch.distributed.checkpoint.async_save`` at the same interval; the RNG state and
the step in its state dict, the latest complete one -- its ``.metadata`` written -- loaded)
with the staging of PyTorch's zero-overhead checkpointing (:class:`LinkStager`: copied on a
background thread while the next forward/backward runs, the optimizer step waiting for it)
across the same emulated link as gockpt's copies.

SIGUSR1 (the benchmark's ``--failure raise``) makes the rank raise an exception at the next
point of its own loop (after the forward pass, or after the optimizer step): a failure that is
not a SIGKILL, with whatever checkpoint is in flight then; the process leaves on it as a
user's script does, and the other ranks end on their failed collective.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gockpt  # noqa: E402
from gockpt.core import runlog  # noqa: E402
from gockpt.testing import snapshot  # noqa: E402
from model import ModelConfig, batch, build  # noqa: E402

GOCKPT_MODES = {"sync": "sync", "async": "async", "async-o": "async-o", "gockpt-o": "gockpt-o",
                "gockpt-o-auto": "gockpt-o", "gockpt-o-memory": "gockpt-o"}


class InjectedFailure(RuntimeError):
    """The exception ``--failure raise`` asks for."""


class Raise:
    """SIGUSR1 arms it; the loop's next :meth:`point` raises :class:`InjectedFailure` (in
    the loop's own code, as a user's check would, not inside a library call)."""

    def __init__(self, log):
        self.armed, self.log = False, log
        signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "armed", True))

    def point(self, where: str) -> None:
        if self.armed:
            self.log(ev="raise", t=time.time(), at=where)
            raise InjectedFailure(f"failure injected by the benchmark ({where})")


class LinkStager:
    """DCP's zero-overhead staging as on a GPU: ``stage`` copies the state dict on a background
    thread (training goes on; the step that changes the state waits for the copy) at the
    emulated link's rate, as DCP's pinned, non-blocking stager copies across PCIe there. (An
    ``AsyncStager`` for ``async_save``: it returns a future, so async_save answers with the
    staging's completion beside the upload's.)"""

    should_synchronize_after_execute = False

    def __init__(self, gbps):
        from concurrent.futures import ThreadPoolExecutor
        self.gbps = gbps
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dcp-staging")

    def stage(self, state_dict):
        return self.pool.submit(self._copy, state_dict)

    def _copy(self, state_dict):
        from torch.utils._pytree import tree_map
        t0, nbytes = time.perf_counter(), 0

        def clone(x):
            nonlocal nbytes
            if isinstance(x, torch.Tensor):
                nbytes += x.nbytes
                return x.detach().clone()
            return x
        copy = tree_map(clone, state_dict)
        if self.gbps:  # the rest of the transfer time (the pacing of an emulated link)
            time.sleep(max(0.0, nbytes / (self.gbps * 1e9) - (time.perf_counter() - t0)))
        return copy

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class Log:
    """Rank 0's lines for the benchmark (other ranks: nothing)."""

    def __init__(self, directory: str, rank: int):
        self.f = open(os.path.join(directory, f"bench-{os.getpid()}.jsonl"), "a") \
            if rank == 0 else None

    def __call__(self, **fields) -> None:
        if self.f is not None:
            self.f.write(json.dumps(fields) + "\n")
            self.f.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--scheme", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--mtbf", type=float, default=None)
    ap.add_argument("--link-gbps", type=float, default=None)
    ap.add_argument("--final", default=None, help="where to save the final snapshots")
    ap.add_argument("--dim", type=int, default=ModelConfig.dim, help="the model's width")
    ap.add_argument("--layers", type=int, default=ModelConfig.layers)
    ap.add_argument("--die", default="",
                    help="where rank 0 kills itself (SIGKILL), one point per attempt (the "
                         "launcher's restart count), comma-separated: window@STEP (at that "
                         "step's boundary), persist@STEP (writing that step's checkpoint), "
                         "load (in the restore), - (not in this attempt)")
    args = ap.parse_args()
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if several:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if several else 0
    log = Log(args.directory, rank)
    log(ev="start", pid=os.getpid(), process_start=runlog.process_start_time())
    fail = Raise(log)  # (from the start: a SIGUSR1 while restoring raises at the first point)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    plan = args.die.split(",") if args.die else []
    die = Die(plan[attempt] if rank == 0 and attempt < len(plan) else "-", log)
    model, opt, sched = build(model_config(args.dim, args.layers), total_steps=args.steps)
    net = torch.nn.parallel.DistributedDataParallel(model) if several else model
    scheme = Scheme(args, net, opt, sched, several, die)
    start = scheme.restore()
    log(ev="ready", t=time.time(), restored=start)
    for step in range(start, args.steps):
        t_ckpt = 0.0
        loss = model_loss(net, step)
        fail.point("after the forward pass")
        t_ckpt += scheme.timed("backward_begin")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        t_ckpt += scheme.timed("update_begin")
        opt.step()
        sched.step()
        opt.zero_grad()
        fail.point("after the optimizer step")
        t_ckpt += scheme.boundary(step + 1)
        die.at_boundary(step + 1)
        log(ev="step", step=step + 1, t=time.time(), blocked=t_ckpt,
            committed=scheme.committed())
    t0 = time.time()
    scheme.close()
    log(ev="end", t=time.time(), boundary_t=t0, committed=scheme.committed())
    if args.final:
        torch.save(snapshot(net, opt, sched), os.path.join(args.final, f"final-rank{rank}.pt"))
    if several:
        dist.destroy_process_group()
    return 0


def model_config(dim: int, layers: int) -> ModelConfig:
    """The demo's LLaMA-style model at another width and depth (SwiGLU width 8/3 of it)."""
    return ModelConfig(dim=dim, layers=layers, hidden=(8 * dim // 3 + 7) // 8 * 8)


def model_loss(net, step: int):
    """The model's loss on the batch of ``step`` (``TinyLlama.loss``) through ``net``'s own
    forward: DDP's arms its gradient hooks."""
    tokens = batch(step)
    logits = net(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             tokens[:, 1:].reshape(-1))


class Die:
    """A failure at a chosen point (the suite's test of exactness under kills): the process
    kills itself with SIGKILL -- no handler, no exit work -- after logging where."""

    def __init__(self, point: str, log: Log):
        self.point, self.log = point, log
        if point == "load":  # the first read of the restore
            read = gockpt.storage.read_tensors

            def dying_read(*a, **kw):
                self.now()
                return read(*a, **kw)
            gockpt.storage.read_tensors = dying_read

    def now(self) -> None:
        self.log(ev="die", t=time.time(), at=self.point)
        os.kill(os.getpid(), signal.SIGKILL)

    def at_boundary(self, step: int) -> None:
        if self.point == f"window@{step}":
            self.now()

    def writer(self):
        """A storage_writer plugin that dies writing the checkpoint of ``persist@STEP``."""
        if not self.point.startswith("persist@"):
            return None
        die, step = self, int(self.point.split("@")[1])

        class DyingWriter(gockpt.storage.CheckpointWriter):
            def write(self, name, t, *, start=0):
                if self.name == f"step-{step:09d}":
                    die.now()
                return super().write(name, t, start=start)

            def write_tensors(self, tensors):
                if self.name == f"step-{step:09d}":
                    die.now()
                return super().write_tensors(tensors)
        return DyingWriter


class Scheme:
    """How the job checkpoints and restores."""

    def __init__(self, args, net, opt, sched, several: bool, die: Die):
        self.args, self.net, self.opt, self.sched, self.die = args, net, opt, sched, die
        self.ck, self.future, self.pending, self.last_committed = None, None, None, None
        self.name, self.several, self.dcp_group = args.scheme, several, None
        self.staging = None  # DCP: the staging in progress (the next update waits for it)

    # -------------------------------------------------------------- restore
    def restore(self) -> int:
        a = self.args
        start = 0
        if self.name in GOCKPT_MODES:
            try:
                start = gockpt.load(a.directory, self.net, self.opt, scheduler=self.sched).step
            except gockpt.CheckpointNotFoundError:
                pass
            interval = "auto" if self.name == "gockpt-o-auto" else a.every
            self.ck = gockpt.Checkpointer(
                self.net, self.opt, a.directory, mode=GOCKPT_MODES[self.name],
                overlap_steps=a.k if GOCKPT_MODES[self.name] == "gockpt-o" else None,
                scheduler=self.sched, interval=interval,
                mtbf=a.mtbf if interval == "auto" else None, emulate_link_gbps=a.link_gbps,
                keep_last=2, storage_writer=self.die.writer(), **self._memory_tier())
            self.ck.plan_checkpoint(a.steps)  # the last step is kept too
        elif self.name == "dcp":
            # its own group: the save's collectives run on a thread beside DDP's all-reduces,
            # which on one shared gloo group wait for each other forever
            self.dcp_group = dist.new_group(backend="gloo") if self.several else None
            self.stager = LinkStager(a.link_gbps)
            start = self._dcp_load()
        self.last_committed = start
        return start

    def _memory_tier(self) -> dict:
        """gockpt-o-memory: the memory tier and its step log (on several ranks, each rank's)."""
        if self.name != "gockpt-o-memory":
            return {}
        return {"memory": "auto", "memory_log": 1 << 30}

    def _dcp_load(self) -> int:
        import torch.distributed.checkpoint as dcp
        done = sorted(int(n.split("-")[1]) for n in os.listdir(self.args.directory)
                      if n.startswith("step-") and
                      os.path.exists(os.path.join(self.args.directory, n, ".metadata")))
        if not done:
            return 0
        state = self._dcp_state(0)
        dcp.load(state, checkpoint_id=os.path.join(self.args.directory, f"step-{done[-1]}"))
        self._dcp_apply(state)
        return int(state["step"])

    def _dcp_state(self, step: int) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.net, self.opt)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(),
                "rng": torch.get_rng_state(), "step": step}

    def _dcp_apply(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.net, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])

    # -------------------------------------------------------------- the loop's calls
    def timed(self, hook: str) -> float:
        t0 = time.perf_counter()
        if self.ck is not None:
            getattr(self.ck, hook)()
        elif hook == "update_begin" and self.staging is not None:
            self.staging.result()  # DCP: the state may change only once it is staged
            self.staging = None
        return time.perf_counter() - t0

    def boundary(self, step: int) -> float:
        t0 = time.perf_counter()
        if self.ck is not None:
            handle = self.ck.save_checkpoint(step, extra_state={"step": step})
            if handle is not None:
                self.pending = (self.pending or []) + [handle]
        elif self.name == "dcp" and (step % self.args.every == 0 or step == self.args.steps):
            import torch.distributed.checkpoint as dcp
            if self.future is not None:  # DCP's previous save must finish first
                self.future.result()
                self._dcp_done()
            saving = dcp.async_save(self._dcp_state(step), checkpoint_id=os.path.join(
                self.args.directory, f"step-{step}"), process_group=self.dcp_group,
                async_stager=self.stager)
            self.staging, self.future = saving.staging_completion, saving.upload_completion
            self.future_step = step
        return time.perf_counter() - t0

    def _dcp_done(self) -> None:
        self.last_committed = self.future_step
        self.future = None

    def committed(self):
        """The last step committed (seen from this process)."""
        if self.ck is not None and self.pending:
            done = [h for h in self.pending if h.done() and h.error is None]
            if done:
                self.last_committed = max(self.last_committed, max(h.final_step for h in done))
            self.pending = [h for h in self.pending if not h.done()]
        if self.future is not None and self.future.done():
            self.future.result()
            self._dcp_done()
        return self.last_committed

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()
        if self.future is not None:
            self.future.result()
            self._dcp_done()
        if self.name == "dcp":
            self.stager.close()


if __name__ == "__main__":
    sys.exit(main())
