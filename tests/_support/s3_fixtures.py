"""The pytest fixtures of a real S3 store (:class:`tests._support.s3server.S3Server`) for the
modules that need one: ``server`` (one per module, its AWS_* variables in the environment
while the module runs: gockpt and the workers find it the standard way) and ``url`` (a fresh
bucket per test, ``s3://<bucket>/runs/one``). The repository's conftest.py registers them
(``pytest_plugins``): a server starts only in a module whose tests ask for one."""

import os
import uuid

import pytest

from tests._support.s3server import S3Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = S3Server(str(tmp_path_factory.mktemp("seaweedfs")))
    s.start()
    saved = {k: os.environ.get(k) for k in s.env()}
    os.environ.update(s.env())  # the standard way: gockpt.load and the workers find it so
    yield s
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    s.stop()


@pytest.fixture
def url(server):
    """A fresh bucket for each test."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    server.warm(bucket)
    return f"s3://{bucket}/runs/one"
