"""User paths as ``Path``s, with a library error for what cannot be one.

TensorStore's file driver refuses paths with ``..`` components ("Invalid file
path"), which users write naturally (``../runs/7``). Such a local path is
resolved as the operating system would resolve it (``os.path.realpath``:
symbolic links first, then ``..``); any other path is left as given, so
messages show what the user wrote.

Object-store URLs are checked here, before any request and before
``etils.epath`` reads them: it folds ``s3:///x`` (no bucket) into
``s3://x`` (a bucket named ``x``), and TensorStore refuses a bad S3 bucket
name with a bare ``ValueError`` only once a request is prepared.
"""

from __future__ import annotations

import os
import re

from etils import epath

from checkpointables import errors

# Schemes whose URLs name a bucket first: s3://BUCKET/KEY.
_BUCKET_SCHEMES = ("s3", "gs")
# The S3 bucket names TensorStore's ``s3`` driver accepts (it refuses others with a bare
# ValueError, endpoint or not; tests/integration/object_store/test_bucket_names.py compares):
# 3 to 255 characters, labels separated by single dots, each of letters, digits, '-' and '_'
# beginning and ending with a letter or digit. (AWS itself takes less: 3 to 63 lowercase
# letters, digits, '.' and '-'; S3-compatible servers may take more, so that is theirs to say.)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]*[A-Za-z0-9])?"
_S3_BUCKET = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_IP_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")
_S3_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3")  # Access points, Object Lambda.


def as_path(path: epath.PathLike) -> epath.Path:
    """``path`` as a ``cp.path.Path`` (an ``etils.epath.Path``).

    Example::

        cp.path.as_path("/tmp/ckpt/100")       # a local path
        cp.path.as_path("memory://x")          # raises cp.errors.UnsupportedPathError
        cp.path.as_path("s3:///ckpt")          # raises cp.errors.InvalidArgumentError

    Raises:
      cp.errors.InvalidArgumentTypeError: ``path`` is not a str or path-like object.
      cp.errors.UnsupportedPathError: the path names a scheme (``memory://``,
        ``ftp://``, ``file://``...) that no storage here reaches.
      cp.errors.InvalidArgumentError: an ``s3://`` or ``gs://`` URL names no
        bucket, or an S3 bucket name that S3 and TensorStore refuse (``s3://a..b/x``).
    """
    try:
        text = os.fspath(path)
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            f"A checkpoint path must be a str or a path-like object, got {type(path).__name__}."
        ) from None
    if "://" not in text and ".." in text.split(os.sep):
        return epath.Path(os.path.realpath(text))
    check_bucket(text)
    if isinstance(path, epath.Path):
        return path
    try:
        return epath.Path(path)
    except KeyError:
        text = str(path)
        scheme = text.split("://", 1)[0] + "://" if "://" in text else text
        raise errors.UnsupportedPathError(
            f"Cannot use {text!r} as a checkpoint path: no storage for {scheme} is available. "
            "Use a local path (for file:// URLs, the path without the scheme), or a gs:// or "
            "s3:// URL."
        ) from None


def check_bucket(text: str) -> None:
    """Raises ``InvalidArgumentError`` if the object-store URL ``text`` names no bucket, or
    an S3 bucket name that S3 (and TensorStore) refuse."""
    scheme, found, rest = text.partition("://")
    if not found or scheme not in _BUCKET_SCHEMES:
        return
    bucket = rest.partition("/")[0]
    if not bucket:
        raise errors.InvalidArgumentError(
            f"{text!r} names no bucket: {scheme}:// paths have the form "
            f"{scheme}://BUCKET/KEY (e.g. {scheme}://my-checkpoints/run-7/1000)."
        )
    if scheme == "s3" and not is_valid_s3_bucket(bucket):
        raise errors.InvalidArgumentError(
            f"{text!r}: {bucket!r} is not an S3 bucket name TensorStore's S3 client accepts "
            f"(3 to 255 characters in labels separated by single dots, each of letters, digits, "
            f"'-' and '_', beginning and ending with a letter or digit; not an IP address). "
            f"AWS's own rules are stricter (3 to 63 lowercase letters, digits, '.' and '-': "
            f"https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html). "
            f"Check the bucket's name; paths have the form s3://BUCKET/KEY."
        )


def is_valid_s3_bucket(bucket: str) -> bool:
    """Whether TensorStore's ``s3`` driver accepts ``bucket`` as a bucket name."""
    return (
        3 <= len(bucket) <= 255
        and _S3_BUCKET.fullmatch(bucket) is not None
        and not _IP_ADDRESS.fullmatch(bucket)
        and not bucket.startswith("xn--")
        and not bucket.endswith(_S3_RESERVED_SUFFIXES)
    )
