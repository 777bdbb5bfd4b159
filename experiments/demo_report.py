"""What the gockpt demo prints: headings, progress bars, and one line per committed checkpoint
(read with :func:`gockpt.metrics.read`)."""

from __future__ import annotations

import sys

from gockpt.core import metrics

try:
    from tqdm import tqdm
except ImportError:  # the demo works without it
    tqdm = None

WIDTH = 78


def say(msg: str = "") -> None:
    print(msg, flush=True)


def header(title: str) -> None:
    say()
    say("=" * WIDTH)
    say(f" {title}")
    say("=" * WIDTH)


def section(title: str) -> None:
    say()
    say(f"--- {title} " + "-" * max(3, WIDTH - 5 - len(title)))


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Progress:
    """tqdm when stderr is a terminal; otherwise (logs, pipes) a plain line every ~10%."""

    def __init__(self, total: int, initial: int, desc: str, lines: bool = True):
        self.total, self.desc, self.lines = total, desc, lines
        self.tty = sys.stderr.isatty()
        self.every = max(1, (total - initial) // 10)
        self.bar = None
        if self.tty and tqdm is not None:
            self.bar = tqdm(total=total, initial=initial, desc=f"  {desc}", unit="step",
                            dynamic_ncols=True, leave=True,
                            bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {postfix} "
                                       "[{elapsed}<{remaining}, {rate_fmt}]")

    def update(self, done: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
        elif self.tty:  # no tqdm: one carriage-return line
            sys.stderr.write(f"\r  {self.desc}: step {done}/{self.total}  loss {loss:.3f}  ")
            sys.stderr.flush()
        elif self.lines and (done % self.every == 0 or done == self.total):
            say(f"  {self.desc}: step {done:>4}/{self.total}  loss {loss:.4f}")

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
            sys.stdout.flush()
        else:
            if self.tty:
                sys.stderr.write("\r" + " " * 60 + "\r")
            say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")


class CommitLog:
    """The checkpoints committed in a directory since the last look: the records gockpt
    appends to its ``metrics.jsonl``, one per committed checkpoint."""

    def __init__(self, directory: str, skip_existing: bool = False):
        self.directory = directory
        self.seen = len(self._records() or []) if skip_existing else 0

    def _records(self):
        """Every record so far; [] before the first commit, None while a line is half written."""
        try:
            return metrics.read(self.directory)
        except FileNotFoundError:
            return []
        except ValueError:
            return None  # read again at the next look

    def new(self) -> list:
        """The records committed since the previous call, oldest first."""
        records = self._records()
        if records is None:
            return []
        fresh, self.seen = records[self.seen:], len(records)
        return fresh

    def print_new(self, bar: Progress) -> None:
        """One line per checkpoint committed since the previous look."""
        for m in self.new():
            bar.write(describe_commit(m))


def describe_commit(m: dict) -> str:
    k = m["overlap_steps"]
    span = (f"captured over steps {m['start_step']}..{m['final_step']}" if k > 1
            else f"captured at step {m['final_step']}")
    return (f"  [ckpt] step {m['final_step']:>4} durable   K={k} ({span})  "
            f"training blocked {m['blocked_s'] * 1e3:5.1f} ms  "
            f"durable after {m['time_to_durable_s']:.2f} s")
