"""Free TCP ports for the tests' servers (a job's rendezvous, an S3 server), chosen below the
kernel's ephemeral range: a port the kernel handed out (``bind(0)``) and that was released is
free again for anything that connects meanwhile -- gloo's and the store's own connections take
ephemeral ports all the time -- and a rank that binds it a second later can find it taken
(EADDRINUSE, seen with 4 pytest workers). Below that range only an explicit bind takes a port,
and each pytest worker draws from its own slice of it."""

import os
import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_LOW = 10000
_WORKERS = 8  # slices: one per pytest-xdist worker (gw0, gw1, ...; more share a slice)


def free_ports(span: int = 1) -> int:
    """A port P such that P .. P + span - 1 are free on 127.0.0.1 now, below the ephemeral
    range, in this pytest worker's slice of it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (max(_ephemeral_low(), _LOW + _WORKERS * 64) - _LOW) // _WORKERS
    low = _LOW + (index % _WORKERS) * width
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(500):
        base = rng.randrange(low, low + width - span)
        socks = []
        try:
            for port in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {span} free port(s) on 127.0.0.1 in {low}..{low + width}")
