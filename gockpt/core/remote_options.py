"""How the remote tier reaches its object store (``Config.remote_options``): one dataclass,
one docstring per field, validated on creation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

from .errors import ConfigError
from .paths import split_remote


@dataclass
class RemoteOptions:
    """How to reach the object store (``Config.remote_options``). Every field left ``None``
    comes the standard way (the AWS_* environment variables, then the AWS config files)."""

    endpoint: Optional[str] = None
    """The store's URL for an S3-compatible store (``http://127.0.0.1:8333``,
    ``https://minio.internal``); ``None``: ``AWS_ENDPOINT_URL``, else AWS S3 itself."""

    region: Optional[str] = None
    """``None``: ``AWS_REGION``/``AWS_DEFAULT_REGION``, the profile's ``region``, ``us-east-1``."""

    access_key_id: Optional[str] = None
    secret_access_key: Optional[str] = None
    session_token: Optional[str] = None

    profile: Optional[str] = None
    """The profile of the AWS config files to take credentials and region from (``None``:
    ``AWS_PROFILE``, else ``default``); used only when neither these options nor the
    environment give credentials."""

    allow_http: Optional[bool] = None
    """Plain HTTP to the endpoint; ``None``: when the endpoint says ``http://``."""

    timeout_s: float = 120.0
    """A request that has not completed in this many seconds fails (and is retried)."""

    connect_timeout_s: float = 10.0

    max_retries: int = 3
    """Retries of one request (with the client's backoff) before the operation fails; the
    replicator then tries the whole checkpoint again later (``Config.remote_retry_s``)."""

    part_bytes: int = 16 << 20
    """Size of one part of a multipart upload and of one ranged read."""

    concurrency: int = 8
    """Requests in flight per upload or read (memory: about ``concurrency * part_bytes``)."""

    def __post_init__(self):
        for name in ("endpoint", "region", "access_key_id", "secret_access_key",
                     "session_token", "profile"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"remote_options.{name} must be None or a non-empty string, "
                                  f"got {v!r}")
        if self.allow_http is not None and not isinstance(self.allow_http, bool):
            raise ConfigError(f"remote_options.allow_http must be None or a bool, got "
                              f"{self.allow_http!r}")
        for name in ("timeout_s", "connect_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"remote_options.{name} must be seconds > 0, got {v!r}")
        if type(self.max_retries) is not int or self.max_retries < 0:
            raise ConfigError(f"remote_options.max_retries must be an int >= 0, got "
                              f"{self.max_retries!r}")
        if type(self.part_bytes) is not int or self.part_bytes < (5 << 20):
            raise ConfigError("remote_options.part_bytes must be an int >= 5 MiB (S3's smallest "
                              f"part), got {self.part_bytes!r}")
        if type(self.concurrency) is not int or self.concurrency < 1:
            raise ConfigError(f"remote_options.concurrency must be an int >= 1, got "
                              f"{self.concurrency!r}")

    @classmethod
    def of(cls, value) -> "RemoteOptions":
        """``value`` (None, a dict of fields, or RemoteOptions) as RemoteOptions."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ConfigError(f"remote_options: unknown option(s) {sorted(unknown)}")
            return cls(**value)
        raise ConfigError(f"remote_options must be None, a dict or RemoteOptions, got {value!r:.80}")


def check_remote(url: Optional[str], options, keep_last: Optional[int], retry_s: float,
                 wait_s: Optional[float]) -> Tuple[Optional[str], RemoteOptions]:
    """The remote tier's settings (``Config``'s ``remote*`` fields, ``GockptWriter``'s
    arguments of the same names) checked: ConfigError naming a bad one; the URL without a
    trailing ``/`` and the options as :class:`RemoteOptions`."""
    if url is not None:
        try:
            split_remote(url)
        except ValueError as exc:
            raise ConfigError(f"remote: {exc}") from None
        url = url.rstrip("/")
    options = RemoteOptions.of(options)
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise ConfigError(f"remote_keep_last must be None or an int >= 1, got {keep_last!r}")
    if isinstance(retry_s, bool) or not isinstance(retry_s, (int, float)) or not retry_s > 0:
        raise ConfigError(f"remote_retry_s must be seconds > 0, got {retry_s!r}")
    if wait_s is not None and (isinstance(wait_s, bool) or not isinstance(
            wait_s, (int, float)) or wait_s < 0):
        raise ConfigError(f"remote_wait_s must be None or seconds >= 0, got {wait_s!r}")
    return url, options
