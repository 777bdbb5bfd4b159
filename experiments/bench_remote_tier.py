"""The remote tier of ``experiments/bench_storage.py --remote`` (runnable alone too): a real S3
server (SeaweedFS on the loopback interface, started and stopped here) and, on the same bytes
in one run, side by side:

Uploads of one committed gockpt checkpoint (its data file, ``--gb`` GiB):

* gockpt           = the remote tier's upload (``Bucket.put_file``: multipart in ``part_bytes``,
  ``concurrency`` in flight, every byte checked against the manifest's crc32c chunks and every
  part's MD5 against the ETag)
* obstore          = ``obstore.put(store, key, Path)`` with its defaults (the client's own
  plain upload, no checks)
* boto3            = ``boto3`` S3 client's ``upload_file`` (its transfer manager; default
  TransferConfig), when boto3 is installed -- the other client considered
* local copy       = ``shutil.copyfile`` + fsync into the same disk

Downloads of the same object:

* gockpt           = ``read_tensors`` of the checkpoint at its ``s3://`` URL into fresh
  tensors (parallel ranged GETs straight into the tensors, every chunk's crc32c checked)
* obstore          = ``obstore.get(...).bytes()`` of the whole object (one stream, no checks)
* boto3            = ``download_fileobj`` into memory (transfer manager)
* local read       = ``read_tensors`` of the local checkpoint, page cache dropped if permitted

And what training pays: a gockpt-o run of a small model on this CPU with checkpoints every
``--interval`` steps, without the remote tier, with it, and with it but its uploads not
pausing during a checkpoint's copies (what that pause is worth); the median blocked time per
checkpoint from each run's ``metrics.jsonl`` (the uploads run behind training), the three
run in turn three times and every checkpoint's value pooled. It also says whether the
uploads keep up (an upload shorter than the time between checkpoints: 40 steps by default
here) or fall behind (``--interval 10``: each upload then overlaps the next checkpoint's
copies, and the store gets ever further behind). ``--blocked-only`` measures just that;
``--pin`` puts the server on a core of its own (the last) and training on the others,
``--nice-server`` gives it the lowest priority (either: as if it ran on another machine);
``--link-gbps`` paces the copies like a device link; ``--device cuda`` trains on a GPU.

Loopback numbers say what the client and gockpt's checks cost on this machine's cores, not
what a network gives; GB = 1e9 bytes. Each measurement is repeated ``--repeat`` times, the
best reported.

Usage: python experiments/bench_remote_tier.py --json OUT [--dir D] [--gb 1] [--repeat 3]
       [--steps 400] [--interval 40] [--blocked-only] [--pin] [--nice-server]
       [--link-gbps G] [--device cuda] [--mode M] [--width W]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gockpt  # noqa: E402
from gockpt import storage  # noqa: E402
from gockpt.storage import remote  # noqa: E402
from gockpt.storage.format import fsync_path  # noqa: E402
from gockpt.storage import replicate  # noqa: E402
from gockpt.storage.upload import upload_order  # noqa: E402
from tests._support.s3server import S3Server  # noqa: E402


def best(fn, repeat: int) -> float:
    """The shortest of ``repeat`` timed calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def checkpoint(root: str, gib: float) -> str:
    """A committed checkpoint of ``gib`` GiB of float32 tensors (sync mode); its path."""
    n = int(gib * 2**30 / 4 / 3 / 8)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn(n),
                        "exp_avg_sq": torch.rand(n)}
    ck = gockpt.Checkpointer(model, opt, root, mode="sync")
    ck.save_checkpoint(1, force=True)
    ck.close()
    return storage.resolve(root)


TRAIN = {"device": "cpu", "mode": "gockpt-o", "width": 1024}  # main(): --device, --mode, --width


def blocked_per_checkpoint(root: str, url: str | None, steps: int, interval: int,
                           pause: bool = True, link_gbps: float | None = None) -> None:
    """A gockpt-o run with (or without) the remote tier, its blocked time per checkpoint in
    ``root``'s metrics; ``pause=False``: its uploads do not pause during a checkpoint's copies
    (what the pause is worth); ``link_gbps``: the copies paced as through a device link
    (``Config.emulate_link_gbps``)."""
    replicate.MAX_HOLD_S = 10.0 if pause else 0.0
    torch.manual_seed(0)
    width, device = TRAIN["width"], TRAIN["device"]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    extra = {"remote": url, "remote_wait_s": None} if url else {}
    ck = gockpt.Checkpointer(model, opt, root, mode=TRAIN["mode"], interval=interval,
                             emulate_link_gbps=link_gbps, **extra)
    x = torch.randn(64, width, device=device)
    for step in range(steps):
        loss = model(x).square().mean()
        ck.backward_begin()
        loss.backward()
        ck.update_begin()
        opt.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1)
    ck.close()
    replicate.MAX_HOLD_S = 10.0


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(work: str, gib: float, repeat: int, steps: int, interval: int,
        blocked_only: bool = False, pin: bool = False, link_gbps: float | None = None,
        nice_server: bool = False) -> dict:
    server = S3Server(os.path.join(work, "s3"))
    server.start()
    os.environ.update(server.env())
    if nice_server:  # every thread of the server at the lowest priority: as if elsewhere
        for tid in os.listdir(f"/proc/{server.proc.pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)
    if pin:  # the server on the last core, this process (every thread) on the others
        cores = sorted(os.sched_getaffinity(0))
        subprocess.run(["taskset", "-a", "-cp", str(cores[-1]), str(server.proc.pid)],
                       check=True, capture_output=True)
        subprocess.run(["taskset", "-a", "-cp", ",".join(map(str, cores[:-1])),
                        str(os.getpid())], check=True, capture_output=True)
    try:
        server.create_bucket("bench")
        server.warm("bench")
        out: dict = {}
        if blocked_only:
            out["blocked_s_per_checkpoint"] = blocked(work, steps, interval, link_gbps=link_gbps)
            return out
        ckpt = checkpoint(os.path.join(work, "local"), gib)
        data = os.path.join(ckpt, storage.DATA_FILE)
        size = os.path.getsize(data)
        manifest = storage.read_manifest(ckpt)
        print(f"remote tier: {size / 1e9:.2f} GB data file, SeaweedFS {server.endpoint}",
              flush=True)
        url = "s3://bench/ckpt"
        bucket, _ = remote.bucket_of(url)
        files = upload_order(ckpt)
        out.update({"bytes": size, "part_bytes": bucket.options.part_bytes,
                    "concurrency": bucket.options.concurrency, "upload_s": {}, "download_s": {}})

        def gockpt_upload():
            for rel, chk in files:  # the data file checked, then the manifest
                bucket.put_file(f"ckpt/{os.path.basename(ckpt)}/{rel}", os.path.join(ckpt, rel),
                                check=chk)

        import obstore
        out["upload_s"]["gockpt"] = best(gockpt_upload, repeat)
        out["upload_s"]["obstore"] = best(
            lambda: obstore.put(bucket.store, "plain/obstore", Path(data)), repeat)
        local_copy = os.path.join(work, "copy.safetensors")

        def copy():
            shutil.copyfile(data, local_copy)
            fsync_path(local_copy)
        out["upload_s"]["local_copy"] = best(copy, repeat)
        try:
            import boto3
            s3 = boto3.client("s3", endpoint_url=server.endpoint)
            out["upload_s"]["boto3"] = best(
                lambda: s3.upload_file(data, "bench", "plain/boto3"), repeat)
        except ImportError:
            s3 = None
        remote_ckpt = f"{url}/{os.path.basename(ckpt)}"
        out["download_s"]["gockpt"] = best(
            lambda: storage.read_tensors(remote_ckpt, storage.read_manifest(remote_ckpt)), repeat)
        out["download_s"]["obstore"] = best(
            lambda: obstore.get(bucket.store, "plain/obstore").bytes(), repeat)
        if s3 is not None:
            out["download_s"]["boto3"] = best(
                lambda: s3.download_fileobj("bench", "plain/boto3", io.BytesIO()), repeat)

        def local_read():
            drop_cache(data)
            storage.read_tensors(ckpt, manifest)
        out["download_s"]["local_read"] = best(local_read, repeat)
        for kind in ("upload_s", "download_s"):
            out[kind.replace("_s", "_gbps")] = {k: size / v / 1e9 for k, v in out[kind].items()}
        out["blocked_s_per_checkpoint"] = blocked(work, steps, interval, link_gbps=link_gbps)
        return out
    finally:
        server.stop()


def blocked(work: str, steps: int, interval: int, rounds: int = 3,
            link_gbps: float | None = None) -> dict:
    """Blocked time per checkpoint: the remote tier off, on, and on without its pause, run in
    turn ``rounds`` times (the machine's drift spread over all three), every checkpoint's
    value pooled per setting."""
    settings = {"remote_off": (None, True), "remote_on": ("s3://bench/on", True),
                "remote_on_unpaused": ("s3://bench/unpaused", False)}
    pooled: dict = {k: [] for k in settings}
    uploads: dict = {k: [] for k in settings}  # seconds of each upload
    walls: dict = {k: [] for k in settings}  # seconds of each run
    for r in range(rounds):
        for key, (url, pause) in settings.items():
            root = os.path.join(work, f"train-{key}-{r}")
            t0 = time.perf_counter()
            blocked_per_checkpoint(root, url and f"{url}{r}", steps, interval, pause,
                                   link_gbps)
            walls[key].append(time.perf_counter() - t0)
            pooled[key] += [m["blocked_s"] for m in gockpt.metrics.read(root)]
            uploads[key] += [m["seconds"] for m in gockpt.metrics.read(root, record="upload")]
    # the time between checkpoints, from the runs without the tier (its close waits for none)
    between = statistics.median(walls["remote_off"]) / steps * interval
    return {k: {"median": statistics.median(v), "mean": statistics.mean(v), "n": len(v),
                "upload_s": statistics.median(uploads[k]) if uploads[k] else None,
                "between_checkpoints_s": between}
            for k, v in pooled.items()}


def report(out: dict) -> None:
    for kind, base in (("upload_gbps", "obstore"), ("download_gbps", "obstore")):
        rates = out.get(kind)
        if rates:
            print(f"{kind[:-5]:>8}: " + "   ".join(
                f"{k} {v:.2f} GB/s ({v / rates[base]:.2f}x obstore)" for k, v in rates.items()))
    b = out["blocked_s_per_checkpoint"]
    on = b["remote_on"]
    keeps_up = on["upload_s"] < on["between_checkpoints_s"]
    print(f"a checkpoint every {on['between_checkpoints_s']:.2f} s, an upload took "
          f"{on['upload_s']:.2f} s (median): " + (
              "the uploads keep up" if keeps_up else
              "the uploads fall behind, each overlapping the next checkpoint's copies"))
    for stat in ("median", "mean"):
        off = max(b["remote_off"][stat], 1e-9)
        print(f"blocked per checkpoint ({stat} of {b['remote_off']['n']}, pooled): remote off "
              f"{off * 1e3:.1f} ms, on {b['remote_on'][stat] * 1e3:.1f} ms "
              f"({b['remote_on'][stat] / off:.2f}x), on without the pause "
              f"{b['remote_on_unpaused'][stat] * 1e3:.1f} ms "
              f"({b['remote_on_unpaused'][stat] / off:.2f}x)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--interval", type=int, default=40)
    ap.add_argument("--blocked-only", action="store_true",
                    help="only the blocked time per checkpoint (no GB/s)")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="pace the training's copies as through a device link of this many "
                         "GB/s (the regime of a GPU; default: memcpys)")
    ap.add_argument("--device", default="cpu", help="where the blocked-time runs train "
                    "(cuda: the regime gockpt is for; the uploads then compete with nothing "
                    "on the device)")
    ap.add_argument("--mode", default="gockpt-o", help="gockpt's mode in those runs")
    ap.add_argument("--width", type=int, default=1024,
                    help="of the 8 Linear layers trained (state: 8 x width^2 x 16 bytes)")
    ap.add_argument("--nice-server", action="store_true",
                    help="the server's threads at the lowest CPU priority (nice 19), as if it "
                         "ran on another machine")
    ap.add_argument("--pin", action="store_true",
                    help="the server on the last core, training on the others (as if the "
                         "server were elsewhere)")
    args = ap.parse_args(argv)
    TRAIN.update(device=args.device, mode=args.mode, width=args.width)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-remote-", dir=args.dir)
    try:
        out = run(work, args.gb, args.repeat, args.steps, args.interval, args.blocked_only,
                  args.pin, args.link_gbps, args.nice_server)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["train"] = dict(TRAIN, steps=args.steps, interval=args.interval,
                        link_gbps=args.link_gbps, pin=args.pin, nice_server=args.nice_server)
    report(out)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
