"""Attacks on a real checkpoint directory, for the loader fuzz test (tests/test_fuzz_load.py)
and its longer run (experiments/fuzz_load.py): bytes flipped, files cut, deleted or replaced
by special files, manifests mutated as JSON (left unsealed, as damage or a hand edit leaves
them) and manifests whose storage fields are rewritten and sealed again (as a buggy writer
would leave them). Each attack is drawn from a seeded ``random.Random``; :func:`check` then
loads and verifies the attacked copy and says whether the outcome is one of the two allowed:
the identical state, or a gockpt error that names what is damaged."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch
from torch import nn

import gockpt
from gockpt import storage
from gockpt.storage.format import DATA_FILE, LATEST_FILE, MANIFEST_FILE

from tests._support.manifests import read_raw, write_sealed

STEPS = (3, 6)


class Model(nn.Module):
    """Two large layers (stored one tensor each) and 40 small parameters (stored in packs)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 4)
        self.small = nn.ParameterList([nn.Parameter(torch.randn(6)) for _ in range(40)])

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + sum(p.sum() for p in self.small)


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def make_template(root: str) -> None:
    """Checkpoints of steps 3 and 6 (gockpt-o, K=2) in ``root``, with an extra state that
    exercises the state encoder (tensors, numpy values, nesting)."""
    model, opt, sched = build()
    ck = gockpt.Checkpointer(model, opt, root, mode="gockpt-o", overlap_steps=2,
                             scheduler=sched, interval=3, block_bytes=1024)
    g = torch.Generator().manual_seed(0)
    for step in range(max(STEPS)):
        ck.backward_begin()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        ck.update_begin()
        opt.step()
        sched.step()
        opt.zero_grad()
        ck.save_checkpoint(step + 1, extra_state={
            "pos": step + 1, "t": torch.arange(3.0), "np": np.float32(1.5),
            "a": np.arange(4), "nested": [{"x": (1, "two", None)}]})
    ck.close()


def snapshot(model, opt, sched, extra=None) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": opt.state_dict(), "sched": sched.state_dict(), "extra": extra}


def same(a, b) -> bool:
    """Bitwise equality of nested state."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                        b.reshape(-1).view(torch.uint8) if b.numel() else b)
    if isinstance(a, np.ndarray) or isinstance(a, np.generic):
        return type(a) is type(b) and a.tobytes() == b.tobytes() and a.dtype == b.dtype
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b or (a != a and b != b)


def load_state(run: str, **kw):
    model, opt, sched = build(seed=123)
    restored = gockpt.load(run, model, opt, scheduler=sched, restore_rng=False, **kw)
    return restored.step, snapshot(model, opt, sched, restored.extra_state)


def references(run: str) -> dict:
    """step -> the state each checkpoint of the intact ``run`` loads as."""
    return {s: load_state(run, tag=storage.checkpoint_name(s))[1] for s in STEPS}


# ------------------------------------------------------------------ attacks

@dataclass
class Attack:
    kind: str
    target: str          # path relative to the run directory
    detail: str = ""
    names: List[str] = field(default_factory=list)  # what an error may name
    sealed: bool = False  # a rewrite sealed again (the storage fields), not damage


def _files(run: str, rng: random.Random) -> str:
    step = rng.choice(STEPS)
    return rng.choice([LATEST_FILE, f"{storage.checkpoint_name(step)}/{MANIFEST_FILE}",
                       f"{storage.checkpoint_name(step)}/{DATA_FILE}",
                       f"{storage.checkpoint_name(max(STEPS))}/{MANIFEST_FILE}",
                       f"{storage.checkpoint_name(max(STEPS))}/{DATA_FILE}"])


def flip(run, rng) -> Attack:
    rel = _files(run, rng)
    path = os.path.join(run, rel)
    data = bytearray(open(path, "rb").read())
    i = rng.randrange(len(data))
    bit = rng.randrange(8)
    data[i] ^= 1 << bit
    open(path, "wb").write(bytes(data))
    return Attack("flip", rel, f"byte {i} bit {bit}")


def truncate(run, rng) -> Attack:
    rel = _files(run, rng)
    path = os.path.join(run, rel)
    size = os.path.getsize(path)
    n = rng.choice([0, 1, rng.randrange(size + 1), max(0, size - 1), size // 2])
    os.truncate(path, n)
    return Attack("truncate", rel, f"to {n} of {size} bytes")


def delete(run, rng) -> Attack:
    rel = _files(run, rng)
    os.unlink(os.path.join(run, rel))
    return Attack("delete", rel)


def special(run, rng) -> Attack:
    rel = _files(run, rng)
    path = os.path.join(run, rel)
    os.unlink(path)
    what = rng.choice(["fifo", "dir", "zero", "loop", "empty", "dangling"])
    if what == "fifo":
        os.mkfifo(path)
    elif what == "dir":
        os.mkdir(path)
    elif what == "zero":
        os.symlink("/dev/zero", path)
    elif what == "loop":
        os.symlink(path, path)
    elif what == "dangling":
        os.symlink(path + ".gone", path)
    else:
        open(path, "wb").close()
    return Attack("special", rel, what)


def _manifest(run, rng) -> str:
    return f"{storage.checkpoint_name(rng.choice(STEPS))}/{MANIFEST_FILE}"


def _nodes(x, path=()):
    """Every (path, value) of a JSON value."""
    yield path, x
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _nodes(v, path + (i,))


def _set(root, path, value) -> None:
    for k in path[:-1]:
        root = root[k]
    root[path[-1]] = value


def _delete(root, path) -> None:
    for k in path[:-1]:
        root = root[k]
    if isinstance(root, dict):
        del root[path[-1]]
    else:
        root.pop(path[-1])


def _mutant(rng: random.Random, value):
    """A value of the same or another JSON type, often near the original."""
    choices = [None, True, 0, -1, 1, 2 ** 31, 2 ** 63, 2 ** 64 + 1, -2 ** 63, 1e308, 0.5,
               "", "x", "../x", "\udcff", [], {}, [0] * 3, {"__t": "np", "dtype": "<f8"},
               {"__t": "tensor", "k": "nope"}]
    if isinstance(value, bool):
        choices += [not value]
    elif isinstance(value, int):
        choices += [value + 1, value - 1, value * 2, value ^ (1 << rng.randrange(62))]
    elif isinstance(value, float):
        choices += [value * 2, -value, float("inf"), float("nan")]
    elif isinstance(value, str):
        choices += [value + "x", value[:-1], value.upper()]
    elif isinstance(value, list) and value:
        choices += [value[:-1], value + value[-1:], list(reversed(value))]
    return rng.choice(choices)


def json_mutation(run, rng, sealed=False, section=None) -> Attack:
    """A structured change of a manifest: a value replaced, a key deleted or a list element
    duplicated; written back unsealed (damage), or -- ``sealed``, limited to ``section`` --
    sealed again."""
    rel = _manifest(run, rng)
    path = os.path.join(run, rel)
    data = read_raw(path)
    scope = data if section is None else data.get(section[0], {})
    if section is not None:
        for k in section[1:]:
            scope = scope.get(k, {}) if isinstance(scope, dict) else {}
    nodes = [(p, v) for p, v in _nodes(scope) if p]
    if not nodes:
        return Attack("none", rel)
    p, v = rng.choice(nodes)
    full = tuple(section or ()) + p
    how = rng.choice(["replace", "replace", "delete"])
    if how == "replace":
        _set(data, full, _mutant(rng, v))
    else:
        _delete(data, full)
    names = [str(k) for k in full if isinstance(k, str)]
    if sealed:
        write_sealed(path, data)
    else:
        data.pop("manifest_crc32c", None)
        open(path, "w").write(json.dumps(data, allow_nan=True))
    return Attack("sealed" if sealed else "json", rel, f"{how} {list(full)!r:.120}", names,
                  sealed)


# The storage fields a rewrite may damage: what the loader checks against the data.
SEALED_SECTIONS = [("tensors",), ("model", "params"), ("model", "digests"),
                   ("optimizer", "aligned"), ("optimizer", "digests")]


def sealed_mutation(run, rng) -> Attack:
    return json_mutation(run, rng, sealed=True, section=list(rng.choice(SEALED_SECTIONS)))


ATTACKS: List[Callable] = [flip, flip, flip, truncate, delete, special, json_mutation,
                           json_mutation, sealed_mutation, sealed_mutation]


# ------------------------------------------------------------------ outcome

class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def check(run: str, refs: dict, attack: Attack, seconds: float = 20.0) -> Optional[str]:
    """Load and verify the attacked ``run``; None if the outcome is allowed, else why not."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return _check(run, refs, attack)
    except Hang:
        return f"hung for {seconds} s"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _named(msg: str, run: str, attack: Attack) -> bool:
    """Whether the error message names the damaged file, a checkpoint or a tensor."""
    base = os.path.basename(attack.target)
    hints = [base, LATEST_FILE, MANIFEST_FILE, DATA_FILE, "tensor", "parameter",
             "optimizer state", "small state", *attack.names]
    return any(h and h in msg for h in hints) or run in msg


def _check(run: str, refs: dict, attack: Attack) -> Optional[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            step, state = load_state(run)
        except gockpt.GockptError as exc:
            if not _named(str(exc), run, attack):
                return f"load: an error that names nothing: {exc}"
        except Hang:
            raise
        except BaseException as exc:  # noqa: BLE001 - the verdict
            return f"load: {type(exc).__name__} (not a gockpt error): {exc}"
        else:
            if step not in refs or not same(refs[step], state):
                return f"load: a state that is not checkpoint {step}'s, without an error"
        try:
            reports = gockpt.verify(run, all=True).checkpoints
        except gockpt.CheckpointNotFoundError:
            reports = []
        except Hang:
            raise
        except BaseException as exc:  # noqa: BLE001
            return f"verify: {type(exc).__name__}: {exc}"
    for r in reports:
        for b in r.bad:
            if not _named(b.error, run, attack):
                return f"verify: a bad tensor report that names nothing: {b.error}"
    return None


def run_attacks(template: str, work: str, seed: int, count: int, refs: dict,
                on_result=None) -> List[tuple]:
    """``count`` attacks on copies of ``template``; the (attack, why) of each wrong outcome."""
    rng = random.Random(seed)
    wrong = []
    for i in range(count):
        run = os.path.join(work, f"a{i}")
        shutil.copytree(template, run, symlinks=True)
        attack = rng.choice(ATTACKS)(run, rng)
        why = check(run, refs, attack)
        if why is not None:
            wrong.append((attack, why))
        if on_result is not None:
            on_result(i, attack, why)
        shutil.rmtree(run, ignore_errors=True)
    return wrong


def summary(count: int, wrong: List[tuple]) -> str:
    lines = [f"{count} attacks, {len(wrong)} wrong outcomes"]
    for attack, why in wrong[:20]:
        lines.append(f"  {attack.kind} {attack.target} {attack.detail}: {why}")
    return "\n".join(lines)

