"""Turning TensorStore failures into the library's documented errors."""

from __future__ import annotations

import checkpointables as cp

__all__ = ["is_data_loss", "integrity_error", "storage_error"]

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
