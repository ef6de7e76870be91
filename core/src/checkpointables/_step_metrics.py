"""A checkpoint's metrics: written where Orbax looks for them, read from where Orbax puts them.

Orbax's training ``Checkpointer`` (and its V0 ``CheckpointManager`` given
``metrics=``) stores a step's metrics as a reserved item, the file
``<step>/metrics/metrics`` (a JSON object), and records the item in
``item_handlers``, leaving ``_CHECKPOINT_METADATA``'s ``metrics`` empty.
Ours keeps them in ``_CHECKPOINT_METADATA`` (covered by its checksum) and
also writes ``metrics/metrics``, so each library finds the other's.

The metrics item is never a checkpointable: loads leave it out, and metadata
report its content as ``.metrics``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from etils import epath

from checkpointables import errors, layout, metadata_checksums, safe_json, storage

__all__ = ["FILE", "files_for", "has_item", "read", "read_item"]

# Orbax's MetricsHandler (a JSON handler whose file is named "metrics").
FILE = f"{layout.METRICS_NAME}/metrics"
# Also tried: the file of a JSON handler with its default name.
_OTHER_FILE = f"{layout.METRICS_NAME}/data.json"


def files_for(metrics: Mapping[str, Any] | None) -> dict[str, str]:
    """The files a save writes for ``metrics`` (name -> text): none without metrics, as Orbax."""
    if not metrics:
        return {}
    return {FILE: json.dumps(dict(metrics))}


def has_item(path: epath.Path, meta: Mapping[str, Any]) -> bool:
    """Whether checkpoint ``path`` (with metadata ``meta``) has a metrics item."""
    recorded = meta.get("item_handlers")
    if isinstance(recorded, dict):
        return layout.METRICS_NAME in recorded  # Orbax records it; ours need not be read.
    # Nothing recorded (a writer older than item_handlers): look.
    return recorded is None and storage.is_dir(path / layout.METRICS_NAME)


def read_item(path: epath.Path) -> dict[str, Any]:
    """The content of the metrics item of checkpoint ``path`` (raises as ``read``)."""
    for name in (FILE, _OTHER_FILE):
        file = path / name
        try:
            raw = metadata_checksums.read_file(file, max_bytes=metadata_checksums.MAX_FILE_BYTES)
        except FileNotFoundError:
            continue
        return safe_json.loads_object(raw, source=file)
    raise errors.IntegrityError(
        f"{path / layout.METRICS_NAME} holds no metrics file ({FILE} as Orbax writes it): the "
        f"checkpoint is damaged. Its checkpointables may still load; restore it from a copy "
        f"to get its metrics back."
    )


def read(path: epath.Path, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics of checkpoint ``path``: those of its ``_CHECKPOINT_METADATA`` (``meta``),
    else those of its metrics item, else ``{}``.

    Raises:
      cp.errors.MetadataError: the metrics file is not a JSON object.
      cp.errors.IntegrityError: the metrics item has no metrics file, or the file does
        not match the checksum recorded at commit.
    """
    recorded = meta.get("metrics")
    if recorded:
        return dict(recorded)
    if not has_item(path, meta):
        return {}
    return read_item(path)
