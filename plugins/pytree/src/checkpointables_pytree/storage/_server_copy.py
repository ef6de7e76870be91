"""Server-side copies on S3 (and S3-compatible servers): objects copied without their bytes
passing through this host.

TensorStore's S3 client has no copy call, so incremental saves (``reuse``) copy
the unchanged data files of an earlier checkpoint with botocore's S3 client
(the ``s3`` extra already installs botocore for its configuration loader):
``CopyObject`` for objects up to 5 GiB, a multipart upload of ``UploadPartCopy``
parts above. The client is configured from the same ``S3Settings`` as
TensorStore's spec (``kvstore_spec``): endpoint, region, credentials, profile.

Every copy is conditional on the source's ETag as listed when the save chose
it (``CopySourceIfMatch``): if the source object was replaced meanwhile, the
server refuses the copy and the save fails instead of copying other bytes.
Objects listed before the save began (``ObjectInfo.early``: by the source's
own save, after its commit) are listed again before they are copied, and the
save fails if one changed: the check does not rest on a server that honours
the condition for that longer time (moto's ignores it).
GCS has no copy here (``can_copy_on_server`` is ``False`` for ``gs://``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import checkpointables as cp

from checkpointables_pytree.storage._object_store import S3Settings, bucket_and_key, s3_settings
from checkpointables_pytree.storage._options import StorageOptions

__all__ = ["ObjectInfo", "ServerCopy", "can_copy_on_server", "list_objects", "copy_objects"]

# S3's largest CopyObject; larger objects are copied in parts (UploadPartCopy).
MAX_SINGLE_COPY_BYTES = 5 << 30
# Parts of a multipart copy: S3 allows 10,000 parts of 5 MiB to 5 GiB.
PART_BYTES = 1 << 30
_MAX_PARTS = 10_000
# Copies (and parts) in flight at once: a server-side copy costs this host a connection.
_CONCURRENCY = 16
# A server-side copy of gigabytes answers once done: reads may wait that long.
_READ_TIMEOUT_SECS = 600


@attrs.frozen
class ObjectInfo:
    """An object as a listing shows it: its size and ETag (the server's checksum of it)."""

    size: int
    etag: str
    # Listed before this save began (after the source's commit: ``reuse._prefetched``):
    # ``copy_objects`` lists it again before copying it.
    early: bool = attrs.field(default=False, eq=False)


@attrs.frozen
class ServerCopy:
    """One object to copy: ``source`` (as listed: ``info``) to ``target`` (both ``s3://``)."""

    source: str
    target: str
    info: ObjectInfo


def can_copy_on_server(*urls: str) -> bool:
    """Whether objects can be copied server-side between ``urls`` (all ``s3://``, botocore
    installed)."""
    if not all(u.startswith("s3://") for u in urls):
        return False
    try:
        import botocore.session  # noqa: F401  (only whether it is installed)
    except ImportError:
        return False
    return True


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def _client(settings: S3Settings) -> Any:
    """A botocore S3 client for ``settings`` (one per endpoint, region and credentials) and
    the context's ``StorageOptions.request_retries`` (botocore's standard retries: a
    request is tried ``request_retries + 1`` times; its own default where unset)."""
    retries = cp.context.get_context().options(StorageOptions).request_retries
    key = (settings.endpoint, settings.region, settings.credentials_key, retries)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = _new_client(settings, retries)
        return client


def _new_client(settings: S3Settings, retries: int | None = None) -> Any:
    """The client TensorStore's spec describes: the same endpoint (path-style, as
    TensorStore addresses an endpoint), region and credentials provider."""
    import botocore
    import botocore.config
    import botocore.session

    credentials = settings.credentials
    kind = credentials.get("type")
    options: dict[str, Any] = {
        "max_pool_connections": _CONCURRENCY,
        "read_timeout": _READ_TIMEOUT_SECS,
        "retries": {"mode": "standard"}
        if retries is None
        else {"mode": "standard", "total_max_attempts": retries + 1},
    }
    if kind == "anonymous":
        options["signature_version"] = botocore.UNSIGNED
    if settings.endpoint:
        options["s3"] = {"addressing_style": "path"}
    session = botocore.session.Session(profile=credentials.get("profile"))
    if kind == "profile":  # The files TensorStore's profile provider was given.
        session.set_config_variable("credentials_file", credentials["credentials_file"])
        session.set_config_variable("config_file", credentials["config_file"])
    # "environment", "default", "ecs", "imds": botocore's own chain finds the same ones.
    return session.create_client(
        "s3",
        endpoint_url=settings.endpoint,
        region_name=settings.region or "us-east-1",
        config=botocore.config.Config(**options),
    )


def _failed(action: str, url: str, error: Exception) -> cp.errors.StorageError:
    """``error`` (botocore's) as the library's error, naming ``url`` and what to do."""
    answer = getattr(error, "response", {}).get("Error", {})
    code = answer.get("Code", "")
    if code in ("NoSuchKey", "404", "PreconditionFailed", "412"):
        return cp.errors.StorageError(
            f"{action} {url} failed ({code}): the earlier checkpoint this save reuses was "
            f"deleted or replaced while the save ran. Nothing was committed; save again "
            f"(a Checkpointer keeps the step it reuses until its save ends)."
        )
    if code in ("NotImplemented", "501"):
        return cp.errors.StorageError(
            f"{action} {url} failed: this S3-compatible server does not implement server-side "
            f"copies (CopyObject, UploadPartCopy). Turn incremental saves off there: "
            f"Checkpointer(reuse_unchanged=False), or no reuse_from. Nothing was committed."
        )
    return cp.errors.StorageError(
        f"{action} {url} failed: {error}. Check the credentials and the endpoint "
        f"(cp.options.StorageOptions, or the AWS_* environment variables); requests that "
        f"failed transiently were already retried. Nothing was committed."
    )


def list_objects(prefix_url: str, settings: S3Settings | None = None) -> dict[str, ObjectInfo]:
    """Every object under ``prefix_url/`` (by its ``s3://`` URL), with its size and ETag."""
    settings = s3_settings() if settings is None else settings
    _, bucket, key = bucket_and_key(prefix_url)
    prefix = f"{key}/" if key else ""
    found = {}
    try:
        pages = _client(settings).get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                info = ObjectInfo(int(item["Size"]), str(item["ETag"]))
                found[f"s3://{bucket}/{item['Key']}"] = info
    except Exception as e:
        raise _failed("Listing", prefix_url, e) from e
    return found


def copy_objects(
    copies: Sequence[ServerCopy],
    settings: S3Settings | None = None,
    *,
    single_copy_bytes: int = MAX_SINGLE_COPY_BYTES,
    part_bytes: int = PART_BYTES,
) -> None:
    """Copies every object of ``copies`` on the server, several at once; returns once all
    are in place. An object over ``single_copy_bytes`` is copied in parts of
    ``part_bytes`` (S3 takes parts of 5 MiB to 5 GiB).

    Raises:
      cp.errors.StorageError: a copy failed (its source gone or replaced, no permission).
    """
    if not copies:
        return
    settings = s3_settings() if settings is None else settings
    _check_unchanged([c for c in copies if c.info.early], settings)
    client = _client(settings)
    with concurrent.futures.ThreadPoolExecutor(_CONCURRENCY) as pool:
        done = []
        for c in copies:
            large = c.info.size > single_copy_bytes
            done.append(pool.submit(_copy, client, c, part_bytes if large else None))
        for future in done:
            future.result()


def _check_unchanged(copies: Sequence[ServerCopy], settings: S3Settings) -> None:
    """Raises unless the source of each of ``copies`` is listed as its ``info`` says (one
    LIST per directory): an object replaced or deleted since it was listed is not copied."""
    listed: dict[str, ObjectInfo] = {}
    for directory in sorted({c.source.rpartition("/")[0] for c in copies}):
        listed.update(list_objects(directory, settings))
    for c in copies:
        now = listed.get(c.source)
        if now is None or now != c.info:
            raise cp.errors.StorageError(
                f"Copying to {c.target} from {c.source} failed: the object was deleted or "
                f"replaced since the save of the checkpoint this save reuses listed it "
                f"(after its commit). Nothing was committed; save again: the next save "
                f"lists it afresh and writes what changed."
            )


def _source(copy: ServerCopy) -> dict[str, str]:
    _, bucket, key = bucket_and_key(copy.source)
    return {"Bucket": bucket, "Key": key}


def _copy(client: Any, copy: ServerCopy, part_bytes: int | None) -> None:
    """Copies one object: whole, or in parts of ``part_bytes``."""
    _, bucket, key = bucket_and_key(copy.target)
    try:
        if part_bytes is None:
            client.copy_object(
                Bucket=bucket,
                Key=key,
                CopySource=_source(copy),
                CopySourceIfMatch=copy.info.etag,
            )
        else:
            _copy_in_parts(client, copy, bucket, key, part_bytes)
    except Exception as e:
        raise _failed("Copying to", f"{copy.target} from {copy.source}", e) from e


def part_ranges(size: int, part_bytes: int = PART_BYTES) -> list[tuple[int, int]]:
    """The byte ranges (first, last) of the parts of a multipart copy of ``size`` bytes:
    ``part_bytes`` each, more if 10,000 parts would not hold it."""
    part_bytes = max(part_bytes, -(-size // _MAX_PARTS))
    return [(s, min(s + part_bytes, size) - 1) for s in range(0, size, part_bytes)]


def _copy_in_parts(client: Any, copy: ServerCopy, bucket: str, key: str, part_bytes: int) -> None:
    """A multipart upload of ``UploadPartCopy`` parts, several at once; aborted if a part
    fails (an interrupted process leaves an incomplete upload, which is never an object)."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    ranges = part_ranges(copy.info.size, part_bytes)
    try:
        with concurrent.futures.ThreadPoolExecutor(min(_CONCURRENCY, len(ranges))) as pool:
            parts = [
                pool.submit(
                    client.upload_part_copy,
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload,
                    PartNumber=number,
                    CopySource=_source(copy),
                    CopySourceRange=f"bytes={first}-{last}",
                    CopySourceIfMatch=copy.info.etag,
                )
                for number, (first, last) in enumerate(ranges, start=1)
            ]
            etags = [p.result()["CopyPartResult"]["ETag"] for p in parts]
        listed = [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, start=1)]
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": listed}
        )
    except BaseException:
        with contextlib.suppress(Exception):  # The error that stopped it says more.
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        raise
