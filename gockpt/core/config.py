"""The Checkpointer's options: one dataclass, one docstring per field, validated on creation."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Callable, Collection, Dict, Mapping, Optional, Sequence, Tuple, Union

from .errors import ConfigError, StorageError
from .modes import MODES, POLICIES, Mode, ModePolicy
from .paths import is_remote, real_directory
from .remote_options import RemoteOptions, check_remote


class _Named(str, enum.Enum):
    """An option value: a ``str`` (users pass ``"wait"``; ``OnBusy.WAIT == "wait"``)."""

    def __str__(self) -> str:
        return self.value


class OnBusy(_Named):
    """What a checkpoint due while the previous one is still persisting does."""

    WAIT = "wait"
    SKIP = "skip"


class GradTransport(_Named):
    """How the replay modes carry gradients across the link."""

    FP32 = "fp32"
    BF16 = "bf16"


class Interval(_Named):
    """The interval that is not a number of steps."""

    AUTO = "auto"  # Young/Daly's N*, re-measured (Config.interval)


GRAD_TRANSPORTS = tuple(t.value for t in GradTransport)


@dataclass
class Config:
    """Options of a :class:`gockpt.Checkpointer`. Every field is validated in ``__post_init__``."""

    directory: str
    """Root directory of the run's checkpoints: one sub-directory per checkpoint, a ``latest``
    pointer and ``metrics.jsonl``. Created if missing; must be writable. Resolved when the
    Checkpointer is built, as the kernel resolves a path (:mod:`gockpt.core.paths`: absolute, links
    followed, ``..`` only after a name that exists), so that ``gockpt.load`` and the tools find
    it under the same string. One Checkpointer (one job) writes a directory at a time."""

    mode: Mode = Mode.GOCKPT_O
    """What may block training (see :mod:`gockpt.core.modes`): ``sync`` copies and writes at the step
    boundary; ``async`` copies at the boundary and writes in the background; ``async-o`` lets the
    copies ride under the next step's forward/backward; ``gockpt`` spreads them over K steps and
    replays the gradients in between; ``gockpt-o`` also overlaps the gradient copies with the
    update and the next forward."""

    overlap_steps: Optional[int] = None
    """K, the number of steps one checkpoint spans in the gockpt modes (F = start + K - 1).
    ``None`` picks K from the measured forward/backward time and copy bandwidth. Ignored (K = 1)
    by the other modes."""

    interval: Union[int, Interval, None] = None
    """Start a checkpoint at every step divisible by ``interval``; ``None``: only when forced;
    ``"auto"``: every N* steps, N* recomputed after each checkpoint from its measured stall and
    step time and ``mtbf`` (Young/Daly, see :mod:`gockpt.interval`)."""

    mtbf: Optional[float] = None
    """Mean time between failures in seconds; required by ``interval="auto"``."""

    first_auto_step: int = 10
    """With ``interval="auto"``: the step of the first checkpoint, which measures the stall."""

    block_bytes: int = 4 << 20
    """Size of one block of fp32 state: the unit of copy and replay (default 4 MiB)."""

    verify: bool = True
    """Check every stored parameter and optimizer state tensor against the live state at F
    before committing, in every mode: the training device digests the live tensors, read
    through torch as the framework presents them, under the next forward/backward (the next
    update waits for it), the staged host copy is digested after the replay, and they must
    agree (:mod:`gockpt.core.digest`). Tensors that differ were written outside the
    attached optimizer, or in place while being read: that checkpoint is not committed (a
    warning names them) and they are copied directly at F from then on; a copied tensor that
    differs fails the checkpoint. The digests are stored, and ``load`` / ``verify`` check the
    data against them. ``False`` trusts the copy and the replay (not recommended)."""

    self_check: float = 0.0
    """Fraction of replayed blocks also compared with a direct copy taken at version F (at
    least one block per checkpoint when positive): a debugging aid for the replay itself, on
    top of ``verify``. A mismatch fails the checkpoint with ConsistencyError."""

    self_check_strict: bool = True
    """A self-check mismatch fails the checkpoint (it is never committed). ``False`` only warns."""

    on_busy: OnBusy = OnBusy.WAIT
    """A checkpoint due while the previous one is still persisting: ``wait`` for it (counted as
    blocked time) or ``skip`` the new one with a warning."""

    keep_last: Optional[int] = None
    """Keep only the newest ``keep_last`` committed checkpoints; older ones are deleted after a
    newer one is committed (never the one being written). ``None`` keeps all."""

    max_host_bytes: Optional[int] = None
    """Refuse at construction if the planned host staging memory (one copy of the state, the
    gradient buffers in flight, and training on the CPU in gockpt-o two gradient snapshots)
    exceeds this many bytes. ``None``: no cap."""

    replay_threads: Optional[int] = None
    """Threads of the C++ replay kernel; ``None``: the number of CPU cores."""

    grad_transport: GradTransport = GradTransport.FP32
    """How the replay modes carry the gradients they replay across the link: ``fp32`` (the
    consumed gradient as it is) or ``bf16`` (2 bytes per element: a bfloat16 image of the
    consumed gradient divided by ``grad_multiplier``, plus that one float32 scalar). bf16 is
    for training whose consumed gradients are bf16 values times one scale (bf16 gradients,
    unscaled or clipped by one coefficient, as DeepSpeed's ZeRO 1/2 in bf16). Each step's
    images are checked on the device to give back every gradient bit for bit; a step where
    they do not is carried in fp32. ``metrics.grad_transport`` says what was used."""

    grad_multiplier: Optional[Callable] = None
    """With ``grad_transport="bf16"``: a zero-argument callable returning the float32 scalar
    (a one-element tensor, or None for 1) the gradients of the step about to run were last
    multiplied by (e.g. the clipping coefficient); called in the optimizer's step pre-hook."""

    emulate_link_gbps: Optional[float] = None
    """Training on the CPU only: perform the device-to-host copies at this rate (GB/s, 1e9
    bytes/s) as if through a PCIe-like link, with completion by events -- the GPU device
    layer's contract on a machine without one, to develop, test and benchmark the overlap.
    ``None``: copies at memory speed."""

    replicated: Union[None, bool, Collection[str]] = None
    """Which state every rank holds identically (data parallelism). The replicas split it into
    disjoint shares balanced by bytes: each rank copies, replays and writes about 1/N of it.
    ``None``: detected when the Checkpointer is built -- true for a ``DistributedDataParallel``
    or ``DataParallel`` model (compiled or not). ``True``: all of it (such a checkpoint may be
    loaded on another number of ranks). ``False``: each rank its own state, loaded only on the
    number of ranks that wrote it. A collection of parameter names (``state_dict`` names as
    the checkpoint stores them, without wrapper prefixes): those parameters and their
    optimizer state are replicated and split; every other parameter must be this rank's block
    of a global tensor -- a DTensor, or named in ``global_slices`` -- as DeepSpeed ZeRO 1/2's
    module weights (replicated) and fp32 master partitions (one per rank). Kept as a
    ``frozenset``. Unless ``False``, a DTensor parameter (FSDP2, tensor parallelism) is
    replicated as its placements say: the ranks along its mesh's ``Replicate()`` dimensions
    (HSDP's replicate dimension) hold the same local shard and split it, with its optimizer
    state, into shares."""

    global_slices: Optional[Mapping[str, Tuple[Sequence[int], Sequence[int]]]] = None
    """Parameters that are this rank's block of a larger tensor partitioned across the ranks by
    your own code (a DTensor says so itself): parameter name -> ``(global shape, offsets of
    this rank's tensor in it)``, one int per dimension. Recorded in the rank's part and in the
    checkpoint's global index (as DeepSpeed ZeRO's flat fp32 partitions are: 1-D slices of
    each flat param group). Loaded on the number of ranks that wrote it."""

    step_written: Optional[Collection[str]] = None
    """Parameters the attached optimizer does not update but that only the training's own
    step writes, after ``update_begin`` (DeepSpeed's bf16 module weights, which its step
    writes from the fp32 masters): instead of being copied at the boundary of F, blocking, like
    other parameters it does not update (a forward may write those), they are copied with the
    last capture group under the next forward/backward. The verification against the live
    state at F catches one written elsewhere (that checkpoint is not committed and the
    parameter is copied at the boundary from then on). Names as ``replicated``'s; each must be
    a parameter the optimizer does not update (ConfigError otherwise). Kept as a
    ``frozenset``."""

    storage_writer: Optional[Callable] = None
    """Storage plugin: ``storage_writer(root, name)`` returns the writer of one checkpoint, a
    :class:`gockpt.core.protocols.StorageWriter` (its call order is documented there), usually
    a subclass of :class:`gockpt.storage.CheckpointWriter`.
    ``None``: :class:`~gockpt.storage.CheckpointWriter`. Tests inject faults through it."""

    remote: Optional[str] = None
    """The remote tier: ``"s3://bucket/prefix"`` of an S3 or S3-compatible store. Each
    checkpoint committed in ``directory`` is then uploaded there in the background
    (:mod:`gockpt.storage.replicate`: data first, manifests last, the store's ``latest`` moved
    only once every object is uploaded and checked); training never waits for it. A restart
    loads from it with ``gockpt.load("s3://bucket/prefix", ...)``. On several ranks rank 0
    uploads every rank's part (the directory is shared)."""

    remote_options: Union[None, Mapping, RemoteOptions] = None
    """How to reach the store (a :class:`RemoteOptions` or a dict of its fields: endpoint,
    region, credentials, timeouts, part size, concurrency); ``None``: the AWS_* environment
    variables and AWS config files. Kept as a ``RemoteOptions``; ``gockpt.load`` and the tools
    in this process reach the bucket with them too."""

    remote_keep_last: Optional[int] = None
    """Keep only the newest ``remote_keep_last`` checkpoints in the store (never the one its
    ``latest`` names); ``None`` keeps all. Independent of ``keep_last``."""

    remote_retry_s: float = 5.0
    """Seconds before a failed upload is tried again, doubled after each failure (up to 5
    minutes) and reset by a success."""

    remote_wait_s: Optional[float] = None
    """How long ``close()`` (and the exit of a process that did not call it) waits for the
    uploads still running or queued -- the job's last checkpoints must leave the node before
    it ends: ``None``: until they are uploaded, or until an upload fails meanwhile (the store
    is down: the job still ends); else at most that many seconds (``0``: not at all). It says
    how far the uploads are every 30 s, and what is left in a warning; the next Checkpointer
    of this directory uploads that. ``wait_remote()`` waits when you ask."""

    memory: Union[None, int, str] = None
    """The memory tier (off by default): each checkpoint committed in ``directory`` is also
    kept in host shared memory (``memory_dir``, written from the host copy at F: no second
    device copy), the previous one until the new one is complete (:mod:`gockpt.storage.memory_tier`).
    A process restarted on the same host after a crash then loads it at memory speed:
    ``gockpt.load`` takes it when it is the checkpoint the disk's ``latest`` names and verifies,
    else it says why and loads from disk. ``"auto"``: the space two copies need, the tier off
    with a warning when ``memory_dir`` has less free; a number: at most that many bytes
    (ConfigError when two copies do not fit, checked when the Checkpointer is built).
    ``close()`` and ``gockpt clean`` remove the copies. Several ranks on one host keep one
    whole copy together (each its part, its lowest rank the top manifest); on several hosts
    each rank's part is also kept by a rank on the next host, from which a restart that lost
    its host's memory takes it (:mod:`gockpt.storage.peers`)."""

    memory_log: Optional[int] = None
    """The memory tier's step log (off by default; needs ``memory``; not through DeepSpeed): at
    most this many bytes of host shared memory for an entry per training step after the newest
    checkpoint -- the gradients its update consumed (4 bytes a parameter; 2 in a step whose
    float32 gradients are all bfloat16 values, as bf16 autocast's are), its small state and
    the digests of the state after it (:mod:`gockpt.steplog`). ``gockpt.load`` then replays
    the logged steps after the newest checkpoint through the optimizer, checked against the
    last one's digests: a crash costs the step in progress, not the steps since the
    checkpoint. A checkpoint is taken at least every half of the entries the log holds
    (whatever ``interval`` says); fewer than 4 entries is a ConfigError. Per rank: on DDP and
    FSDP2 each rank keeps its own (never sent to a peer), a host's ``memory_dir`` this times
    the ranks on that host (ConfigError when the Checkpointer is built if it does not fit
    there beside the copies)."""

    memory_dir: str = "/dev/shm"
    """The tmpfs of the memory tier (``gockpt.load(memory_dir=...)`` must be given the same)."""

    exit_wait_s: float = 60.0
    """On several ranks, when the interpreter exits with this Checkpointer still open (no
    ``close()``, no exception): how long it waits for every other rank to reach its own exit
    before committing the checkpoint in flight; past that it is abandoned
    (:meth:`~gockpt.Checkpointer.abort`). A rank leaving the loop while the others train on
    would otherwise wait for them in the commit while they wait for it in a training
    collective. On an uncaught exception it is abandoned at once."""

    def __post_init__(self):
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise ConfigError(f"directory must be a path, got {self.directory!r}")
        if is_remote(self.directory):
            raise ConfigError(f"directory must be a local path (checkpoints commit there at disk "
                              f"speed); to copy them to {self.directory!r} too, pass it as "
                              "remote=")
        # Resolved now, as the kernel resolves it (gockpt.core.paths: the directory gockpt.load and
        # the tools find under the same string); a later os.chdir() must not move checkpoints.
        try:
            self.directory = real_directory(self.directory)
        except FileNotFoundError as exc:  # x/.. with no x: the string names no directory
            raise ConfigError(f"directory {os.fspath(self.directory)!r}: {exc.strerror}") from exc
        except OSError as exc:  # a file on the way, no permission: not a place to write
            raise StorageError(f"checkpoint directory {os.fspath(self.directory)!r} is not a "
                               f"writable directory ({exc.strerror or exc}); pass a path you "
                               "can write to") from exc
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        self.mode = Mode(self.mode)
        if self.overlap_steps is not None:
            if isinstance(self.overlap_steps, bool) or not isinstance(self.overlap_steps, int) \
                    or self.overlap_steps < 1:
                raise ConfigError(
                    f"overlap_steps must be None or an int >= 1, got {self.overlap_steps!r}")
        if isinstance(self.interval, str) and self.interval == Interval.AUTO:
            self.interval = Interval.AUTO
            if isinstance(self.mtbf, bool) or not isinstance(self.mtbf, (int, float)) \
                    or not self.mtbf > 0:
                raise ConfigError("interval='auto' needs mtbf=SECONDS (the mean time between "
                                  f"failures, > 0); got mtbf={self.mtbf!r}")
        elif self.interval is not None:
            if isinstance(self.interval, bool) or not isinstance(self.interval, int) \
                    or self.interval < 1:
                raise ConfigError(
                    f"interval must be None, 'auto' or an int >= 1, got {self.interval!r}")
        if not isinstance(self.first_auto_step, int) or self.first_auto_step < 1:
            raise ConfigError(f"first_auto_step must be an int >= 1, got {self.first_auto_step!r}")
        if not isinstance(self.block_bytes, int) or self.block_bytes < 64:
            raise ConfigError(f"block_bytes must be an int >= 64, got {self.block_bytes!r}")
        if not isinstance(self.self_check, (int, float)) or not 0.0 <= self.self_check <= 1.0:
            raise ConfigError(f"self_check must be a fraction in [0, 1], got {self.self_check!r}")
        if not isinstance(self.verify, bool):
            raise ConfigError(f"verify must be True or False, got {self.verify!r}")
        if self.on_busy not in ("wait", "skip"):
            raise ConfigError(f"on_busy must be 'wait' or 'skip', got {self.on_busy!r}")
        self.on_busy = OnBusy(self.on_busy)
        for name in ("keep_last", "max_host_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{name} must be None or an int >= 1, got {value!r}")
        if self.emulate_link_gbps is not None and (
                isinstance(self.emulate_link_gbps, bool)
                or not isinstance(self.emulate_link_gbps, (int, float))
                or not self.emulate_link_gbps > 0):
            raise ConfigError(f"emulate_link_gbps must be None or a rate > 0 in GB/s, got "
                              f"{self.emulate_link_gbps!r}")
        if self.grad_transport not in GRAD_TRANSPORTS:
            raise ConfigError(f"grad_transport must be one of {', '.join(GRAD_TRANSPORTS)}; "
                              f"got {self.grad_transport!r}")
        self.grad_transport = GradTransport(self.grad_transport)
        if self.grad_multiplier is not None and not callable(self.grad_multiplier):
            raise ConfigError(f"grad_multiplier must be None or a callable, got "
                              f"{self.grad_multiplier!r}")
        if self.replicated is not None and not isinstance(self.replicated, bool):
            if isinstance(self.replicated, (str, bytes)) or not isinstance(
                    self.replicated, Collection) or not all(
                    isinstance(n, str) for n in self.replicated):
                raise ConfigError("replicated must be None, True, False or a collection of "
                                  f"parameter names, got {self.replicated!r:.80}")
            self.replicated = frozenset(self.replicated)
        if self.global_slices is not None:
            self.global_slices = _global_slices(self.global_slices)
        if self.step_written is not None:
            if isinstance(self.step_written, (str, bytes)) or not all(
                    isinstance(n, str) for n in self.step_written):
                raise ConfigError(f"step_written must be a collection of parameter names, got "
                                  f"{self.step_written!r}")
            self.step_written = frozenset(self.step_written)
        if self.storage_writer is not None and not callable(self.storage_writer):
            raise ConfigError(f"storage_writer must be a callable (root, name) -> writer, got "
                              f"{self.storage_writer!r}")
        self.remote, self.remote_options = check_remote(
            self.remote, self.remote_options, self.remote_keep_last, self.remote_retry_s,
            self.remote_wait_s)
        if isinstance(self.exit_wait_s, bool) or not isinstance(
                self.exit_wait_s, (int, float)) or not self.exit_wait_s >= 0:
            raise ConfigError(f"exit_wait_s must be seconds >= 0, got {self.exit_wait_s!r}")
        if self.memory is not None and self.memory != "auto" and (
                type(self.memory) is not int or self.memory < 1):
            raise ConfigError(f"memory must be None, 'auto' or a number of bytes >= 1, got "
                              f"{self.memory!r}")
        if self.memory_log is not None and (type(self.memory_log) is not int
                                            or self.memory_log < 1 or self.memory is None):
            raise ConfigError(f"memory_log must be None or a number of bytes >= 1 with the "
                              f"memory tier on (memory=...), got memory_log={self.memory_log!r}, "
                              f"memory={self.memory!r}")
        if not isinstance(self.memory_dir, (str, os.PathLike)) or not str(self.memory_dir):
            raise ConfigError(f"memory_dir must be a path, got {self.memory_dir!r}")
        self.memory_dir = os.fspath(self.memory_dir)
        if self.memory is not None and not os.path.isdir(self.memory_dir):
            raise ConfigError(f"memory_dir {self.memory_dir!r} is not a directory (the memory "
                              "tier writes its copies there: a tmpfs such as /dev/shm)")
        if self.replay_threads is not None and (
                not isinstance(self.replay_threads, int) or self.replay_threads < 1):
            raise ConfigError(
                f"replay_threads must be None or an int >= 1, got {self.replay_threads!r}")

    @property
    def policy(self) -> ModePolicy:
        """What the mode does (:mod:`gockpt.core.modes`)."""
        return POLICIES[self.mode]

    def fixed_overlap_steps(self) -> Optional[int]:
        """K when it does not depend on measurements, else ``None``."""
        return self.policy.fixed_k or self.overlap_steps


def _global_slices(value) -> Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """``Config.global_slices`` checked: name -> (global shape, offsets), tuples of ints."""
    def ints(v) -> bool:
        return isinstance(v, Sequence) and not isinstance(v, (str, bytes)) and all(
            type(x) is int and x >= 0 for x in v)

    if not isinstance(value, Mapping):
        raise ConfigError(f"global_slices must be a mapping name -> (global shape, offsets), "
                          f"got {value!r:.80}")
    out = {}
    for name, entry in value.items():
        if not isinstance(name, str) or not isinstance(entry, Sequence) or len(entry) != 2 \
                or not ints(entry[0]) or not ints(entry[1]) or len(entry[0]) != len(entry[1]):
            raise ConfigError(f"global_slices[{name!r}] must be (global shape, offsets): two "
                              f"sequences of ints >= 0 of one length, got {entry!r:.80}")
        out[name] = (tuple(entry[0]), tuple(entry[1]))
    return out


def check_step(step) -> None:
    """A training step number given to a hook must be an int (ConfigError otherwise)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError(f"step must be an int, got {step!r}")
