"""How step numbers become directory names under a root, and back.

The default is the bare number (``<root>/1000``), which is also what Orbax's
``CheckpointManager`` writes. ``standard_name_format(step_prefix="step",
step_format_fixed_length=8)`` gives ``<root>/step_00001000``.

Any object with ``build_name`` and ``parse_step`` can be passed as
``Checkpointer(step_name_format=...)``; see ``StepNameFormat``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import attrs

from checkpointables import errors

__all__ = ["StepNameFormat", "StandardNameFormat", "standard_name_format"]


@runtime_checkable
class StepNameFormat(Protocol):
    """Maps steps to directory names and back.

    ``parse_step(build_name(step)) == step`` must hold for every step >= 0, and
    ``parse_step`` must return ``None`` for any name ``build_name`` cannot
    produce (other files in the root, temporary directories, other formats).
    """

    def build_name(self, step: int) -> str:
        """The directory name of ``step``."""
        ...

    def parse_step(self, name: str) -> int | None:
        """The step whose directory is called ``name``, or ``None``."""
        ...


def _check_prefix(instance: object, attribute: object, value: str | None) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise errors.InvalidArgumentError(
            f"step_prefix must be a non-empty string or None, got {value!r}."
        )
    if "/" in value or "\\" in value or value.startswith(".") or "\0" in value:
        raise errors.InvalidArgumentError(
            f"step_prefix {value!r} must be a plain name: no '/', '\\', NUL or leading '.'."
        )


def _check_length(instance: object, attribute: object, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 40:
        raise errors.InvalidArgumentError(
            f"step_format_fixed_length must be an int from 1 to 40 or None, got {value!r}."
        )


@attrs.frozen
class StandardNameFormat:
    """``[<prefix>_]<step>``, the step optionally zero-padded to a fixed width.

    Steps wider than the width are written in full (``step_format_fixed_length=3``
    names step 12345 ``12345``). Only names this format would write are
    recognized: with no padding ``007`` is not a step; with a prefix, a bare
    number is not.

    Attributes:
      step_prefix: text before the number, joined with ``_`` (``None``: none).
      step_format_fixed_length: zero-pad numbers to this many digits.
    """

    step_prefix: str | None = attrs.field(default=None, validator=_check_prefix)
    step_format_fixed_length: int | None = attrs.field(default=None, validator=_check_length)

    def build_name(self, step: int) -> str:
        """The directory name of ``step``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise errors.InvalidArgumentError(f"Steps are integers >= 0, got {step!r}.")
        width = self.step_format_fixed_length or 0
        number = f"{step:0{width}d}"
        return f"{self.step_prefix}_{number}" if self.step_prefix else number

    def parse_step(self, name: str) -> int | None:
        """The step whose directory is ``name``, or ``None`` if this format never writes it."""
        digits = name
        if self.step_prefix:
            head = f"{self.step_prefix}_"
            if not name.startswith(head):
                return None
            digits = name[len(head) :]
        # isdecimal() alone accepts non-ASCII digits; the round trip rejects
        # those and every non-canonical spelling (leading zeros, wrong width).
        if not digits.isascii() or not digits.isdecimal():
            return None
        step = int(digits)
        return step if self.build_name(step) == name else None


def standard_name_format(
    *, step_prefix: str | None = None, step_format_fixed_length: int | None = None
) -> StandardNameFormat:
    """A ``StandardNameFormat``: ``standard_name_format(step_prefix="step",
    step_format_fixed_length=5)`` names step 3 ``step_00003``.
    """
    return StandardNameFormat(
        step_prefix=step_prefix, step_format_fixed_length=step_format_fixed_length
    )


# ``<prefix>_<digits>`` or ``<digits>``; the shortest prefix, so ``run_1_0007`` fails
# ``run`` and is tried as ``run_1``.
_STANDARD_NAME = re.compile(r"(?:(?P<prefix>.+?)_)?(?P<digits>[0-9]+)")


def _candidate(name: str) -> StandardNameFormat | None:
    match = _STANDARD_NAME.fullmatch(name)
    if match is None:
        return None
    digits = match["digits"]
    # A leading zero can only come from padding; an unpadded number fits any width.
    width = len(digits) if len(digits) > 1 and digits.startswith("0") else None
    try:
        return StandardNameFormat(step_prefix=match["prefix"], step_format_fixed_length=width)
    except errors.InvalidArgumentError:  # A prefix no standard format writes.
        return None


def guess_standard_format(names: Iterable[str]) -> StandardNameFormat | None:
    """The ``StandardNameFormat`` that would have written the most of ``names``, or ``None``
    if none would write any (names of a custom format).

    Only a suggestion for messages: a Checkpointer never switches to it by itself.
    """
    names = list(names)
    candidates = dict.fromkeys(c for c in map(_candidate, names) if c is not None)
    if not candidates:
        return None
    return max(candidates, key=lambda c: sum(c.parse_step(n) is not None for n in names))


def as_code(name_format: StandardNameFormat) -> str:
    """The call that makes ``name_format``, for messages:
    ``cp.training.standard_name_format(step_prefix='step', step_format_fixed_length=6)``."""
    arguments = [
        f"{field}={value!r}"
        for field, value in (
            ("step_prefix", name_format.step_prefix),
            ("step_format_fixed_length", name_format.step_format_fixed_length),
        )
        if value is not None
    ]
    return f"cp.training.standard_name_format({', '.join(arguments)})"
