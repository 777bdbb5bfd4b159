"""Storage benchmark: gockpt persist/load against the disk's limit, torch and safetensors.

All in one run, on the same directory and the same state (``--gb`` GiB of tensors, default
2, shaped like a model's state: large and odd-sized float32/bf16 tensors plus a few small ones):

* gockpt persist  = CheckpointWriter.write_tensors (parallel, O_DIRECT, fsync) + commit
* dd              = ``dd if=/dev/zero oflag=direct conv=fsync`` of the same byte count
* torch.save      = torch.save to a file + fsync
* safetensors     = safetensors.torch.save_file + fsync
* gockpt load     = read_manifest + read_tensors (parallel, checksums verified)
* torch.load      = torch.load(weights_only=True)
* safetensors     = safetensors.torch.load_file

Every load starts with a cold page cache (``sync; echo 3 > /proc/sys/vm/drop_caches`` when
permitted, else posix_fadvise(DONTNEED) on the file, which is reported) and ends by touching
one byte per page of every tensor, so lazily mapped results are charged for their reads too.
Each measurement is repeated ``--repeat`` times; the best run is reported. GB = 1e9 bytes.

Usage: python experiments/bench_storage.py --json OUT [--dir D] [--gb 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gockpt import _io, storage  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def make_state(gib: float, seed: int = 0) -> dict:
    """About ``gib`` GiB of tensors: big float32 matrices (Adam-like triples), odd sizes, bf16, small."""
    g = torch.Generator().manual_seed(seed)
    target = int(gib * (1 << 30))
    state = {}
    total = 0
    i = 0
    shapes = [(4096, 4096), (4096, 11008), (11008, 4096), (1000, 4097), (32000, 512), (4095,), (1,)]
    while total < target:
        shape = shapes[i % len(shapes)]
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            t = torch.empty(shape, dtype=torch.float32)
            t.view(-1)[:] = torch.rand(1, generator=g)  # cheap fill; bytes vary per tensor
            t.view(-1)[:: 997] = torch.randn(t.view(-1)[:: 997].shape, generator=g)
            state[f"layer{i}.{kind}"] = t
            total += t.numel() * 4
        if i % 5 == 0:
            b = torch.randn(4099, generator=g).bfloat16()
            state[f"layer{i}.norm_bf16"] = b
            total += b.numel() * 2
        i += 1
    state["step"] = torch.tensor(1000)
    return state


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_caches(paths) -> str:
    """Cold page cache for ``paths``; returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in paths:
        for root, _dirs, files in os.walk(p) if os.path.isdir(p) else [(os.path.dirname(p), [], [os.path.basename(p)])]:
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "fadvise_dontneed"


def touch(tensors: dict) -> int:
    """Read one byte per 4 KiB page of every tensor (forces lazily mapped data in)."""
    s = 0
    for t in tensors.values():
        b = t.reshape(-1).view(torch.uint8) if t.numel() else None
        if b is not None:
            s += int(b[::4096].sum())
    return s


def timed(fn):
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--dir", default=os.path.join(HERE, "out", "bench_storage_dir"),
                    help="directory on the disk to measure (created; its bench files removed after)")
    ap.add_argument("--gb", type=float, default=2.0, help="GiB of state (default 2)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement, best reported")
    ap.add_argument("--threads", type=int, default=None, help="gockpt I/O threads (default: cores)")
    ap.add_argument("--dd-bs", default="64M", help="dd block size (default 64M)")
    args = ap.parse_args(argv)

    os.makedirs(args.dir, exist_ok=True)
    work = os.path.join(args.dir, f"bench-{os.getpid()}")
    os.makedirs(work)
    state = make_state(args.gb)
    size = nbytes(state)
    gb = size / 1e9
    print(f"state: {len(state)} tensors, {size / 2**30:.2f} GiB ({gb:.2f} GB); dir {args.dir}; "
          f"{os.cpu_count()} cores; crc32c {_io.crc32c_impl()}", flush=True)
    runs = {k: [] for k in ("persist", "dd_direct", "torch_save", "safetensors_save", "load", "torch_load",
                            "safetensors_load")}
    cache_method = None
    used_direct = None
    try:
        from safetensors.torch import load_file, save_file

        for rep in range(args.repeat):
            # ---- writes
            root = os.path.join(work, "ckpt")

            def persist():
                w = storage.CheckpointWriter(root, storage.checkpoint_name(rep), threads=args.threads)
                w.write_tensors(state)
                w.commit({"bench": True})
                return w.used_direct

            drop_caches([])
            dt, used_direct = timed(persist)
            runs["persist"].append(gb / dt)

            dd_path = os.path.join(work, "dd.bin")
            bs = args.dd_bs
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            bs_bytes = int(bs[:-1]) * mult[bs[-1].upper()] if bs[-1].isalpha() else int(bs)
            count = -(-size // bs_bytes)
            drop_caches([])
            dt, _ = timed(lambda: subprocess.run(
                ["dd", "if=/dev/zero", f"of={dd_path}", f"bs={bs}", f"count={count}", "oflag=direct",
                 "conv=fsync"], check=True, capture_output=True))
            runs["dd_direct"].append(count * bs_bytes / 1e9 / dt)
            os.remove(dd_path)

            tpath = os.path.join(work, "state.pt")
            drop_caches([])
            dt, _ = timed(lambda: (torch.save(state, tpath), fsync_path(tpath)))
            runs["torch_save"].append(gb / dt)

            spath = os.path.join(work, "state.safetensors")
            drop_caches([])
            dt, _ = timed(lambda: (save_file(state, spath), fsync_path(spath)))
            runs["safetensors_save"].append(gb / dt)

            # ---- loads (cold cache each)
            cpath = storage.resolve(root)
            cache_method = drop_caches([cpath])
            dt, got = timed(lambda: (lambda t: (touch(t), t)[1])(
                storage.read_tensors(cpath, storage.read_manifest(cpath), threads=args.threads)))
            runs["load"].append(gb / dt)
            assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), state[k].reshape(-1).view(torch.uint8)) for k in
                       ("layer0.param", "layer5.norm_bf16", "step")), "gockpt load returned other bytes"
            del got

            drop_caches([tpath])
            dt, got = timed(lambda: (lambda t: (touch(t), t)[1])(torch.load(tpath, weights_only=True)))
            runs["torch_load"].append(gb / dt)
            del got

            drop_caches([spath])
            dt, got = timed(lambda: (lambda t: (touch(t), t)[1])(load_file(spath)))
            runs["safetensors_load"].append(gb / dt)
            del got

            for p in (tpath, spath):
                os.remove(p)
            shutil.rmtree(root)
            print(f"run {rep + 1}/{args.repeat}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()),
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    best = {k: max(v) for k, v in runs.items()}
    result = {
        "persist_gbps": best["persist"],
        "dd_direct_gbps": best["dd_direct"],
        "torch_save_gbps": best["torch_save"],
        "safetensors_save_gbps": best["safetensors_save"],
        "load_gbps": best["load"],
        "torch_load_gbps": best["torch_load"],
        "safetensors_load_gbps": best["safetensors_load"],
        "persist_vs_dd": best["persist"] / best["dd_direct"],
        "load_vs_torch_load": best["load"] / best["torch_load"],
        "runs_gbps": runs,
        "state_bytes": size,
        "tensors": len(state),
        "repeat": args.repeat,
        "dir": os.path.abspath(args.dir),
        "page_cache": cache_method,
        "gockpt_o_direct": used_direct,
        "gockpt_threads": args.threads or _io.default_threads(),
        "crc32c": _io.crc32c_impl(),
        "dd_bs": args.dd_bs,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "note": "GB = 1e9 bytes; persist = write + fsync + commit; loads from a cold page cache, "
                "one byte per page touched; best of `repeat` runs",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)

    rows = [
        ("gockpt persist", best["persist"], best["persist"] / best["dd_direct"], "of dd"),
        ("dd oflag=direct", best["dd_direct"], 1.0, "of dd"),
        ("torch.save", best["torch_save"], best["torch_save"] / best["dd_direct"], "of dd"),
        ("safetensors save_file", best["safetensors_save"], best["safetensors_save"] / best["dd_direct"], "of dd"),
        ("gockpt load", best["load"], best["load"] / best["torch_load"], "x torch.load"),
        ("torch.load", best["torch_load"], 1.0, "x torch.load"),
        ("safetensors load_file", best["safetensors_load"], best["safetensors_load"] / best["torch_load"],
         "x torch.load"),
    ]
    print(f"\n{'':24s}{'GB/s':>8s}  ratio")
    for name, v, r, what in rows:
        print(f"{name:24s}{v:8.2f}  {r:5.2f} {what}")
    print(f"\npersist target >= 0.90 x dd: {'met' if result['persist_vs_dd'] >= 0.9 else 'NOT met'} "
          f"({result['persist_vs_dd']:.2f}); load target >= 2 x torch.load: "
          f"{'met' if result['load_vs_torch_load'] >= 2 else 'NOT met'} ({result['load_vs_torch_load']:.2f}); "
          f"page cache: {cache_method}; O_DIRECT: {used_direct}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
