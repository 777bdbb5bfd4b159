"""gockpt's DCP StorageWriter beside DCP's own FileSystemWriter, on the same state, in one run.

    python experiments/bench_dcp_writer.py [--mb 1024] [--rounds 3] [--dir /tmp]

Builds a model of Linear layers and AdamW state (12 bytes per parameter: fp32 weights and two
moments, about ``--mb`` MB in all), and in each round saves it with
``torch.distributed.checkpoint.save`` through ``FileSystemWriter`` (DCP's defaults, and with
as many threads as gockpt's writer uses) and through ``gockpt.storage.dcp.GockptWriter``, each
into a fresh directory on the same file system, alternating; then loads each back with
``dcp.load`` (``FileSystemReader`` / ``GockptReader``, every chunk's crc32c checked) and
checks the loaded state bit for bit. Prints the median write and load speed of each, and the
ratio. Loads read what the save just wrote: from the page cache unless it could be dropped
(root: ``/proc/sys/vm/drop_caches``), which the table says.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from gockpt.storage.dcp import GockptReader, GockptWriter  # noqa: E402
from gockpt.testing import first_difference  # noqa: E402


def state_of(mb: int) -> dict:
    """A torchtitan-style state dict of about ``mb`` MB (weights + Adam moments)."""
    dim = 2048
    layers = max(1, round(mb * 1e6 / 12 / (dim * dim + dim)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "train_state": {"step": 1}}


def nbytes(state) -> int:
    total = 0
    for v in state.values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            total += nbytes(v)
    return total


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def empty_like(state):
    return {k: empty_like(v) if isinstance(v, dict) else
            torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    state = state_of(args.mb)
    size = nbytes(state)
    threads = os.cpu_count() or 1
    writers = {
        "FileSystemWriter": lambda d: dcp.FileSystemWriter(d),
        f"FileSystemWriter({threads} threads)": lambda d: dcp.FileSystemWriter(
            d, thread_count=threads),
        "GockptWriter": lambda d: GockptWriter(d, step=1),
    }
    readers = {"FileSystemWriter": dcp.FileSystemReader,
               f"FileSystemWriter({threads} threads)": dcp.FileSystemReader,
               "GockptWriter": lambda d: GockptReader(os.path.join(d, "step-000000001"))}
    writes = {k: [] for k in writers}
    loads = {k: [] for k in writers}
    cold = True
    root = tempfile.mkdtemp(prefix="gockpt-bench-dcp-", dir=args.dir)
    try:
        for r in range(args.rounds):
            for name, make in writers.items():
                d = os.path.join(root, f"{r}-{len(writes[name])}-{name[:3]}")
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=make(d), no_dist=True)
                writes[name].append(time.perf_counter() - t0)
                cold = drop_caches() and cold
                back = empty_like(state)
                t0 = time.perf_counter()
                dcp.load(back, storage_reader=readers[name](d), no_dist=True)
                loads[name].append(time.perf_counter() - t0)
                why = first_difference(state, back, f"{name}'s round trip")
                assert why is None, why
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state: {size / 1e9:.2f} GB, {args.rounds} rounds in {args.dir}; loads "
          f"{'after dropping the page cache' if cold else 'from the page cache (not root)'}")
    print(f"{'writer':<34} {'save GB/s':>10} {'load GB/s':>10}")
    base = statistics.median(writes["FileSystemWriter"])
    for name in writers:
        w, ld = statistics.median(writes[name]), statistics.median(loads[name])
        print(f"{name:<34} {size / w / 1e9:>10.2f} {size / ld / 1e9:>10.2f}   "
              f"(save {base / w:.2f}x DCP's default)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
