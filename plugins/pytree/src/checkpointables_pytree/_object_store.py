"""Object stores (``s3://``, ``gs://``) through TensorStore's key-value stores.

Their configuration, for two users: ``kvstore_spec(url)`` is the TensorStore
spec of a location, used for the arrays (the OCDBT database) of a pytree
saved there, and ``_kvstore_storage.KvStoreStorage`` (the ``cp.storage.Storage``
of these schemes, for every other file) opens its stores with it.

S3 is configured as boto3 and the AWS CLI are: ``cp.options.StorageOptions``
fields first, then ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the
profile's ``region`` / ``endpoint_url`` / ``services`` entries in
``~/.aws/config``, and finally the instance's or container's role.
TensorStore's own ``s3://`` URL form reads none of the endpoint settings,
so every setting is translated into the spec here.
"""

from __future__ import annotations

import atexit
import configparser
import os
import shutil
import tempfile
import threading
from typing import Any

import attrs
import checkpointables as cp

__all__ = [
    "SCHEMES",
    "S3Settings",
    "s3_settings",
    "kvstore_spec",
    "context_resources",
    "bucket_and_key",
    "google_credentials_hint",
]

SCHEMES = ("s3", "gs")
_TRUE = ("1", "true", "yes")


# -- Configuration ------------------------------------------------------------------------------


@attrs.frozen
class S3Settings:
    """Where and how S3 requests go, resolved from options, environment and config files."""

    endpoint: str | None
    region: str | None
    credentials: dict[str, Any] = attrs.field(eq=False)
    # The credentials' identity (never the secrets themselves), for caching.
    credentials_key: tuple[Any, ...] = ()


def _config_path(variable: str, default: str) -> str:
    return os.path.expanduser(os.environ.get(variable) or default)


def _profile_name(options: cp.options.StorageOptions) -> str:
    return (
        options.profile
        or os.environ.get("AWS_PROFILE")
        or os.environ.get("AWS_DEFAULT_PROFILE")
        or "default"
    )


def _nested(value: str) -> dict[str, str]:
    """The ``key = value`` lines of a nested section (``s3 =\\n  endpoint_url = ...``)."""
    found = {}
    for line in value.splitlines():
        key, sep, rest = line.partition("=")
        if sep:
            found[key.strip()] = rest.strip()
    return found


def _profile_config(profile: str) -> dict[str, str]:
    """``region`` and the S3 ``endpoint_url`` of a profile of ``~/.aws/config``."""
    parser = configparser.RawConfigParser()
    try:
        parser.read(_config_path("AWS_CONFIG_FILE", "~/.aws/config"), encoding="utf-8")
    except configparser.Error:
        return {}  # Unreadable: boto3 would fail too; the requests will say what is missing.
    section = "default" if profile == "default" else f"profile {profile}"
    if not parser.has_section(section):
        return {}
    values = dict(parser.items(section))
    result = {k: v for k, v in values.items() if k in ("region", "endpoint_url")}
    s3 = _nested(values.get("s3", ""))
    services = values.get("services")
    if services and parser.has_section(f"services {services}"):
        s3 = {**s3, **_nested(parser.get(f"services {services}", "s3", fallback=""))}
    if "endpoint_url" in s3:
        result["endpoint_url"] = s3["endpoint_url"]
    return result


def _endpoint(options: cp.options.StorageOptions, profile: dict[str, str]) -> str | None:
    if options.endpoint:
        return options.endpoint
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() in _TRUE:
        return None
    return (
        os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or profile.get("endpoint_url")
        or None
    )


def _region(options: cp.options.StorageOptions, profile: dict[str, str]) -> str | None:
    return (
        options.region
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
        or profile.get("region")
        or None
    )


_private_lock = threading.Lock()
_private_files: dict[str, str] = {}


def _private_file(text: str) -> str:
    """A file holding ``text`` that only this user can read (one per distinct text).

    TensorStore reads keys from files only: explicit keys are written to one,
    in a fresh 0700 directory, removed when the process exits.
    """
    with _private_lock:
        path = _private_files.get(text)
        if path is None:
            directory = tempfile.mkdtemp(prefix="checkpointables-aws-")  # Mode 0700.
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            path = os.path.join(directory, "aws")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            _private_files[text] = path
        return path


def _profile_spec(profile: str, credentials_file: str | None = None) -> dict[str, Any]:
    """TensorStore's ``profile`` credentials, with both files named (it finds neither alone).

    A file that does not exist is replaced by an empty one.
    """
    files = {
        "credentials_file": credentials_file
        or _config_path("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
        "config_file": _config_path("AWS_CONFIG_FILE", "~/.aws/config"),
    }
    for key, path in files.items():
        if not os.path.exists(path):
            files[key] = _private_file("")
    return {"type": "profile", "profile": profile, **files}


def _credentials(options: cp.options.StorageOptions) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """TensorStore's ``aws_credentials`` for these options and this environment."""
    if options.anonymous:
        return {"type": "anonymous"}, ("anonymous",)
    if options.access_key_id is not None and options.secret_access_key is not None:
        lines = ["[checkpointables]", f"aws_access_key_id = {options.access_key_id}"]
        lines.append(f"aws_secret_access_key = {options.secret_access_key}")
        if options.session_token:
            lines.append(f"aws_session_token = {options.session_token}")
        path = _private_file("\n".join(lines) + "\n")
        return _profile_spec("checkpointables", path), ("static", path)
    if options.profile:
        return _profile_spec(options.profile), ("profile", options.profile)
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return {"type": "environment"}, ("environment",)
    if os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE"):
        name = _profile_name(options)
        return _profile_spec(name), ("profile", name)
    files = [
        _config_path("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
        _config_path("AWS_CONFIG_FILE", "~/.aws/config"),
    ]
    if any(os.path.exists(f) for f in files) or os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return {"type": "default"}, ("default",)  # Profiles, web identity, containers, instances.
    if os.environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or os.environ.get(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI"
    ):
        return {"type": "ecs"}, ("ecs",)
    # No configuration at all: only an EC2 instance's role can help. (The default chain
    # would also try the files that do not exist, and log an error for each.)
    return {"type": "imds"}, ("imds",)


def google_credentials_hint() -> str:
    """What to configure for ``gs://``, as the end of a sentence (``" (...)"``).

    TensorStore finds Google credentials as the Google Cloud libraries do
    (``GOOGLE_APPLICATION_CREDENTIALS``, then gcloud's application default
    credentials, then a Google Cloud VM's service account) and, finding
    none, sends its requests without credentials.
    """
    configured = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if configured:
        return f" (GOOGLE_APPLICATION_CREDENTIALS names {configured})"
    gcloud = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
    adc = os.path.join(gcloud, "application_default_credentials.json")
    if os.path.exists(adc):
        return f" ({adc}, from `gcloud auth application-default login`)"
    return (
        f": none were found (GOOGLE_APPLICATION_CREDENTIALS is not set and {adc} does not "
        f"exist), so unless this is a Google Cloud VM with a service account, requests go "
        f"without credentials. Set GOOGLE_APPLICATION_CREDENTIALS to a service account's key "
        f"file, or run `gcloud auth application-default login`"
    )


def s3_settings(options: cp.options.StorageOptions | None = None) -> S3Settings:
    """The S3 settings in force (``options`` default to the context's)."""
    if options is None:
        options = cp.context.get_context().storage_options
    profile = _profile_config(_profile_name(options))
    credentials, key = _credentials(options)
    return S3Settings(_endpoint(options, profile), _region(options, profile), credentials, key)


def bucket_and_key(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``s3://bucket/key`` (the key without a trailing ``/``)."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(
            f"{url} names no bucket; object-store paths look like {scheme}://bucket/a/b."
        )
    return scheme, bucket, key.strip("/")


def kvstore_spec(url: str, settings: S3Settings | None = None) -> dict[str, Any]:
    """The TensorStore kvstore spec of ``url`` (``s3://bucket/key`` or ``gs://bucket/key``).

    The spec's path ends with ``/``, so keys are relative to the location.
    """
    scheme, bucket, key = bucket_and_key(url)
    path = f"{key}/" if key else ""
    if scheme == "gs":
        return {"driver": "gcs", "bucket": bucket, "path": path}
    if scheme != "s3":
        raise ValueError(f"{url}: only s3:// and gs:// object stores are supported.")
    settings = s3_settings() if settings is None else settings
    spec: dict[str, Any] = {
        "driver": "s3",
        "bucket": bucket,
        "path": path,
        "aws_credentials": settings.credentials,
    }
    if settings.endpoint:
        spec["endpoint"] = settings.endpoint  # Path-style requests: endpoint/bucket/key.
    if settings.region:
        spec["aws_region"] = settings.region
    return spec


def context_resources(options: cp.options.StorageOptions | None = None) -> dict[str, Any]:
    """TensorStore context resources for the request concurrency and retries of the options."""
    if options is None:
        options = cp.context.get_context().storage_options
    resources: dict[str, Any] = {}
    for prefix in ("s3", "gcs"):
        if options.request_concurrency is not None:
            resources[f"{prefix}_request_concurrency"] = {"limit": options.request_concurrency}
        if options.request_retries is not None:
            resources[f"{prefix}_request_retries"] = {"max_retries": options.request_retries}
    return resources
