"""Finding the committed steps of a root directory.

A step is a subdirectory whose name the step name format parses and that is
a finished checkpoint (``cp.is_checkpoint``): temporary directories of
unfinished saves and half-deleted steps have names no format parses, so they
are never listed. Roots written by Orbax's ``CheckpointManager`` qualify too:
their steps have ``_CHECKPOINT_METADATA`` and keep metrics in a ``metrics/``
subdirectory, which is read when ``_CHECKPOINT_METADATA`` has none.
"""

from __future__ import annotations

import logging
from typing import Any

from etils import epath

from checkpointables import errors, layout, safe_json
from checkpointables.checkpoint_metadata import read_checkpoint_metadata
from checkpointables.training.step_info import StepInfo
from checkpointables.training.step_name_formats import StepNameFormat

logger = logging.getLogger(__name__)

# Where Orbax's CheckpointManager keeps a step's metrics (its MetricsHandler).
_ORBAX_METRICS_DIR = "metrics"
_ORBAX_METRICS_FILES = ("metrics", "data.json")


def _orbax_metrics(path: epath.Path) -> dict[str, Any]:
    directory = path / _ORBAX_METRICS_DIR
    for name in _ORBAX_METRICS_FILES:
        file = directory / name
        try:
            value = safe_json.loads(file.read_bytes(), source=file)
        except FileNotFoundError:
            continue
        except (OSError, errors.MetadataError) as e:
            logger.warning("Ignoring unreadable metrics file %s: %s", file, e)
            return {}
        return value if isinstance(value, dict) else {}
    return {}


def read_step(step: int, path: epath.Path) -> StepInfo:
    """The ``StepInfo`` of the committed checkpoint at ``path``.

    Raises:
      FileNotFoundError, cp.errors.NotACheckpointError: ``path`` is not a
        finished checkpoint.
      cp.errors.MetadataError: its ``_CHECKPOINT_METADATA`` is damaged.
    """
    layout.validate_checkpoint_directory(path)
    meta = read_checkpoint_metadata(path)
    metrics = meta.get("metrics") or {}
    if not metrics and (path / _ORBAX_METRICS_DIR).is_dir():
        metrics = _orbax_metrics(path)
    commit = meta.get("commit_timestamp_nsecs")
    return StepInfo(
        step=step,
        path=path,
        metrics=metrics if isinstance(metrics, dict) else {},
        commit_timestamp_nsecs=commit if isinstance(commit, int) else None,
    )


def scan(root: epath.Path, name_format: StepNameFormat) -> dict[int, StepInfo]:
    """Every committed step under ``root``, by step number.

    Steps whose metadata cannot be read are left out with a logged warning:
    one damaged step must not stop a run from resuming from the others.
    """
    found: dict[int, StepInfo] = {}
    try:
        children = list(root.iterdir())
    except FileNotFoundError:
        return found
    for child in children:
        step = name_format.parse_step(child.name)
        if step is None or layout.is_temporary_path(child):
            continue
        try:
            found[step] = read_step(step, child)
        except (FileNotFoundError, errors.NotACheckpointError):
            continue  # Not committed, or deleted while we looked.
        except (errors.CheckpointError, OSError) as e:  # Damaged: its metadata, or checksums.
            logger.warning("Skipping step directory %s: %s", child, e)
    return found
