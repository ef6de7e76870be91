"""``CheckpointMetadata`` and the ``_CHECKPOINT_METADATA`` file."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from etils import epath

from checkpointables import errors, storage

__all__ = ["CheckpointMetadata", "CHECKPOINT_METADATA_FILE", "read_checkpoint_metadata"]

CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"
T = TypeVar("T")

# Field order as Orbax writes it, so that files compare equal across tools.
_KNOWN_FIELDS = (
    "item_handlers",
    "metrics",
    "performance_metrics",
    "init_timestamp_nsecs",
    "commit_timestamp_nsecs",
    "custom_metadata",
)


class CheckpointMetadata(Generic[T]):
    """What a checkpoint says about itself, without loading it.

    Attributes:
      path: the checkpoint directory.
      metadata: for ``cp.pytree_metadata``, the abstract tree (usable directly
        as the ``abstract_pytree`` of ``cp.load_pytree``); for
        ``cp.checkpointables_metadata``, a dict of name to abstract checkpointable.
      custom_metadata: the dict given to ``custom_metadata=`` at save time.
      init_timestamp_nsecs: when the save started (ns since the epoch).
      commit_timestamp_nsecs: when the save committed.
      metrics: metrics stored with the checkpoint (e.g. by the training Checkpointer).
    """

    def __init__(
        self,
        path: epath.PathLike,
        *,
        metadata: T,
        custom_metadata: Mapping[str, Any] | None = None,
        init_timestamp_nsecs: int | None = None,
        commit_timestamp_nsecs: int | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = epath.Path(path)
        self.metadata = metadata
        self.custom_metadata = dict(custom_metadata or {})
        self.init_timestamp_nsecs = init_timestamp_nsecs
        self.commit_timestamp_nsecs = commit_timestamp_nsecs
        self.metrics = dict(metrics or {})

    @property
    def commit_timestamp(self) -> datetime.datetime | None:
        """The commit time as an aware UTC datetime."""
        if self.commit_timestamp_nsecs is None:
            return None
        return datetime.datetime.fromtimestamp(self.commit_timestamp_nsecs / 1e9, tz=datetime.UTC)

    def __repr__(self) -> str:
        return (
            f"CheckpointMetadata(path={str(self.path)!r}, metadata={self.metadata!r}, "
            f"custom_metadata={self.custom_metadata!r}, "
            f"init_timestamp_nsecs={self.init_timestamp_nsecs}, "
            f"commit_timestamp_nsecs={self.commit_timestamp_nsecs})"
        )


def checkpoint_metadata_json(
    *,
    item_handlers: Mapping[str, str] | str,
    custom_metadata: Mapping[str, Any] | None,
    init_timestamp_nsecs: int,
    commit_timestamp_nsecs: int,
    metrics: Mapping[str, Any] | None = None,
) -> str:
    """The text of a ``_CHECKPOINT_METADATA`` file, in Orbax's field order."""
    return json.dumps(
        {
            "item_handlers": dict(item_handlers)
            if isinstance(item_handlers, Mapping)
            else item_handlers,
            "metrics": dict(metrics or {}),
            "performance_metrics": {},
            "init_timestamp_nsecs": init_timestamp_nsecs,
            "commit_timestamp_nsecs": commit_timestamp_nsecs,
            "custom_metadata": dict(custom_metadata or {}),
        }
    )


def read_checkpoint_metadata(directory: epath.PathLike) -> dict[str, Any]:
    """Reads ``_CHECKPOINT_METADATA``; unknown top-level keys go to ``custom_metadata``.

    Raises:
      FileNotFoundError: the file does not exist.
      errors.MetadataError: the file is unreadable or not a JSON object.
    """
    path = epath.Path(directory) / CHECKPOINT_METADATA_FILE
    try:
        if "://" in os.fspath(path):
            text = storage.read_text(path)
        else:  # Cheaper than epath's read for a local file.
            with open(os.fspath(path), encoding="utf-8") as f:
                text = f.read()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise errors.MetadataError(f"Cannot read {path}: {e}.") from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise errors.MetadataError(
            f"{path} is not valid JSON ({e}); the checkpoint's metadata is damaged. "
            f"Restore it from a copy, or load the checkpointable subdirectories directly."
        ) from e
    if not isinstance(raw, dict):
        raise errors.MetadataError(
            f"{path} holds a JSON {type(raw).__name__}, expected an object with "
            f"'item_handlers' and timestamps."
        )
    result: dict[str, Any] = {k: raw.get(k) for k in _KNOWN_FIELDS}
    custom = raw.get("custom_metadata")
    result["custom_metadata"] = dict(custom) if isinstance(custom, dict) else {}
    for key, value in raw.items():
        if key not in _KNOWN_FIELDS:
            result["custom_metadata"].setdefault(key, value)
    if result["metrics"] is None:
        result["metrics"] = {}
    handlers = result["item_handlers"]
    if handlers is not None and not isinstance(handlers, dict | str):
        raise errors.MetadataError(
            f"{path}: 'item_handlers' must be an object or a string, got {handlers!r}."
        )
    return result
