"""How gockpt reaches an object store and reads its answers: obstore's settings for a
bucket (:func:`store_config`) and a failed request as a :class:`StorageError` that says what
to check (:func:`storage_error`).

Credentials, region and endpoint come the standard way: the options given
(``Config.remote_options``, :class:`RemoteOptions`), else ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL`` (read by obstore), else the profile (``AWS_PROFILE`` or ``default``)
of ``~/.aws/credentials`` and ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``,
``AWS_CONFIG_FILE``); ``AWS_*`` variables are read here and nowhere else in gockpt."""

from __future__ import annotations

import configparser
import os
from datetime import timedelta

from ..core.errors import ConfigError, StorageError
from ..core.remote_options import RemoteOptions


def _profile_settings(options: RemoteOptions) -> dict:
    """Credentials and region from the AWS config files' profile, as obstore config keys."""
    profile = options.profile or os.environ.get("AWS_PROFILE") or "default"
    home = os.path.expanduser("~")
    files = [(os.environ.get("AWS_SHARED_CREDENTIALS_FILE")
              or os.path.join(home, ".aws", "credentials"), profile),
             (os.environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
              profile if profile == "default" else f"profile {profile}")]
    found: dict = {}
    for path, section in files:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except configparser.Error as e:
            raise ConfigError(f"cannot parse the AWS config file {path!r}: {e}") from e
        if parser.has_section(section):
            for key in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token",
                        "region", "endpoint_url"):
                if parser.has_option(section, key) and key not in found:
                    found[key] = parser.get(section, key)
    return found


def store_config(bucket: str, options: RemoteOptions) -> dict:
    """obstore's ``S3Store`` keyword arguments for ``bucket``: its config (region, endpoint,
    credentials), client options (timeouts, plain HTTP) and retries."""
    env = os.environ
    cfg: dict = {}
    creds_in_env = bool(env.get("AWS_ACCESS_KEY_ID"))
    profile = {} if (options.access_key_id or creds_in_env) else _profile_settings(options)
    endpoint = options.endpoint or env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL_S3") \
        or profile.get("endpoint_url")
    region = options.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") \
        or profile.get("region") or "us-east-1"
    cfg["region"] = region
    if endpoint:
        cfg["endpoint"] = endpoint
    key_id = options.access_key_id or profile.get("aws_access_key_id")
    secret = options.secret_access_key or profile.get("aws_secret_access_key")
    token = options.session_token or profile.get("aws_session_token")
    if key_id:
        cfg["access_key_id"] = key_id
        if not secret:
            raise ConfigError(f"s3://{bucket}: an access key id without a secret access key")
        cfg["secret_access_key"] = secret
        if token:
            cfg["session_token"] = token
    allow_http = options.allow_http if options.allow_http is not None else \
        bool(endpoint and endpoint.startswith("http://"))
    client = {"timeout": f"{options.timeout_s}s", "connect_timeout": f"{options.connect_timeout_s}s",
              "allow_http": allow_http}
    retry = {"max_retries": options.max_retries, "backoff": {
        "init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15),
        "base": 2.0},
        "retry_timeout": timedelta(seconds=options.timeout_s * (options.max_retries + 1))}
    return {"config": cfg, "client_options": client, "retry_config": retry}


def describe(e: BaseException) -> str:
    """An obstore error in one line (its text carries a multi-line debug dump)."""
    text = str(e).split("\n\nDebug source:", 1)[0].strip()
    return f"{type(e).__name__}: {text}"


# What a refusal of the credentials means, and which settings to look at.
_REFUSED_HINT = ("; the store refused these credentials for this bucket: check the access key "
                 "and secret (Config.remote_options access_key_id / secret_access_key / profile, "
                 "else AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE), the region and "
                 "endpoint, and that the key may read and write the bucket")


def storage_error(doing: str, e: BaseException) -> StorageError:
    """``e`` (an obstore error) while ``doing`` something, as a StorageError; a refusal of the
    credentials says which settings to check."""
    refused = type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError")
    return StorageError(f"{doing}: {describe(e)}" + (_REFUSED_HINT if refused else ""))
