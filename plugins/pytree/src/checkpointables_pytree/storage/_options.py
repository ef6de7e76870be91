"""``StorageOptions``: how object stores (``s3://``, ``gs://``) are reached.

The pytree plugin's own settings (TensorStore's S3 and GCS clients), added to
``cp.Context`` / ``cp.configure`` as ``storage_options`` by ``plugin.py``'s
``register_options``; also ``cp.options.StorageOptions``.
"""

from __future__ import annotations

import attrs
import checkpointables as cp

__all__ = ["StorageOptions"]

_TEXT = cp.options.text_or_none()
_COUNT = cp.options.int_at_least(1, optional=True)


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

    endpoint: str | None = attrs.field(default=None, validator=_TEXT)
    region: str | None = attrs.field(default=None, validator=_TEXT)
    profile: str | None = attrs.field(default=None, validator=_TEXT)
    access_key_id: str | None = attrs.field(default=None, validator=_TEXT)
    secret_access_key: str | None = attrs.field(default=None, repr=False, validator=_TEXT)
    session_token: str | None = attrs.field(default=None, repr=False, validator=_TEXT)
    anonymous: bool = attrs.field(default=False, validator=cp.options.boolean())
    request_concurrency: int | None = attrs.field(default=None, validator=_COUNT)
    request_retries: int | None = attrs.field(default=None, validator=_COUNT)
    request_timeout_secs: float = attrs.field(default=60, validator=cp.options.positive_seconds())

    def __attrs_post_init__(self) -> None:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise cp.errors.InvalidArgumentError(
                "StorageOptions needs both access_key_id and secret_access_key, or neither."
            )
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise cp.options.invalid_option(
                "StorageOptions", "endpoint", self.endpoint, "an http:// or https:// URL"
            )
