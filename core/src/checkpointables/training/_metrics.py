"""Turning the metrics a training step produces into JSON stored with the checkpoint.

Training code passes whatever it has: Python numbers, NumPy scalars, 0-d
``jax.Array`` losses. They are converted to Python numbers only when a save
really happens (converting a device value waits for the computation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkpointables import errors

__all__ = ["to_json"]


def _scalar(value: Any, where: str) -> Any:
    # NaN and infinities are kept (Python's json writes them): a diverged loss
    # is worth recording, and they load back as floats.
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return float(value)  # np.float64 is a float subclass: store a plain float.
    shape = getattr(value, "shape", None)
    item = getattr(value, "item", None)
    if callable(item) and shape is not None and tuple(shape) in ((), (1,)):
        return _scalar(item(), where)
    raise errors.InvalidArgumentError(
        f"metrics{where} is a {type(value).__name__}; metrics must be numbers, strings, "
        f"booleans, None, or dicts/lists of them (scalar NumPy/JAX arrays are converted). "
        f"Reduce arrays to a number first, e.g. float(loss.mean())."
    )


def _convert(value: Any, where: str) -> Any:
    if isinstance(value, Mapping):
        result = {}
        for key, inner in value.items():
            if not isinstance(key, str):
                raise errors.InvalidArgumentError(
                    f"metrics{where} has the key {key!r}; metric names must be strings."
                )
            result[key] = _convert(inner, f"{where}[{key!r}]")
        return result
    if isinstance(value, list | tuple):
        return [_convert(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return _scalar(value, where)


def to_json(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """A JSON-ready copy of ``metrics`` (``{}`` for ``None``).

    Raises:
      ValueError: metrics is not a dict, or holds a value JSON cannot store;
        the message names its key path.
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise errors.InvalidArgumentError(
            f"metrics must be a dict of name to number, got {type(metrics).__name__}; "
            f'e.g. metrics={{"loss": loss}}.'
        )
    return _convert(metrics, "")
