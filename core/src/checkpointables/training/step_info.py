"""``StepInfo`` (one committed step of a root) and ``RootMetadata`` (the root itself)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import attrs
from etils import epath

__all__ = ["StepInfo", "RootMetadata"]


def _frozen_dict(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(value or {})


def _to_path(value: epath.PathLike) -> epath.Path:
    return epath.Path(value)


@attrs.frozen
class StepInfo:
    """A committed checkpoint of a training run, as ``Checkpointer.steps()`` lists it.

    Policies receive sequences of these (sorted by step) to decide what to save
    and what to keep.

    Attributes:
      step: the training step.
      path: the checkpoint directory (loadable with the free functions, e.g.
        ``cp.load_pytree(info.path)``).
      metrics: the metrics saved with the step (``{}`` when none were given).
      commit_timestamp_nsecs: when the checkpoint was committed (ns since the
        epoch), or ``None`` if the checkpoint does not record it.
    """

    step: int
    path: epath.Path = attrs.field(converter=_to_path)
    metrics: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_dict, eq=False)
    commit_timestamp_nsecs: int | None = None

    @property
    def commit_timestamp(self) -> datetime.datetime | None:
        """The commit time as an aware UTC datetime, or ``None``."""
        if self.commit_timestamp_nsecs is None:
            return None
        return datetime.datetime.fromtimestamp(self.commit_timestamp_nsecs / 1e9, tz=datetime.UTC)


@attrs.frozen
class RootMetadata:
    """What a root directory says about the whole run.

    Attributes:
      directory: the root directory.
      custom_metadata: the dict given as ``Checkpointer(custom_metadata=...)``
        by the run that first wrote the root (``{}`` if none).
    """

    directory: epath.Path = attrs.field(converter=_to_path)
    custom_metadata: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_dict)
