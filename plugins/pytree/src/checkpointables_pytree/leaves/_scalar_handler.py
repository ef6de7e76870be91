"""The leaf handler of Python and NumPy scalars: 0-d zarr3 arrays that remember their type."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import checkpointables as cp
import numpy as np
from checkpointables.serialization import SerializationParam

from checkpointables_pytree import tree
from checkpointables_pytree.io import StoredArray
from checkpointables_pytree.leaves._common import (
    ReadTarget,
    StoredLayout,
    ZarrLeafHandler,
    schedule_array,
    storage_dtype,
    storage_options,
    unsupported,
)
from checkpointables_pytree.leaves._options import ArrayStorageOptions
from checkpointables_pytree.leaves._scalar_casts import value_kept
from checkpointables_pytree.leaves._session import LoadSession, SaveSession

__all__ = ["ScalarLeafHandler"]

_PYTHON_SCALARS: dict[str, type] = {"int": int, "float": float, "bool": bool, "complex": complex}


def _scalar_type_name(value: Any) -> str:
    if isinstance(value, np.generic):
        return "np." + np.dtype(type(value)).name
    for name, t in _PYTHON_SCALARS.items():
        if type(value) is t:
            return name
    for name, t in (("bool", bool), ("int", int), ("float", float), ("complex", complex)):
        if isinstance(value, t):
            return name
    return type(value).__name__


def _scalar_type(name: str | None, dtype: np.dtype | None) -> Any:
    """The Python or NumPy scalar type recorded as ``name`` (or implied by ``dtype``)."""
    if name in _PYTHON_SCALARS:
        return _PYTHON_SCALARS[name]
    if name and name.startswith("np."):
        try:
            recorded = np.dtype(name[3:])
        except (TypeError, ValueError):
            recorded = None
        if recorded is not None and recorded.kind in "biufc":  # A number: what scalars hold.
            return recorded.type
    if dtype is None:
        return float
    # Orbax's scalars: Python int, float and bool are stored as int64, float64, bool.
    if dtype.kind == "b":
        return bool
    if dtype.kind in "iu":
        return int
    if dtype.kind == "c":
        return complex
    if dtype == np.float64:
        return float
    return dtype.type


def _to_scalar(
    array: np.ndarray, scalar_type: Any, entry: tree.Entry, *, recorded: bool, asked: bool
) -> Any:
    """The scalar ``array`` holds, as ``scalar_type``.

    ``recorded``: the type comes from ``_METADATA``, so it must hold the stored
    value exactly (else the metadata is damaged). ``asked``: the type is an
    abstract leaf's, so it must keep the value (else the caller asks for a cast).
    """
    if scalar_type is None:  # Decided by the stored dtype, now that it is read.
        scalar_type = _scalar_type(None, array.dtype)
    if array.size != 1:
        raise cp.errors.TreeMismatchError(
            f"{entry.keystr} stores an array of shape "
            f"{array.shape}; it cannot be loaded as a scalar "
            f"{getattr(scalar_type, '__name__', scalar_type)}. Use an array abstract leaf instead."
        )
    stored = array.reshape(())
    if asked:
        kept = value_kept(
            stored.item() if scalar_type in _PYTHON_TYPES else stored[()], scalar_type, entry.keystr
        )
        return scalar_type(kept)
    try:
        value = scalar_type(stored.item() if scalar_type in _PYTHON_TYPES else stored[()])
        exact = not recorded or _holds_exactly(value, stored)
    except (OverflowError, ValueError, TypeError):
        exact = False
    if not exact:
        raise cp.errors.MetadataError(
            f"{entry.keystr}: _METADATA records a scalar of type "
            f"{entry.extra.get('scalar_type')!r}, but the value stored ({stored.item()!r}, "
            f"{stored.dtype}) is not one: the metadata is damaged. Restore the checkpoint from a "
            f"copy, or load the leaf with an abstract leaf of the type you expect."
        )
    return value


def _holds_exactly(value: Any, stored: np.ndarray) -> bool:
    """Whether ``value`` converts back to ``stored``'s dtype bit for bit (``True`` for a stored
    12345 is not exact; ``7.0`` for a stored ``7`` is, and cannot be told from it)."""
    if stored.dtype.kind in _KINDS.get(type(value), "-") or type(value) is stored.dtype.type:
        return True  # The usual case, exact by construction: no conversion back.
    if np.iscomplexobj(value) and stored.dtype.kind != "c":
        return False  # A real value recorded as complex (converting back would warn).
    back = np.asarray(value).astype(stored.dtype)
    return back.tobytes() == np.ascontiguousarray(stored).tobytes()


_PYTHON_TYPES = (int, float, bool, complex)
# The dtype kinds each Python type holds exactly: Python ints have no bounds, floats are
# doubles (float16, float32 and float64 fit), complexes pairs of doubles.
_KINDS: dict[type, str] = {bool: "b", int: "iu", float: "f", complex: "c"}


class ScalarLeafHandler(ZarrLeafHandler):
    """Saves Python and NumPy scalars as 0-d zarr3 arrays, recording their exact type.

    ``int`` is stored as int64, ``float`` as float64, ``bool`` as bool and
    NumPy scalars in their own dtype; each loads back as its own type (or as
    the type of the abstract leaf: ``0.0`` loads a float, where the conversion
    keeps the value: ``2.5`` given ``0`` raises ``TreeMismatchError``). ``metadata`` gives
    a zero of each stored scalar's type (``0``, ``0.0``, ``False``, ``np.float32(0)``...).
    """

    loads_as = "a scalar"

    def _schedule_writes(
        self, session: SaveSession, params: Sequence[SerializationParam[Any]]
    ) -> None:
        for param in params:
            value = param.value
            try:
                array = np.asarray(value)
            except OverflowError:
                array = np.asarray(None)
            if isinstance(value, int) and array.dtype.kind not in "biu":
                raise unsupported(
                    param.keypath, value, "the integer does not fit in 64 bits; store it as a str"
                )
            storage = storage_options(session, param.keypath, value)
            dtype = storage_dtype(param.keypath, value, array.dtype, storage)
            schedule_array(
                session,
                param,
                shape=(),
                dtype=dtype,
                chunk_shape=(),
                chunks=[((), array.astype(dtype, copy=False))],
                storage=ArrayStorageOptions(),
                extra={"scalar_type": _scalar_type_name(value)},
            )

    def _read_target(
        self, entry: tree.Entry, abstract: Any, stored: StoredArray | None
    ) -> ReadTarget:
        if abstract is not None:  # The caller's type: it must keep the stored value.
            asked = abstract if isinstance(abstract, type) else type(abstract)
            return ReadTarget(
                lambda pieces: _to_scalar(pieces[0], asked, entry, recorded=False, asked=True)
            )
        recorded = False
        if stored is not None:
            scalar_type = _scalar_type(entry.extra.get("scalar_type"), stored.dtype)
            recorded = "scalar_type" in entry.extra  # Trusted from _METADATA: checked.
        else:
            scalar_type = None
        return ReadTarget(
            lambda pieces: _to_scalar(pieces[0], scalar_type, entry, recorded=recorded, asked=False)
        )

    def _describe(self, session: LoadSession, entry: tree.Entry, layout: StoredLayout) -> Any:
        return _scalar_type(entry.extra.get("scalar_type"), layout.dtype)(0)
