"""Turning TensorStore failures into the library's documented errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import checkpointables as cp

__all__ = ["is_data_loss", "integrity_error", "storage_error", "object_store_failures"]

_DATA_LOSS_MARKERS = ("DATA_LOSS", "checksum", "crc32c", "Checksum", "corrupt", "Error decoding")
_MISSING_MARKERS = ("NOT_FOUND", "not found", "Missing", "missing", "OUT_OF_RANGE")


def is_data_loss(error: BaseException) -> bool:
    """Whether a TensorStore error reports damaged bytes (failed checksum, bad encoding)."""
    text = str(error)
    return any(marker in text for marker in _DATA_LOSS_MARKERS)


def integrity_error(what: str, detail: object) -> cp.errors.IntegrityError:
    """An ``IntegrityError`` naming ``what`` (a leaf, a file) and what went wrong."""
    return cp.errors.IntegrityError(
        f"{what} failed its integrity check: {detail}. The checkpoint is damaged; restore it from "
        "a copy or load an older checkpoint (`checkpointables "
        "verify PATH` lists every damaged leaf)."
    )


def storage_error(what: str, error: BaseException) -> Exception:
    """The error to raise when TensorStore fails while reading ``what``."""
    if is_data_loss(error) or any(marker in str(error) for marker in _MISSING_MARKERS):
        return integrity_error(what, error)
    return cp.errors.CheckpointError(f"Reading {what} failed: {error}")


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
        raise cp.errors.StorageError(
            f"{action} {where} failed: {e}. The object store kept failing requests after "
            f"TensorStore's retries (cp.options.StorageOptions(request_retries=...) allows "
            f"more); nothing was committed."
        ) from e
