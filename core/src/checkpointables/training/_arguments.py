"""Checking what a caller passes to a ``Checkpointer``: steps and policies."""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Callable
from typing import Any

from checkpointables import errors
from checkpointables.context import Context


def as_step(step: Any) -> int:
    """``step`` as an int >= 0 (NumPy and JAX integer scalars are accepted)."""
    if isinstance(step, bool):
        raise errors.InvalidArgumentTypeError(f"Steps are integers >= 0, got the bool {step!r}.")
    try:
        value = operator.index(step)
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            f"Steps are integers >= 0, got {type(step).__name__} {reprlib.repr(step)} as the "
            f"step, a Checkpointer method's first argument. Loads take the step first (None: "
            f"the latest) and the abstract tree second: ckptr.load_pytree(step, abstract_pytree) "
            f"or ckptr.load_pytree(abstract_pytree=abstract_pytree)."
        ) from None
    if value < 0:
        raise errors.InvalidArgumentError(f"Steps are integers >= 0, got {value}.")
    return value


def checked(argument: str, value: Any, default: Callable[[], Any], protocol: type) -> Any:
    """``value`` (``default()`` if ``None``), checked to meet the documented ``protocol``."""
    chosen = default() if value is None else value
    if not isinstance(chosen, protocol):
        public = (
            "cp.Context"
            if protocol is Context
            else f"cp.{protocol.__module__.removeprefix('checkpointables.')}"
        )
        raise errors.InvalidArgumentTypeError(
            f"{argument} must be a {protocol.__name__} (see {public}), got {chosen!r}."
        )
    return chosen
