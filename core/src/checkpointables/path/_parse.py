"""User paths as ``Path``s, with a library error for what cannot be one.

TensorStore's file driver refuses paths with ``..`` components ("Invalid file
path"), which users write naturally (``../runs/7``). Such a local path is
resolved as the operating system would resolve it (``os.path.realpath``:
symbolic links first, then ``..``); any other path is left as given, so
messages show what the user wrote. A local path starting with ``~`` (or
``~user``) is expanded to that home directory, as the shell, pandas and
Hugging Face do (``pathlib`` and ``etils`` do not: a save would silently create
a directory named ``~``); ``./~`` names a directory really called ``~``. Bytes
are taken as ``open()`` takes them (``os.fsdecode``).

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
        cp.path.as_path("~/ckpt/100")          # the home directory's ckpt/100, as in a shell

    Raises:
      cp.errors.InvalidArgumentTypeError: ``path`` is not a str, bytes or path-like object.
      cp.errors.UnsupportedPathError: the path names a scheme (``memory://``,
        ``ftp://``, ``file://``...) that no storage here reaches.
      cp.errors.InvalidArgumentError: an ``s3://`` or ``gs://`` URL names no
        bucket, or an S3 bucket name that S3 and TensorStore refuse (``s3://a..b/x``),
        or a local path starts with ``~user`` for no known user (``expand_user``).
    """
    try:
        # Bytes, as os.fspath and open() take them: decoded as the file system encodes names.
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            f"The checkpoint path argument must be a str, bytes or a path-like object (such as "
            f"pathlib.Path), got a {type(path).__name__}."
        ) from None
    _check_encodable(text)
    if "://" not in text and text.startswith("~"):
        text = expand_user(text)
    if "://" not in text and ".." in text.split(os.sep):
        return epath.Path(os.path.realpath(text))
    check_bucket(text)
    if isinstance(path, epath.Path) and text == os.fspath(path):  # Not expanded: as given.
        return path
    try:
        return epath.Path(text)
    except KeyError:
        text = str(path)
        scheme = text.split("://", 1)[0] + "://" if "://" in text else text
        raise errors.UnsupportedPathError(
            f"Cannot use {text!r} as a checkpoint path: no storage for {scheme} is available. "
            "Use a local path (for file:// URLs, the path without the scheme), or a gs:// or "
            "s3:// URL."
        ) from None


def _check_encodable(text: str) -> None:
    """Refuses a path that is no UTF-8 text (bytes a file system would take, decoded into
    lone surrogates): a checkpoint's paths go into JSON specs and metadata as text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.InvalidArgumentError(
            f"The checkpoint path {text!r} is not UTF-8 text (it holds bytes no character "
            f"encodes); checkpoint paths are written into JSON: rename it, or save elsewhere."
        ) from None


def expand_user(text: str) -> str:
    """A local path starting with ``~`` or ``~user``, with that home directory put in, as
    the shell does (``os.path.expanduser``): nothing ever creates a directory named ``~``.

    Raises:
      cp.errors.InvalidArgumentError: ``~user`` names no user, and no such relative
        directory exists (a directory of that name is used as it is).
    """
    expanded = os.path.expanduser(text)
    if expanded != text:
        return expanded
    first = text.split(os.sep, 1)[0]
    if os.path.lexists(first):
        return text  # A directory really named so: written ./~x to be unambiguous.
    raise errors.InvalidArgumentError(
        f"Cannot use {text!r} as a checkpoint path: it starts with {first!r}, but "
        f"{'no home directory is known' if first == '~' else f'there is no user {first[1:]!r}'}"
        f" to put in its place (paths starting with ~ are expanded as the shell does). Write "
        f"the full path, or ./{text} for a directory really named {first!r}."
    )


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
