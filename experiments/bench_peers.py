"""A restart whose host lost its memory, from its peer's memory on another host, side by side
with one from its own host's memory and one from disk, in one run.

    python experiments/bench_peers.py [--gb 0.5] [--repeat 3]

Two gloo ranks, each declared on a host of its own (``GOCKPT_HOST``, a memory directory per
host), train a model sharded by FSDP2 whose checkpoint is about ``--gb`` GB in all (fp32
weights and AdamW's two moments; each rank's part half of it) with ``Config(memory="auto")``:
each host keeps its rank's part and the other rank's (its peer's). The job checkpoints and
every rank dies without closing (the copies stay). Then fresh jobs load that checkpoint,
``--repeat`` times each, and report the load's wall time (the slower rank's):

* own memory   both hosts' copies there
* peer memory  host 1's memory deleted first: rank 1 receives its part from rank 0 (two gloo
               all-to-alls on the loopback interface) and keeps it in its host's memory
* disk         ``gockpt.load(..., tag=...)``: the disk's checkpoint, in the page cache

Every load's state is compared across the three (a digest of every rank's tensors).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests._support.ports import free_ports  # noqa: E402


def build(dim: int, layers: int):
    import torch
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def rank_main(args) -> None:
    """One rank of a job (``--role train|own|peer|disk``); prints a JSON line."""
    import torch
    import torch.distributed as dist
    import gockpt
    from gockpt.storage import memory_tier
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["GOCKPT_HOST"] = f"host-{rank}"
    mine = os.path.join(args.memory_dir, f"host-{rank}")
    os.makedirs(mine, exist_ok=True)
    model, opt = build(args.dim, args.layers)
    if args.role == "train":
        ck = gockpt.Checkpointer(model, opt, args.dir, mode="gockpt-o", interval=1,
                                 memory="auto", memory_dir=mine)
        ck.backward_begin()
        model(torch.randn(4, args.dim)).square().mean().backward()
        ck.update_begin()
        opt.step()
        ck.save_checkpoint(1)
        ck.wait()
        dist.barrier()
        os._exit(0)  # every rank dies: the copies stay
    if args.role == "peer" and rank == 1:
        shutil.rmtree(memory_tier.root_of(os.path.realpath(args.dir), mine))
    dist.barrier()
    t0 = time.perf_counter()
    restored = gockpt.load(args.dir, model, opt, memory_dir=mine,
                           tag="step-000000001" if args.role == "disk" else None)
    seconds = time.perf_counter() - t0
    h = hashlib.sha256()
    for t in list(model.state_dict().values()) + [v for s in opt.state.values()
                                                   for v in s.values()]:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    print(json.dumps({"rank": rank, "seconds": seconds, "digest": h.hexdigest(),
                      "path": restored.path}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def job(role: str, args) -> list:
    """Run one job of 2 ranks; each rank's JSON line (none for ``train``)."""
    port = str(free_ports(1))
    cmd = [sys.executable, os.path.abspath(__file__), "--rank-of", role, "--dir", args.dir,
           "--memory-dir", args.memory_dir, "--dim", str(args.dim), "--layers",
           str(args.layers)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                   "PYTHONPATH": ROOT})
             for r in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"a rank of the {role} job failed:\n{out}\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs] if role != "train" \
        else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rank-of", dest="role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, default=2048, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role is not None:
        rank_main(args)
        return 0
    args.layers = max(1, round(args.gb * 1e9 / 12 / (args.dim * args.dim + args.dim)))
    work = tempfile.mkdtemp(prefix="gockpt-peers-")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    args.dir, args.memory_dir = os.path.join(work, "run"), tempfile.mkdtemp(dir=shm)
    try:
        print(f"{args.layers} layers of {args.dim}x{args.dim}: "
              f"{args.layers * (args.dim ** 2 + args.dim) * 12 / 1e9:.2f} GB of state, "
              "2 ranks (FSDP2, gloo) on 2 declared hosts", flush=True)
        job("train", args)
        best, digests = {}, set()
        for _ in range(args.repeat):
            for role in ("own", "peer", "disk"):
                ranks = job(role, args)
                digests.add(tuple(r["digest"] for r in ranks))
                seconds = max(r["seconds"] for r in ranks)
                best[role] = min(best.get(role, seconds), seconds)
                if role == "peer":
                    assert "peers" in ranks[1]["path"], ranks[1]["path"]
        assert len(digests) == 1, "the loads differ"
        print(f"{'load from':<12} {'best of ' + str(args.repeat):>12}")
        for role, label in (("own", "own memory"), ("peer", "peer memory"), ("disk", "disk")):
            print(f"{label:<12} {best[role]:>10.2f} s")
        print("every load's state identical on both ranks")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(args.memory_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
