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


def refuse_class(argument: str, value: Any, protocol: type) -> None:
    """Raises when ``value`` is a class of ``protocol``'s kind rather than an instance: a
    class has the protocol's methods too, and would fail at its first call (``self``
    missing), far from the mistake."""
    if not isinstance(value, type):
        return
    try:
        kind = issubclass(value, protocol)
    except TypeError:  # A protocol with data members cannot tell; nor can the hint.
        kind = False
    if kind:
        raise errors.InvalidArgumentTypeError(
            f"{argument} must be an instance, got the class {value.__name__} itself: pass an "
            f"instance: {value.__name__}(...)."
        )


def as_list(owner: str, what: str, value: Any, example: str) -> list[Any]:
    """``value``, the collection of ``what`` that ``owner`` takes, as a list; a single item
    (or a string) is refused, rather than failing as "not iterable" or read as characters."""
    if not isinstance(value, str | bytes):
        try:
            return list(value)
        except TypeError:
            pass
    raise errors.InvalidArgumentTypeError(
        f"{owner} takes a list of {what} (e.g. {example}), got {reprlib.repr(value)} "
        f"({type(value).__name__}): put a single one in a list."
    )


def checked(argument: str, value: Any, default: Callable[[], Any], protocol: type) -> Any:
    """``value`` (``default()`` if ``None``), checked to meet the documented ``protocol``."""
    chosen = default() if value is None else value
    refuse_class(argument, chosen, protocol)
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
