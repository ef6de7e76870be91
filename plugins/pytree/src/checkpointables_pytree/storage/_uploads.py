"""A large object on S3, uploaded in parts of bounded size (a multipart upload).

TensorStore's kvstore writes a value given as one ``bytes``, and keeps its own
copy while it is PUT: a data file of 256 MiB held 512 MiB on the host, 770 MiB
at the first save. Data files are small (``io.REMOTE_DATA_FILE_BYTES``) but for
an incremental save (``reuse``), which puts each array in data files of its own,
and a value (a chunk) never spans two files: a large array's file is as large
as its largest chunk. Such a file is sent here in parts of ``UPLOAD_PART_BYTES``, each
copied from the arrays' memory as it is sent, ``PARTS_IN_FLIGHT`` at a time:
the host holds ``UPLOAD_HELD_BYTES`` at most, whatever the file's size.

The upload uses botocore's S3 client, the one the server-side copies of reused
files use (``copy_objects``), configured from the same settings; where they
cannot be made (``can_copy_on_server``: no botocore, not ``s3://``) an
incremental save links nothing, so its files are the small ones of any save.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import checkpointables as cp

from checkpointables_pytree.storage._object_store import bucket_and_key, s3_settings
from checkpointables_pytree.storage._server_copy import _client, can_copy_on_server

__all__ = [
    "UPLOAD_HELD_BYTES",
    "UPLOAD_IN_PARTS_BYTES",
    "UPLOAD_PART_BYTES",
    "uploaded_in_parts",
    "pieces",
    "upload_in_parts",
]

# S3 takes parts of 5 MiB to 5 GiB (but the last), 10,000 at most.
UPLOAD_PART_BYTES = 8 << 20
_MAX_PARTS = 10_000
# Parts sent at once (each a copy), besides the one being copied: a throughput of a few
# connections, as a save's data files are PUT one at a time.
PARTS_IN_FLIGHT = 2
UPLOAD_HELD_BYTES = (PARTS_IN_FLIGHT + 1) * UPLOAD_PART_BYTES
# Files up to this size are one PUT (held twice: ours and TensorStore's copy).
UPLOAD_IN_PARTS_BYTES = 2 * UPLOAD_PART_BYTES


def uploaded_in_parts(url: str, nbytes: int) -> bool:
    """Whether a file of ``nbytes`` at ``url`` is uploaded in parts (``upload_in_parts``)."""
    return nbytes > UPLOAD_IN_PARTS_BYTES and can_copy_on_server(url)


def pieces(parts: Sequence[Any], size: int) -> Iterator[bytes]:
    """The bytes of ``parts`` (bytes, or 1-D uint8 arrays) in consecutive pieces of ``size``
    (the last may be shorter), each copied only when it is taken."""
    views: list[memoryview] = []
    held = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            taken = view[: size - held]
            views.append(taken)
            held += taken.nbytes
            view = view[taken.nbytes :]
            if held == size:
                yield b"".join(views)
                views, held = [], 0
    if views:
        yield b"".join(views)


def upload_in_parts(url: str, parts: Sequence[Any], part_bytes: int = UPLOAD_PART_BYTES) -> None:
    """Writes the object ``url`` (``s3://``) with the bytes of ``parts``, in parts of
    ``part_bytes`` (more if 10,000 parts would not hold them); aborted if one fails (an
    interrupted process leaves an incomplete upload, which is never an object).

    Raises:
      cp.errors.StorageError: the server refused or kept failing a request.
    """
    nbytes = sum(memoryview(p).nbytes for p in parts)
    part_bytes = max(part_bytes, -(-nbytes // _MAX_PARTS))
    client, bucket, key = _client_for(url)
    try:
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    except Exception as e:
        raise _failed(url, e) from e
    target = {"Bucket": bucket, "Key": key, "UploadId": upload}
    try:
        etags = _send(client, target, pieces(parts, part_bytes))
        listed = [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, start=1)]
        client.complete_multipart_upload(**target, MultipartUpload={"Parts": listed})
    except BaseException as e:
        with contextlib.suppress(Exception):  # What failed is the error to report.
            client.abort_multipart_upload(**target)
        if isinstance(e, Exception):
            raise _failed(url, e) from e
        raise


def _client_for(url: str) -> tuple[Any, str, str]:
    """The botocore client of the server-side copies (one per settings), and ``url``'s
    bucket and key."""
    _, bucket, key = bucket_and_key(url)
    return _client(s3_settings()), bucket, key


def _send(client: Any, target: dict[str, Any], bodies: Iterator[bytes]) -> list[str]:
    """Sends each of ``bodies`` as the next part, ``PARTS_IN_FLIGHT`` at a time; returns
    their ETags."""
    etags: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(PARTS_IN_FLIGHT) as pool:
        sent: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
        for number, body in enumerate(bodies, start=1):
            if len(sent) == PARTS_IN_FLIGHT:  # With this copy made: UPLOAD_HELD_BYTES at most.
                etags.append(sent.popleft().result()["ETag"])
            sent.append(pool.submit(client.upload_part, **target, PartNumber=number, Body=body))
            del body
        etags += [future.result()["ETag"] for future in sent]
    return etags


def _failed(url: str, error: Exception) -> cp.errors.StorageError:
    return cp.errors.StorageError(
        f"Writing {url} failed: {error}. Check the credentials and the endpoint "
        f"(cp.options.StorageOptions, or the AWS_* environment variables); requests that "
        f"failed transiently were already retried. Nothing was committed; save again."
    )
