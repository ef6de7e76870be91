"""Converting a stored scalar to the type of its abstract leaf, only where the value survives.

``2.0`` loads as ``2`` given ``0`` and ``3`` as ``3.0`` given ``0.0``; a float
rounds to a narrower float type (as arrays cast to another dtype do). A
conversion that would change the value (``2.5`` given ``0``, ``300`` given
``np.int8(0)``, ``1+2j`` given ``0.0``, ``2`` given ``False``) is a
``TreeMismatchError`` that says how to ask for the cast: a 0-d array abstract leaf.
"""

from __future__ import annotations

import math
from typing import Any

import checkpointables as cp
import numpy as np

__all__ = ["value_kept"]


def value_kept(value: Any, scalar_type: Any, keystr: str) -> Any:
    """``value``, ready for ``scalar_type(...)``, which keeps it.

    Raises:
      cp.errors.TreeMismatchError: the conversion would change the value.
    """
    why = _change(value, scalar_type)
    if why is not None:
        raise _changed_error(keystr, value, scalar_type, why)
    complex_type = scalar_type is complex or issubclass(scalar_type, np.complexfloating)
    if isinstance(value, (complex, np.complexfloating)) and not complex_type:
        return value.real  # Its imaginary part is 0 (checked above).
    return value


_KINDS = {bool: "b", int: "i", float: "f", complex: "c"}


def _change(value: Any, scalar_type: Any) -> str | None:
    """How ``scalar_type(value)`` would change the value, or ``None`` if it keeps it.

    Floats may round to a narrower float type (as arrays cast to another
    dtype do); anything else must keep its value exactly.
    """
    kind = _KINDS.get(scalar_type)
    if kind is None:
        try:
            kind = np.dtype(scalar_type).kind
        except TypeError:
            return None  # Not a NumPy scalar type: nothing to check.
    if isinstance(value, (int, np.integer, np.bool_)):
        number: int | complex = int(value)
    else:
        try:
            number = complex(value)
        except (TypeError, ValueError):
            return None
    if isinstance(number, complex):
        if number.imag and kind != "c":
            return "has an imaginary part"
        if kind in "biu":
            if not number.real.is_integer():
                return "is not a whole number"
            number = int(number.real)
    if kind == "b" and number not in (0, 1):
        return "is not 0 or 1"
    if kind in "iu" and scalar_type is not int:
        info = np.iinfo(scalar_type)
        if not info.min <= number <= info.max:  # type: ignore[operator]
            return f"is outside the range of {info.dtype}"
    if kind in "fc":
        top = float(np.finfo(float if scalar_type in (float, complex) else scalar_type).max)
        parts = (number.real, number.imag) if isinstance(number, complex) else (number,)
        if any(math.isfinite(p) and abs(p) > top for p in parts):
            return f"is outside the range of {np.dtype(scalar_type).name}"
    return None


def _changed_error(keystr: str, value: Any, scalar_type: Any, why: str) -> Exception:
    name = getattr(scalar_type, "__name__", str(scalar_type))
    dtype = np.dtype(scalar_type).name
    return cp.errors.TreeMismatchError(
        f"{keystr} stores {value!r}, which {why}: loading it as {name} (the abstract "
        f"leaf's type) would change it. To cast it anyway, give a 0-d array abstract leaf, "
        f"np.empty((), np.{dtype}) or jax.ShapeDtypeStruct((), jnp.{dtype}), which casts as "
        f"arrays do; or an abstract leaf of the stored type, and convert the value yourself."
    )
