"""What page-locking host memory on a background thread costs the training thread's CUDA calls.

    python3 experiments/bench_pinning.py --gb 4 --json OUT        # on a CUDA GPU

On the H200 (docs/gpu.md) every run lost about 0.5 s per GB of pinned host staging, outside
its checkpoints' windows, although gockpt allocates that staging on a background thread: the
driver holds global locks while it registers memory, and the training thread's launches wait.
This measures it directly, one way of pinning at a time: a loop of small kernels and a
synchronize per "step" (a training thread's pattern) runs while another thread pins ``--gb``
GB, and the loop's steps are timed against the same loop with nothing pinned:

- ``torch-pinned``: ``torch.empty(..., pin_memory=True)`` (cudaHostAlloc: faults and pins);
- ``register``: an anonymous mapping registered whole (gockpt's way before 2026-11-28: the
  driver faults the pages in while it holds its locks);
- ``prefault+register``: the pages touched first on threads without the GIL
  (``gockpt.capture.device.prefault``), then registered whole (gockpt's way now);
- ``prefault+chunks``: touched first, then registered ``--chunk-mb`` MB at a time, the locks
  free between chunks.

Per way: seconds to pin, the loop's stall (the steps' time beyond the baseline's median step,
summed) and its longest step. Without a GPU (``--cpu``) the same loop runs with nothing to
register: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gockpt.capture.device import prefault  # noqa: E402


def steps_while(work, device: str, idle_s: float = 0.3) -> tuple:
    """Run the step loop while ``work()`` runs on another thread (and ``idle_s`` after it);
    returns (the seconds ``work`` took, every step's wall time)."""
    a = torch.randn(512, 512, device=device)
    done, took = threading.Event(), [0.0]

    def run():
        t0 = time.perf_counter()
        try:
            work()
        finally:
            took[0] = time.perf_counter() - t0
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    walls, end = [], None
    thread.start()
    while end is None or time.perf_counter() < end:
        t0 = time.perf_counter()
        b = a
        for _ in range(20):
            b = torch.tanh(b @ a)
        if device == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        if end is None and done.is_set():
            end = time.perf_counter() + idle_s
    thread.join()
    return took[0], walls


def ways(nbytes: int, chunk: int, cuda: bool) -> dict:
    """Each way of pinning: a function that pins ``nbytes`` and returns how to let it go."""
    cudart = torch.cuda.cudart() if cuda else None

    def register(address: int, size: int) -> None:
        if cudart is not None:
            rc = int(cudart.cudaHostRegister(address, size, 1))
            if rc != 0:
                raise RuntimeError(f"cudaHostRegister failed: {rc}")

    def unregister(address: int) -> None:
        if cudart is not None:
            cudart.cudaHostUnregister(address)

    def mapped(pre: bool, step: int):
        def pin():
            m = mmap.mmap(-1, nbytes)
            t = torch.frombuffer(m, dtype=torch.uint8)
            base = t.data_ptr()
            if pre:
                prefault(base, nbytes)
            starts = list(range(0, nbytes, step))
            for o in starts:
                register(base + o, min(step, nbytes - o))

            del t  # (the mapping stays until release unmaps it)

            def release():
                for o in starts:
                    unregister(base + o)
                m.close()
            release.mapping = m
            return release
        return pin

    def torch_pinned():
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)

        def release():
            nonlocal t
            t = None
            if cuda:
                getattr(torch._C, "_host_emptyCache", lambda: None)()
        return release

    return {"torch-pinned": torch_pinned, "register": mapped(False, nbytes),
            "prefault+register": mapped(True, nbytes), "prefault+chunks": mapped(True, chunk)}


def copy_rates(mapping, chunk: int) -> dict:
    """A device-to-host copy of half a chunk into chunked registrations, once inside the first
    chunk and once across the edge of the first two: (GB/s, seconds its launch took) each. A
    copy across two registrations may be taken for pageable memory (slow, synchronous): what
    decides whether chunked registration needs copies split at its edges."""
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    size = chunk // 2
    src = torch.full((size,), 7, dtype=torch.uint8, device="cuda")
    out = {}
    for label, at in (("inside one registration", chunk // 4),
                      ("across two registrations", chunk - chunk // 4)):
        dst = host[at:at + size]
        dst.copy_(src, non_blocking=True)  # (warm)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        launch = time.perf_counter() - t0
        torch.cuda.synchronize()
        out[label] = (size / 1e9 / (time.perf_counter() - t0), launch)
    del host, dst
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="GB pinned by each way")
    ap.add_argument("--chunk-mb", type=int, default=256, help="prefault+chunks' chunk, MB")
    ap.add_argument("--cpu", action="store_true", help="no GPU: check the script only")
    ap.add_argument("--json", help="write the results as JSON")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print("bench_pinning: no CUDA GPU here (--cpu checks the script)", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    nbytes = int(args.gb * 1e9) // mmap.PAGESIZE * mmap.PAGESIZE
    chunk = args.chunk_mb << 20
    steps_while(lambda: time.sleep(0.5), device)  # (warm-up)
    _, base = steps_while(lambda: time.sleep(1.0), device)
    step = statistics.median(base)
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gb": nbytes / 1e9,
               "chunk_mb": args.chunk_mb, "step_median_s": step, "ways": {}}
    print(f"{results['device']}: {nbytes / 1e9:.1f} GB per way, baseline step "
          f"{step * 1e3:.2f} ms")
    print(f"{'way':<20}{'pin s':>9}{'GB/s':>8}{'stall s':>10}{'longest step':>14}")
    for name, pin in ways(nbytes, chunk, cuda).items():
        release = []
        took, walls = steps_while(lambda: release.append(pin()), device)
        copies = copy_rates(release[0].mapping, chunk) \
            if cuda and name == "prefault+chunks" and release and nbytes >= 2 * chunk else {}
        if release:
            release[0]()
        stall = sum(max(0.0, w - step) for w in walls)
        results["ways"][name] = {"pin_s": took, "stall_s": stall, "longest_step_s": max(walls),
                                 "steps": len(walls), **copies}
        print(f"{name:<20}{took:>9.2f}{nbytes / 1e9 / took:>8.1f}{stall:>10.2f}"
              f"{max(walls) * 1e3:>11.1f} ms", flush=True)
        for label, (gbps, launch) in copies.items():
            print(f"    a copy {label}: {gbps:.1f} GB/s, its launch {launch * 1e3:.2f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
