"""Object stores (``s3://``, ``gs://``) through TensorStore's key-value stores.

Their configuration, for two users: ``kvstore_spec(url)`` is the TensorStore
spec of a location, used for the arrays (the OCDBT database) of a pytree
saved there, and ``_kvstore_storage.KvStoreStorage`` (the ``cp.storage.Storage``
of these schemes, for every other file) opens its stores with it.

S3 is configured as the AWS CLI is, ``StorageOptions`` fields first. The AWS
configuration files are read by botocore's loader (the ``s3`` extra installs
it), never by hand: the profile in force (``AWS_DEFAULT_PROFILE`` /
``AWS_PROFILE``), the files (``AWS_CONFIG_FILE``,
``AWS_SHARED_CREDENTIALS_FILE``, ``~/.aws``), the profile's ``region``, its
``services`` section's ``s3`` ``endpoint_url`` or its own ``endpoint_url``,
and ``ignore_configured_endpoint_urls``. The credentials are TensorStore's
own providers (``environment``, ``profile`` with both files named, since it
finds neither alone, then the instance's or container's role), chosen in the
AWS CLI's order. TensorStore's ``s3://`` URL form reads none of the endpoint
settings, so every setting is translated into the spec here.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import warnings
from typing import Any

import attrs
import checkpointables as cp

from checkpointables_pytree.storage._options import StorageOptions

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
# A profile holding any of these gives credentials (TensorStore's profile provider reads them).
_CREDENTIAL_KEYS = ("aws_access_key_id", "role_arn", "credential_process")


# -- Configuration ------------------------------------------------------------------------------


@attrs.frozen
class S3Settings:
    """Where and how S3 requests go, resolved from options, environment and config files."""

    endpoint: str | None
    region: str | None
    credentials: dict[str, Any] = attrs.field(eq=False)
    # The credentials' identity (never the secrets themselves), for caching.
    credentials_key: tuple[Any, ...] = ()


@attrs.frozen
class AwsConfig:
    """What the AWS configuration says about one profile, as the AWS CLI reads it."""

    profile: str | None  # Named by the options or the environment; None: ``default``.
    config_file: str
    credentials_file: str
    region: str | None  # ``AWS_DEFAULT_REGION``, else the profile's.
    endpoint_url: str | None  # The profile's services section's ``s3``, else its own.
    ignore_configured_endpoints: bool
    has_credentials: bool  # The profile in force holds keys, a role or a process.


_FILE_VARIABLES = ("config_file", "credentials_file")


def _aws_config_from_botocore(profile: str | None) -> AwsConfig:
    """The configuration as botocore (the AWS CLI's loader) reads it."""
    import botocore.exceptions
    import botocore.session

    session = botocore.session.Session(profile=profile)
    files = [os.path.expanduser(session.get_config_variable(n)) for n in _FILE_VARIABLES]
    try:
        scoped = session.get_scoped_config()
        services = session.full_config.get("services", {})
        if "services" in scoped and scoped["services"] not in services:
            raise botocore.exceptions.InvalidConfigError(
                error_msg=f"its services section {scoped['services']!r} does not exist"
            )
    except botocore.exceptions.BotoCoreError as e:  # A missing profile, an unparsable file.
        raise cp.errors.StorageError(
            f"The AWS configuration ({files[0]}, {files[1]}) cannot be used: {e}. Fix the "
            f"files, or choose another profile (AWS_PROFILE, StorageOptions(profile=...))."
        ) from None
    s3 = services[scoped["services"]].get("s3", {}) if "services" in scoped else {}
    return AwsConfig(
        profile=session.get_config_variable("profile"),
        config_file=files[0],
        credentials_file=files[1],
        region=session.get_config_variable("region"),
        endpoint_url=s3.get("endpoint_url") or scoped.get("endpoint_url"),
        ignore_configured_endpoints=bool(
            session.get_config_variable("ignore_configured_endpoint_urls")
        ),
        has_credentials=any(scoped.get(k) for k in _CREDENTIAL_KEYS),
    )


_warned_without_botocore = False


def _aws_config_without_botocore(profile: str | None) -> AwsConfig:
    """Only the environment, without botocore: the files' settings cannot be read."""
    global _warned_without_botocore
    env = os.environ
    files = [
        os.path.expanduser(env.get("AWS_CONFIG_FILE") or "~/.aws/config"),
        os.path.expanduser(env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"),
    ]
    if os.path.exists(files[0]) and not _warned_without_botocore:
        _warned_without_botocore = True
        warnings.warn(
            f"{files[0]} exists but botocore is not installed, so its regions and endpoints "
            f"are not read (profiles' credentials still are). pip install "
            f"'checkpointables[s3]' to read it as the AWS CLI does.",
            RuntimeWarning,
            stacklevel=4,
        )
    return AwsConfig(
        profile=profile or env.get("AWS_DEFAULT_PROFILE") or env.get("AWS_PROFILE") or None,
        config_file=files[0],
        credentials_file=files[1],
        region=env.get("AWS_DEFAULT_REGION") or None,
        endpoint_url=None,
        ignore_configured_endpoints=False,
        has_credentials=os.path.exists(files[1]),  # Presumably a [default] profile.
    )


_configs: dict[tuple[Any, ...], AwsConfig] = {}
_configs_lock = threading.Lock()


def _stat(path: str) -> tuple[int, int] | None:
    with contextlib.suppress(OSError):
        status = os.stat(os.path.expanduser(path))
        return (status.st_mtime_ns, status.st_size)
    return None


def aws_config(profile: str | None = None) -> AwsConfig:
    """The AWS configuration of ``profile`` (default: the environment's), read again only
    when an ``AWS_*`` variable, ``HOME`` or one of the files changed."""
    env = os.environ
    key = (
        profile,
        tuple(sorted((k, v) for k, v in env.items() if k.startswith("AWS_") or k == "HOME")),
        _stat(env.get("AWS_CONFIG_FILE") or "~/.aws/config"),
        _stat(env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"),
    )
    with _configs_lock:
        found = _configs.get(key)
    if found is None:
        try:
            import botocore  # noqa: F401  (only whether it is installed)
        except ImportError:
            found = _aws_config_without_botocore(profile)
        else:
            found = _aws_config_from_botocore(profile)
        with _configs_lock:
            if len(_configs) >= 16:  # Bounded: environments come and go in tests.
                _configs.clear()
            _configs[key] = found
    return found


def _endpoint(options: StorageOptions, config: AwsConfig) -> str | None:
    if options.endpoint:
        return options.endpoint
    if config.ignore_configured_endpoints:
        return None
    env = os.environ
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or config.endpoint_url


def _region(options: StorageOptions, config: AwsConfig) -> str | None:
    # AWS_REGION first, as the AWS CLI v2 and the other SDKs read it (botocore reads only
    # AWS_DEFAULT_REGION, then the profile's).
    return options.region or os.environ.get("AWS_REGION") or config.region or None


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


def _profile_spec(
    profile: str, config: AwsConfig, credentials_file: str | None = None
) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """TensorStore's ``profile`` credentials, with both files named (it finds neither alone).

    A file that does not exist is replaced by an empty one.
    """
    files = {
        "credentials_file": credentials_file or config.credentials_file,
        "config_file": config.config_file,
    }
    for key, path in files.items():
        if not os.path.exists(path):
            files[key] = _private_file("")
    return {"type": "profile", "profile": profile, **files}, ("profile", profile, *files.values())


def _explicit_keys(
    options: StorageOptions, config: AwsConfig
) -> tuple[dict[str, Any], tuple[Any, ...]]:
    lines = ["[checkpointables]", f"aws_access_key_id = {options.access_key_id}"]
    lines.append(f"aws_secret_access_key = {options.secret_access_key}")
    if options.session_token:
        lines.append(f"aws_session_token = {options.session_token}")
    path = _private_file("\n".join(lines) + "\n")
    return _profile_spec("checkpointables", config, path)


def _credentials(
    options: StorageOptions, config: AwsConfig
) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """TensorStore's ``aws_credentials``, in the AWS CLI's order: the options, the
    environment's keys, a named profile, the default profile, then web identity, a
    container's or the instance's role."""
    env = os.environ
    if options.anonymous:
        return {"type": "anonymous"}, ("anonymous",)
    if options.access_key_id is not None and options.secret_access_key is not None:
        return _explicit_keys(options, config)
    if options.profile:
        return _profile_spec(options.profile, config)
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return {"type": "environment"}, ("environment",)
    if config.profile or config.has_credentials:
        return _profile_spec(config.profile or "default", config)
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return {"type": "default"}, ("default",)  # Web identity (EKS), then containers, instances.
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI"
    ):
        return {"type": "ecs"}, ("ecs",)
    # Nothing configured: only an EC2 instance's role can help. (The default chain would
    # also try the profile files, and log an error for each.)
    return {"type": "imds"}, ("imds",)


def s3_settings(options: StorageOptions | None = None) -> S3Settings:
    """The S3 settings in force (``options`` default to the context's)."""
    if options is None:
        options = cp.context.get_context().options(StorageOptions)
    config = aws_config(options.profile)
    credentials, key = _credentials(options, config)
    return S3Settings(_endpoint(options, config), _region(options, config), credentials, key)


def bucket_and_key(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``s3://bucket/key`` (the key without a trailing ``/``).

    Raises:
      cp.errors.InvalidArgumentError: no bucket, or a ``.`` or ``..`` in the key.
    """
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise cp.errors.InvalidArgumentError(
            f"{url} names no bucket; object-store paths look like s3://bucket/a/b."
        )
    key = key.strip("/")
    if any(part in (".", "..") for part in key.split("/")):
        # HTTP clients resolve them in a GET or PUT, never in a LIST's prefix: a save would
        # write one place and find nothing there (no overwrite check, no checksums).
        raise cp.errors.InvalidArgumentError(
            f"{url} holds '.' or '..': object-store keys are names, not resolved as paths "
            f"are. Write the path without them (e.g. s3://bucket/run/1)."
        )
    return scheme, bucket, key


def kvstore_spec(url: str, settings: S3Settings | None = None) -> dict[str, Any]:
    """The TensorStore kvstore spec of ``url`` (``s3://bucket/key`` or ``gs://bucket/key``).

    The spec's path ends with ``/``, so keys are relative to the location.

    Raises:
      cp.errors.InvalidArgumentError: as ``bucket_and_key``, or an S3 bucket name
        TensorStore refuses (it would raise a bare ``ValueError`` at the first request).
    """
    cp.path.as_path(url)  # Checks the bucket's name, for callers that skipped cp.storage.
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


def context_resources(options: StorageOptions | None = None) -> dict[str, Any]:
    """TensorStore context resources for the request concurrency and retries of the options."""
    if options is None:
        options = cp.context.get_context().options(StorageOptions)
    resources: dict[str, Any] = {}
    for prefix in ("s3", "gcs"):
        if options.request_concurrency is not None:
            resources[f"{prefix}_request_concurrency"] = {"limit": options.request_concurrency}
        if options.request_retries is not None:
            resources[f"{prefix}_request_retries"] = {"max_retries": options.request_retries}
    return resources


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
