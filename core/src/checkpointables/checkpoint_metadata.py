"""``CheckpointMetadata`` and the ``_CHECKPOINT_METADATA`` file."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from etils import epath

from checkpointables import errors, metadata_checksums, safe_json

__all__ = [
    "CheckpointMetadata",
    "CHECKPOINT_METADATA_FILE",
    "DISTRIBUTIONS_FIELD",
    "read_checkpoint_metadata",
    "recorded_distribution",
]

CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"
# Our own record: name -> {"distribution": ..., "version": ...} of the plugin whose handler
# saved it. Written inside custom_metadata: Orbax refuses an unknown top-level key when
# custom_metadata is not empty. Our reader takes it out of custom_metadata again.
DISTRIBUTIONS_FIELD = "checkpointables_handler_distributions"
T = TypeVar("T")
# What a distribution name and a version may look like (PEP 508 names; PEP 440-ish versions):
# a recorded value that is not one is never shown, since errors suggest installing it.
_DISTRIBUTION_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?$")
_VERSION = re.compile(r"^[A-Za-z0-9.+!_-]{1,64}$")

# Field order as Orbax writes it, so that files compare equal across tools.
_KNOWN_FIELDS = (
    "item_handlers",
    "metrics",
    "performance_metrics",
    "init_timestamp_nsecs",
    "commit_timestamp_nsecs",
    "custom_metadata",
    DISTRIBUTIONS_FIELD,
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
    distributions: Mapping[str, tuple[str, str | None]] | None = None,
    performance_metrics: Mapping[str, Any] | None = None,
) -> str:
    """The text of a ``_CHECKPOINT_METADATA`` file, in Orbax's field order.

    ``performance_metrics``: what the save measured (``cp.staging``: its peak staging
    memory, an integer, which Orbax's reader ignores).

    ``distributions`` maps checkpointable names to the ``(name, version)`` of the
    distribution whose plugin saved them; recorded, if not empty, under a key of
    ``custom_metadata`` that our reader removes again (unless the user's own
    custom metadata holds that key: then it is not recorded).

    Raises:
      cp.errors.InvalidArgumentError: ``custom_metadata`` or ``metrics`` holds
        something JSON cannot store (``safe_json.to_json_value``), naming its key path.
    """
    handlers = dict(item_handlers) if isinstance(item_handlers, Mapping) else item_handlers
    fields: dict[str, Any] = {
        "item_handlers": handlers,
        "metrics": safe_json.to_json_value(dict(metrics or {}), what="metrics"),
        "performance_metrics": dict(performance_metrics or {}),
        "init_timestamp_nsecs": init_timestamp_nsecs,
        "commit_timestamp_nsecs": commit_timestamp_nsecs,
        # NumPy and JAX scalars (np.float32(0.1), a jnp loss) are stored as Python numbers.
        "custom_metadata": safe_json.to_json_value(
            dict(custom_metadata or {}), what="custom_metadata"
        ),
    }
    if distributions and DISTRIBUTIONS_FIELD not in fields["custom_metadata"]:
        fields["custom_metadata"][DISTRIBUTIONS_FIELD] = {
            name: {"distribution": dist, "version": version}
            for name, (dist, version) in distributions.items()
        }
    return json.dumps(fields)


def recorded_distribution(meta: Mapping[str, Any], name: str) -> tuple[str, str | None] | None:
    """The ``(distribution, version)`` recorded for checkpointable ``name`` in the parsed
    metadata ``meta``, or ``None`` if none is, or if it does not look like one (a hint
    only: a damaged or crafted value is ignored, never shown)."""
    recorded = meta.get(DISTRIBUTIONS_FIELD)
    entry = recorded.get(name) if isinstance(recorded, dict) else None
    if not isinstance(entry, dict):
        return None
    dist, version = entry.get("distribution"), entry.get("version")
    if not isinstance(dist, str) or not _DISTRIBUTION_NAME.match(dist):
        return None
    if not isinstance(version, str) or not _VERSION.match(version):
        version = None
    return dist, version


def read_checkpoint_metadata(directory: epath.PathLike) -> dict[str, Any]:
    """Reads ``_CHECKPOINT_METADATA``; unknown top-level keys go to ``custom_metadata``.

    The file is checked against the checksum recorded at commit (see
    ``cp.metadata_checksums``), and every recorded checkpointable name must
    be a plain directory name.

    Raises:
      FileNotFoundError: the file does not exist.
      errors.MetadataError: the file is unreadable, not a JSON object, or malformed.
      errors.StorageError: the storage failed to answer (an object store refused or kept
        failing the request): nothing is known of the file.
      errors.IntegrityError: the file does not match its recorded checksum, or the
        checkpoint lost its ``_CHECKSUMS``.
      errors.OutsideCheckpointError: a recorded name points outside the checkpoint.
    """
    path = epath.Path(directory) / CHECKPOINT_METADATA_FILE
    try:
        checked = metadata_checksums.read_checked(path, max_bytes=metadata_checksums.MAX_FILE_BYTES)
        if not checked.checked:  # Never recorded (Orbax's), or lost: the marker says which.
            metadata_checksums.check_recorded(directory)
        raw = checked.data
    except OSError as e:
        if isinstance(e, FileNotFoundError | errors.StorageError):  # Storage, not the file.
            raise
        raise errors.MetadataError(f"Cannot read {path}: {e}.") from e
    result = _validated(path, safe_json.loads_object(raw, source=path))
    return result


def _validated(path: epath.Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The known fields of a parsed ``_CHECKPOINT_METADATA``, checked."""
    result: dict[str, Any] = {k: raw.get(k) for k in _KNOWN_FIELDS}
    custom = raw.get("custom_metadata")
    if custom is not None and not isinstance(custom, dict):  # Never dropped unseen.
        raise _malformed(path, "'custom_metadata' must be an object")
    result["custom_metadata"] = dict(custom or {})
    # Recorded inside custom_metadata (for Orbax): ours, not the user's.
    if result[DISTRIBUTIONS_FIELD] is None:
        result[DISTRIBUTIONS_FIELD] = result["custom_metadata"].pop(DISTRIBUTIONS_FIELD, None)
    for key, value in raw.items():
        if key not in _KNOWN_FIELDS:
            result["custom_metadata"].setdefault(key, value)
    if result["metrics"] is None:
        result["metrics"] = {}
    for field in ("init_timestamp_nsecs", "commit_timestamp_nsecs"):
        value = result[field]
        # time.time_ns() fits in 64 bits until the year 2262; datetime refuses far beyond.
        if value is not None and (type(value) is not int or not 0 <= value < 1 << 63):
            raise _malformed(path, f"{field!r} must be a non-negative 64-bit integer")
    if not isinstance(result["metrics"], dict):
        raise _malformed(path, "'metrics' must be an object")
    handlers = result["item_handlers"]
    if isinstance(handlers, dict):
        for name, typestr in handlers.items():
            _check_recorded_name(path, name)
            if typestr is not None and not isinstance(typestr, str):
                raise _malformed(path, f"the handler recorded for {_shown(name)} is not a string")
    elif handlers is not None and not isinstance(handlers, str):
        raise _malformed(path, "'item_handlers' must be an object or a string")
    return result


def _shown(name: str) -> str:
    """A recorded name for a message: quoted, and cut short if it is long."""
    return repr(name) if len(name) <= 80 else repr(name[:80]) + "..."


def _malformed(path: epath.Path, problem: str) -> errors.MetadataError:
    return errors.MetadataError(
        f"{path} is malformed: {problem}. The checkpoint's metadata is damaged; restore it from "
        f"a copy, or load an older checkpoint."
    )


def _check_recorded_name(path: epath.Path, name: str) -> None:
    """A recorded checkpointable name must name one directory inside the checkpoint."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise errors.OutsideCheckpointError(
            f"{path} records a checkpointable named {_shown(name)}, which is not a plain "
            f"directory name: it would be read from outside the checkpoint, so the checkpoint "
            f"is refused. It is damaged or was crafted; restore it from a copy."
        )
