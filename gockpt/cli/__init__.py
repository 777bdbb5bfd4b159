"""The ``gockpt`` console tool: look at, check and convert checkpoints without writing Python.

Subcommands::

    gockpt inspect PATH [--rank R] [--json]   step, mode, tensors, sizes, ranks, timings
    gockpt verify  PATH [--all] [--json]      every checksum; names each bad file and tensor
    gockpt export  PATH --to {safetensors,torch,fp32} OUT [--rank R] [--shard-size BYTES] [--force]
    gockpt export  PATH --to deepspeed OUT_DIR [--ds-config CONFIG] [--force]
    gockpt list    DIR  [--json]              checkpoints, which is latest, ranks, leftovers
    gockpt clean   DIR [--memory]             remove leftovers of processes that died
    gockpt goodput DIR  [--json] [--plot FILE] a run's goodput and badput by category

``PATH`` is a checkpoint directory or a run directory (then: its latest checkpoint).

A checkpoint written by several ranks (see :mod:`gockpt.storage.ranks`) is a directory whose top-level
manifest lists its parts (``"ranks": ["rank-00000", ...]``); each part is a complete
single-rank checkpoint directory inside it. ``inspect`` summarises the parts (``--rank R``
shows one part in full), ``verify`` checks every part and reports a listed part that is
missing or unreadable, ``export --rank R`` exports one rank's part (default rank 0).

Exit status: 0 success; 1 the checkpoint is bad (a checksum or file does not verify, the
manifest is corrupt, or data could not be read while exporting); 2 usage errors and paths that
do not exist or hold no checkpoint. Every error is one line on stderr.

Only :mod:`gockpt.storage`'s public functions touch the files, so this tool keeps working
when the data layout or the checksum scheme changes; ``verify`` prints what
:func:`gockpt.verify` reports.

One module per command: :mod:`.inspect` (its data built by :mod:`.summary`), :mod:`.verify`,
:mod:`.export` (DeepSpeed targets in :mod:`.export_fp32` and :mod:`.export_deepspeed`),
:mod:`.listing` (list and clean); :mod:`.common` holds what they share.
:mod:`.interval` is the separate console script ``gockpt-interval`` (the checkpoint interval
that minimises wasted time; also ``python -m gockpt.cli.interval``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from ..core.errors import (CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                           GockptError)
from .status import PROG, BadCheckpoint, UsageError, one_line
from .pipe import quiet_on_broken_pipe

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Inspect, verify, export and list gockpt checkpoints.",
        epilog="PATH is a checkpoint directory or a run directory (then its latest checkpoint). "
               "Exit status: 0 ok, 1 bad checkpoint, 2 usage error or nothing found.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("inspect", help="step, mode, tensors, sizes, ranks, timings")
    s.add_argument("path", metavar="PATH")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--brief", action="store_true", help="omit the per-tensor table")
    s.add_argument("--rank", type=int, metavar="R",
                   help="checkpoint written by several ranks: show rank R's part in full "
                        "(tensor table, timings, model)")
    s.set_defaults(func="inspect:cmd_inspect")

    s = sub.add_parser("verify", help="check every checksum; exit 1 naming each bad tensor")
    s.add_argument("path", metavar="PATH")
    s.add_argument("--all", action="store_true",
                   help="PATH is a run directory: verify every committed checkpoint in it")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func="verify:cmd_verify")

    s = sub.add_parser("export", help="write consolidated weights other tools load without gockpt")
    s.add_argument("path", metavar="PATH")
    s.add_argument("--to", required=True, choices=("safetensors", "torch", "fp32", "deepspeed"),
                   help="safetensors: the model's state_dict (tied parameters as copies); "
                        "torch: torch.save({'model', 'optimizer', 'step'[, 'scheduler']}); "
                        "fp32: the consolidated fp32 master weights of a DeepSpeed checkpoint "
                        "(every rank's part; safetensors); deepspeed: a checkpoint written "
                        "through gockpt.integrations.deepspeed in DeepSpeed's own layout "
                        "(OUT a directory: OUT/latest, OUT/global_step<N>/ with the model "
                        "states and every rank's ZeRO partition) that engine.load_checkpoint(OUT) "
                        "of a DeepSpeed without gockpt loads (with the DeepSpeed config the "
                        "checkpoint recorded, or --ds-config's)")
    s.add_argument("out", metavar="OUT")
    s.add_argument("--shard-size", type=int, metavar="BYTES",
                   help="--to safetensors: split the tensors in files of at most BYTES each "
                        "(Hugging Face style: OUT is the index, "
                        "<stem>.safetensors.index.json; the files <stem>-0000i-of-0000n."
                        "safetensors beside it)")
    s.add_argument("--force", action="store_true",
                   help="overwrite OUT if it exists (--to deepspeed: write into a non-empty "
                        "OUT, replacing its global_step<N>/ and latest)")
    s.add_argument("--ds-config", metavar="CONFIG",
                   help="--to deepspeed: the DeepSpeed config (JSON) to store in the export "
                        "(as DeepSpeed does) instead of the one the gockpt checkpoint recorded; "
                        "it must agree with the recorded one on the ZeRO stage, precision, "
                        "gradient clipping, fp32 gradient accumulation and offload. Needed "
                        "only for a checkpoint that records none (an older gockpt's): then "
                        "the config the run trained with")
    s.add_argument("--rank", type=int, metavar="R",
                   help="checkpoint written by several ranks: export rank R's part (default 0)")
    s.set_defaults(func="export:cmd_export")

    s = sub.add_parser("list", help="checkpoints of a run directory, latest and leftovers")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func="listing:cmd_list")

    s = sub.add_parser("clean", help="remove .tmp-* leftovers of writers that died")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--memory", action="store_true",
                   help="also remove the memory tier's copies of DIR's checkpoints")
    s.add_argument("--memory-dir", default=None, metavar="D",
                   help="the memory tier's directory (Config.memory_dir; default /dev/shm)")
    s.set_defaults(func="listing:cmd_clean")

    s = sub.add_parser("goodput", help="a run's goodput: its wall time by category (productive, "
                                       "checkpoint, restore, wasted, other) across restarts")
    s.add_argument("dir", metavar="DIR", help="the run directory (its metrics.jsonl)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--plot", metavar="FILE",
                   help="also draw progress against wall time and the categories (PNG or SVG)")
    s.set_defaults(func="goodput:cmd_goodput")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse printed usage and the error (status 2) or --help (0)
        return int(exc.code or 0)
    return quiet_on_broken_pipe(lambda: _command(args))  # `gockpt inspect ... | head`


def _command(args) -> int:
    """Run the parsed command (``module:function`` of this package, imported now: a command
    costs only its own imports -- ``export`` brings DCP, half a second): its exit status, or
    a one-line error and its status."""
    module, function = args.func.split(":")
    try:
        return getattr(importlib.import_module(f".{module}", __package__), function)(args)
    except BrokenPipeError:  # the reader went away: quiet_on_broken_pipe
        raise
    except (UsageError, BadCheckpoint, GockptError, OSError) as exc:
        ours = isinstance(exc, (UsageError, BadCheckpoint))  # written as one line
        print(f"{PROG}: error: {exc if ours else one_line(exc)}", file=sys.stderr)
        return _exit_status(exc)


def _exit_status(exc: BaseException) -> int:
    """1: the checkpoint is bad; 2: usage, nothing found there, or the system refused."""
    if isinstance(exc, (UsageError, CheckpointNotFoundError, ConfigError)):
        return 2
    if isinstance(exc, (BadCheckpoint, CorruptCheckpointError)):
        return 1
    return 2 if isinstance(exc, OSError) else 1
