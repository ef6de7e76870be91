"""Turning the metrics a training step produces into JSON stored with the checkpoint.

Training code passes whatever it has: Python numbers, NumPy scalars, 0-d
``jax.Array`` losses. They are converted to Python numbers only when a save
really happens (converting a device value waits for the computation), by
``cp.safe_json.to_json_value``, as custom metadata is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkpointables import errors, safe_json

__all__ = ["to_json"]


def to_json(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """A JSON-ready copy of ``metrics`` (``{}`` for ``None``).

    NaN and infinities are kept (a diverged loss is worth recording); arrays
    of one element are taken as the number they hold (a ``(1,)`` loss); keys
    must be strings, so that the metrics read back are those given.

    Raises:
      cp.errors.InvalidArgumentError: metrics is not a dict, or holds a value
        or key JSON cannot store; the message names its key path
        (``metrics['eval']['acc']``).
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise errors.InvalidArgumentError(
            f"metrics must be a dict of name to number, got {type(metrics).__name__}; "
            f'e.g. metrics={{"loss": loss}}.'
        )
    return safe_json.to_json_value(
        metrics, what="metrics", one_element_arrays=True, string_keys=True
    )
