"""Turning TensorStore failures into the library's documented errors."""

from __future__ import annotations

import contextlib
import errno
import re
from collections.abc import Iterator, Sequence
from typing import Any

import checkpointables as cp
from etils import epath

from checkpointables_pytree.storage._object_store import bucket_and_key, s3_settings

__all__ = [
    "is_data_loss",
    "integrity_error",
    "MissingChunkError",
    "missing_chunk_error",
    "storage_error",
    "write_error",
    "object_store_failures",
    "missing_bucket",
    "listing",
    "describe_type",
    "array_directory",
]

_DATA_LOSS_MARKERS = ("DATA_LOSS", "checksum", "crc32c", "Checksum", "corrupt", "Error decoding")
_MISSING_MARKERS = ("NOT_FOUND", "not found", "Missing", "missing", "OUT_OF_RANGE")


def is_data_loss(error: BaseException | str) -> bool:
    """Whether a TensorStore error (or its text) reports damaged bytes (failed checksum,
    bad encoding)."""
    text = str(error)
    return any(marker in text for marker in _DATA_LOSS_MARKERS)


def integrity_error(what: str, detail: object) -> cp.errors.IntegrityError:
    """An ``IntegrityError`` naming ``what`` (a leaf, a file) and what went wrong."""
    return cp.errors.IntegrityError(
        f"{what} failed its integrity check: {detail}. The checkpoint is damaged; restore it from "
        "a copy or load an older checkpoint (`checkpointables "
        "verify PATH` lists every damaged leaf)."
    )


class MissingChunkError(cp.errors.IntegrityError):
    """A chunk the database has no value for: damage, unless the tree holds one process's
    shards only (a process-local save), which a load tells apart by this type."""


def missing_chunk_error(what: str, key: str) -> MissingChunkError:
    """The ``MissingChunkError`` naming ``what`` (a leaf) and the chunk's ``key``."""
    return MissingChunkError(str(integrity_error(what, f"chunk {key} is missing")))


# The file a TensorStore error is about: a leaf's read may fail on the database's
# manifest or on a b-tree node, which the leaf merely needed.
_FILE = re.compile(r'local file "([^"]+)"')


def storage_error(what: str, error: BaseException) -> Exception:
    """The error to raise when TensorStore fails while reading ``what``: it names the file
    that failed first when TensorStore's error names one (a damaged manifest or b-tree node
    is not the leaf's damage).

    An array's ``zarr.json`` that TensorStore cannot parse, or whose data type, chunk
    shape or codecs claim chunks of another size than the stored ones, is a
    ``cp.errors.MetadataError``; a chunk that does not decode as it says (a zstd or gzip
    stream that is none, bytes that are no bools) an ``IntegrityError``: either may be
    the damaged one. A chunk the database has no value for is a ``MissingChunkError``
    (naming its key), as the fast path's reads raise: damage, unless the tree is
    process-local."""
    # TensorStore appends the spec it opened, whose member names ("fill_missing_data_reads")
    # must not read as its verdict.
    text = _SPEC.sub("", str(error))
    missing = _MISSING_CHUNK.search(text)
    if missing is not None:  # The zarr3 driver's (it is told not to read one as zeros).
        return missing_chunk_error(what, missing[1])
    if is_data_loss(text) or any(marker in text for marker in _MISSING_MARKERS):
        file = _FILE.search(text)
        return integrity_error(what if file is None else f"{file[1]} (read for {what})", error)
    edited = _edited_zarr_json(what, text)
    if edited is not None:
        return edited
    return cp.errors.CheckpointError(f"Reading {what} failed: {error}")


_SPEC = re.compile(r" \[tensorstore_spec='.*$", re.DOTALL)
# The zarr3 driver's words for a chunk the database has no value for, with the key of
# the chunk (or of the shard that would hold it).
_MISSING_CHUNK = re.compile(
    r'NOT_FOUND: chunk \{[^}]*\} stored at (?:shard entry [^"]*? in )?"([^"]+)" in OCDBT '
    r"database at [^\n]* is missing"
)
# TensorStore's words for an array's zarr metadata it cannot accept.
_UNPARSED = re.compile(
    r'Error opening "zarr3?" driver: Error reading "([^"]*(?:zarr\.json|\.zarray))"'
)
# ... for a chunk whose decoded bytes are fewer (``_SHORT``: needed, and missing) or more
# (``_LONG``: left over, after the bytes needed) than its zarr.json's data type and chunk
# shape need: its checksums passed (ours; Orbax's chunks carry none), so the zarr.json lies.
_SHORT = re.compile(r"Not enough data: expected at least (\d+) or (\d+) more")
_LONG = re.compile(r"End of data expected; remaining length: (\d+)")
_AT = re.compile(r"at (?:uncompressed )?byte (\d+)")
# ... for a chunk that does not decode with its zarr.json's codecs and data type.
_UNDECODED = ("ZSTD_decompress", "inflate()", "Invalid bool value", "blosc", "Blosc")
_DATABASE = re.compile(r'OCDBT database at (?:local file )?"([^"]+)": ')
_CHUNK = re.compile(r'in "([^"]+)" in OCDBT database at (?:local file )?"([^"]+)"')
_RESTORE = "the array's metadata was edited or is damaged; restore the checkpoint from a copy"


def _edited_zarr_json(what: str, text: str) -> Exception | None:
    """The error for TensorStore's ``text`` when it says that an array's zarr metadata is
    malformed or contradicts its stored chunks; ``None`` for any other failure."""
    unparsed = _UNPARSED.search(text)
    if unparsed is not None:
        where = _DATABASE.search(text)
        database = f" in the database at {where[1]}" if where else ""
        return cp.errors.MetadataError(
            f"{what}: the array's {unparsed[1]}{database} is malformed ({_detail(text)}): "
            f"{_RESTORE}."
        )
    short, long = _SHORT.search(text), _LONG.search(text)
    if short is None and long is None and not any(m in text for m in _UNDECODED):
        return None
    found = _CHUNK.search(text)
    chunk = f"chunk {found[1]!r} of the database at {found[2]}" if found else "a chunk"
    zarr_json = f"{found[1].split('/c/')[0]}/zarr.json" if found else "zarr.json"
    if short is None and long is None:
        return integrity_error(
            f"{what}: {chunk}",
            f"it does not decode as the array's {zarr_json} says (its codecs and data type: "
            f"{_detail(text)}); the chunk or the array's metadata is damaged",
        )
    if short is not None:
        needed, held = int(short[1]), int(short[1]) - int(short[2])
    else:
        positions = _AT.findall(text)
        needed = int(positions[-1]) if positions else 0
        held = needed + int(long[1])  # type: ignore[index]
    return cp.errors.MetadataError(
        f"{what}: {chunk} holds {held:,} bytes where the array's {zarr_json} (its data_type, "
        f"chunk_shape and codecs) needs {needed:,}: {_RESTORE}."
    )


def _detail(text: str) -> str:
    """TensorStore's own words for the failure: what it says after naming the database."""
    where = _DATABASE.search(text)
    return (text[where.end() :] if where else text.rsplit('": ', 1)[-1]).strip()


# TensorStore's errors are ValueErrors whose text starts with a status code, and name the
# operating system's error number when there was one.
_STATUS = re.compile(r"^[A-Z_]+: ")
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")


def write_error(error: BaseException, what: str) -> BaseException:
    """The error to raise when TensorStore fails while writing ``what`` (``error`` itself
    when it is not TensorStore's).

    An operating system's error that ``cp.errors.from_os_error`` maps (a full disk, a
    file too large, a name too long) becomes that error; anything else of TensorStore's
    a ``cp.errors.CheckpointError``.
    """
    if isinstance(error, cp.errors.CheckpointError) or not (
        isinstance(error, ValueError) and _STATUS.match(str(error))
    ):
        return error
    code = _OS_ERROR_CODE.search(str(error))
    number = int(code.group(1)) if code else None
    if number is None and "No space left on device" in str(error):
        number = errno.ENOSPC
    if number is not None:
        mapped = cp.errors.from_os_error(OSError(number, str(error)), f"writing {what}")
        if isinstance(mapped, cp.errors.CheckpointError):
            return type(mapped)(number, f"{mapped.strerror}. ({error})")
    return cp.errors.CheckpointError(f"Writing {what} failed: {error}")


@contextlib.contextmanager
def object_store_failures(where: object, action: str) -> Iterator[None]:
    """Raises what fails in the body as ``cp.errors.StorageError`` if ``where`` is remote.

    TensorStore retries failed requests; what still fails is reported as the
    library's error, naming the path. Local failures pass unchanged.
    """
    try:
        yield
    except cp.errors.CheckpointError:
        raise
    except Exception as e:
        if cp.storage.is_local(str(where)):
            raise
        missing = missing_bucket(action, str(where), e)
        if missing is not None:
            raise missing from e
        raise cp.errors.StorageError(
            f"{action} {where} failed: {e}. The object store kept failing requests after "
            f"TensorStore's retries (cp.options.StorageOptions(request_retries=...) allows "
            f"more); nothing was committed."
        ) from e


# How S3 (and S3-compatible servers) and GCS answer a request to a bucket that does not exist.
_MISSING_BUCKET = ("NoSuchBucket", "The specified bucket does not exist")


def missing_bucket(action: str, url: str, error: BaseException) -> cp.errors.StorageError | None:
    """The error to raise where ``error`` (TensorStore's) says ``url``'s bucket does not exist.

    It names the bucket and the endpoint asked, and says what to do, in place
    of the server's answer (an XML body); ``None`` for any other error.
    """
    text = str(error)
    if not any(marker in text for marker in _MISSING_BUCKET):
        return None
    scheme, bucket, _ = bucket_and_key(url)
    if scheme == "gs":
        return cp.errors.StorageError(
            f"{action} {url} failed: bucket {bucket!r} does not exist on Google Cloud Storage. "
            f"Create it (gcloud storage buckets create gs://{bucket}), or check the bucket name."
        )
    return cp.errors.StorageError(
        f"{action} {url} failed: bucket {bucket!r} does not exist at endpoint {_s3_endpoint()}. "
        f"Create the bucket, or check the bucket name and the endpoint "
        f"(cp.options.StorageOptions(endpoint=...), AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, "
        f"or the AWS profile's endpoint_url)."
    )


def _s3_endpoint() -> str:
    """The S3 endpoint the context's settings send requests to, as a message shows it."""
    try:
        settings = s3_settings()
    except Exception:  # An unreadable configuration: its own error says so elsewhere.
        return "(the configured one)"
    if settings.endpoint:
        return settings.endpoint
    host = f"s3.{settings.region}.amazonaws.com" if settings.region else "s3.amazonaws.com"
    return f"https://{host} (AWS: no endpoint is configured)"


_MAX_LISTED = 20


def listing(items: Sequence[str]) -> str:
    """``items`` joined for an error message: the first 20, and how many more there are."""
    shown = ", ".join(items[:_MAX_LISTED])
    if len(items) > _MAX_LISTED:
        shown += f", ... ({len(items) - _MAX_LISTED} more)"
    return shown


def describe_type(value: Any) -> str:
    """The type of ``value`` as errors name it (``int``, ``optax.ScaleByAdamState``)."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def array_directory(directory: epath.Path, name: str) -> epath.Path:
    """The directory of array ``name`` in a layout of one directory per array; a name that
    leads out of ``directory`` (absolute, or with ``..``) is refused before anything is read.

    Raises:
      cp.errors.OutsideCheckpointError: the name leads out.
    """
    if name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
        raise cp.errors.OutsideCheckpointError(
            f"{directory}/_METADATA records an array named {name!r}, which would be read from "
            f"outside the checkpoint; nothing was read. The checkpoint is damaged or hostile: "
            f"load only checkpoints from sources you trust."
        )
    return directory / name
