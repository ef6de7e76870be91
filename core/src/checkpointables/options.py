"""Option classes: frozen attrs classes, set through ``cp.Context`` or ``cp.configure``.

Example::

    import checkpointables as cp

    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=60)):
        cp.save_pytree(path, state)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

__all__ = [
    "AsyncOptions",
    "MultiprocessingOptions",
    "FileOptions",
    "ArrayStorageOptions",
    "ArrayOptions",
    "PyTreeOptions",
    "CheckpointablesOptions",
    "StorageOptions",
]


def _frozenset_or_none(value: Any) -> frozenset[int] | None:
    return None if value is None else frozenset(value)


@attrs.frozen
class AsyncOptions:
    """How background work is bounded.

    Attributes:
      timeout_secs: the longest any wait on background work or on other
        processes may last before it fails with a ``TimeoutError`` that says
        what was being waited for.
    """

    timeout_secs: float = attrs.field(default=1200, validator=attrs.validators.gt(0))


@attrs.frozen
class MultiprocessingOptions:
    """Which processes take part in a save and which one commits it.

    Attributes:
      primary_host: the process index that writes metadata and commits. ``None``
        means every process acts as its own primary (process-local storage).
      active_processes: the process indices taking part; ``None`` means all.
      barrier_sync_key_prefix: a prefix for the keys of cross-process barriers,
        so that several independent checkpointers may run in one job.
    """

    primary_host: int | None = 0
    active_processes: frozenset[int] | None = attrs.field(
        default=None, converter=_frozenset_or_none
    )
    barrier_sync_key_prefix: str | None = None


@attrs.frozen
class FileOptions:
    """How files and directories are created.

    Attributes:
      path_permission_mode: permission bits for directories the library
        creates (e.g. ``0o750``); ``None`` keeps the process umask.
    """

    path_permission_mode: int | None = None


@attrs.frozen
class ArrayStorageOptions:
    """How one array is laid out on disk.

    Attributes:
      dtype: store the array in this dtype (cast on save); ``None`` keeps it.
      chunk_byte_size: split each written shard into chunks of at most this many
        bytes, so that partial reads touch less data; ``None`` writes one chunk
        per shard.
      shard_axes: axes to split first when choosing chunks.
    """

    dtype: Any = None
    chunk_byte_size: int | None = None
    shard_axes: tuple[int, ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen
class ArrayOptions:
    """Options for arrays in pytrees.

    Attributes:
      storage_options: the layout used for every array, unless
        ``storage_options_creator`` returns something else for a key path.
      storage_options_creator: called as ``creator(key_path, value)`` for each
        array leaf; returns ``ArrayStorageOptions`` or ``None`` to keep the
        global ones.
      use_compression: compress chunks with zstd (smaller, slower).
      enable_padding_and_truncation: on load, a requested shape that differs
        from the stored one pads with zeros or truncates instead of raising.
      verify_checksums: check every chunk on load, against the checksum
        recorded at save time or the chunk's own CRC-32C. Turning it off
        saves CPU time on trusted storage; damage then goes unnoticed.
    """

    storage_options: ArrayStorageOptions = ArrayStorageOptions()
    storage_options_creator: Callable[[tuple[Any, ...], Any], ArrayStorageOptions | None] | None = (
        None
    )
    use_compression: bool = False
    enable_padding_and_truncation: bool = False
    verify_checksums: bool = True


@attrs.frozen
class PyTreeOptions:
    """Options for pytree checkpointables.

    Attributes:
      leaf_handler_registry: the leaf handlers to use; ``None`` means a
        ``cp.serialization.StandardLeafHandlerRegistry()`` holding every leaf
        handler that plugins registered.
      partial_load: allow an abstract tree that omits keys of the stored tree.
    """

    leaf_handler_registry: Any = None
    partial_load: bool = False


def _handler_map(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return dict(value or {})


@attrs.frozen
class CheckpointablesOptions:
    """Which handler to use for which checkpointable name.

    Attributes:
      handlers: maps a checkpointable name to a handler class, or to the name
        or typestr of a registered handler. Those names skip resolution.
    """

    handlers: Mapping[str, Any] = attrs.field(factory=dict, converter=_handler_map)

    @classmethod
    def create_with_handlers(cls, **handlers: Any) -> CheckpointablesOptions:
        """Forces a handler per checkpointable name.

        Example::

            cp.options.CheckpointablesOptions.create_with_handlers(extra=cp.handlers.get("json"))
        """
        return cls(handlers=handlers)


def _positive_or_none(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"StorageOptions.{attribute.name} must be an int >= 1, got {value!r}.")


@attrs.frozen
class StorageOptions:
    """How object stores (``s3://``, ``gs://``) are reached; local paths ignore them.

    Every field left at ``None`` comes from the standard configuration, as
    boto3 and the AWS CLI read it: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
    ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` with
    ``~/.aws/config`` and ``~/.aws/credentials``, then the instance's role.
    See ``docs/object-stores.md``.

    Example (an S3-compatible server, e.g. MinIO)::

        cp.configure(storage_options=cp.options.StorageOptions(
            endpoint="http://minio.internal:9000", region="us-east-1"))

    Attributes:
      endpoint: the URL of an S3-compatible server (``http://host:port``);
        requests then use path-style addressing (``endpoint/bucket/key``).
      region: the AWS region of the bucket.
      profile: a profile of ``~/.aws/config`` and ``~/.aws/credentials``.
      access_key_id, secret_access_key, session_token: explicit credentials
        (both of the first two, or neither).
      anonymous: send unsigned requests (public buckets).
      request_concurrency: at most this many HTTP requests at once (S3 and
        GCS; TensorStore's default is 32).
      request_retries: how often a failed request is retried (TensorStore's
        default is 32, with exponential backoff).
      request_timeout_secs: the longest one operation on the library's own
        objects (a metadata file, a commit marker, a listing, a deletion) may
        take, its retries included, before it fails with
        ``cp.errors.StorageError`` saying what to check: without a network,
        or a server that does not answer, TensorStore would go on retrying
        for many minutes. Array data is bounded by ``request_retries`` alone.
    """

    endpoint: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = attrs.field(default=None, repr=False)
    session_token: str | None = attrs.field(default=None, repr=False)
    anonymous: bool = False
    request_concurrency: int | None = attrs.field(default=None, validator=_positive_or_none)
    request_retries: int | None = attrs.field(default=None, validator=_positive_or_none)
    request_timeout_secs: float = attrs.field(default=60, validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError(
                "StorageOptions needs both access_key_id and secret_access_key, or neither."
            )
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"StorageOptions.endpoint must be an http:// or https:// URL, got "
                f"{self.endpoint!r}."
            )
