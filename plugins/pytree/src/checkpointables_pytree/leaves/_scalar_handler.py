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
            return np.dtype(name[3:]).type
        except TypeError:
            pass
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


def _to_scalar(array: np.ndarray, scalar_type: Any, entry: tree.Entry, check: bool = False) -> Any:
    if scalar_type is None:  # Decided by the stored dtype, now that it is read.
        scalar_type = _scalar_type(None, array.dtype)
    if array.size != 1:
        raise cp.errors.TreeMismatchError(
            f"{entry.keystr} stores an array of shape "
            f"{array.shape}; it cannot be loaded as a scalar "
            f"{getattr(scalar_type, '__name__', scalar_type)}. Use an array abstract leaf instead."
        )
    value = (
        array.reshape(()).item()
        if scalar_type in (int, float, bool, complex)
        else array.reshape(())[()]
    )
    if check:  # The abstract leaf's type, not the stored one: it must keep the value.
        value = value_kept(value, scalar_type, entry.keystr)
    return scalar_type(value)


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
                storage=cp.options.ArrayStorageOptions(),
                extra={"scalar_type": _scalar_type_name(value)},
            )

    def _read_target(
        self, entry: tree.Entry, abstract: Any, stored: StoredArray | None
    ) -> ReadTarget:
        if abstract is not None:
            scalar_type = abstract if isinstance(abstract, type) else type(abstract)
            return ReadTarget(lambda pieces: _to_scalar(pieces[0], scalar_type, entry, True))
        if stored is not None:
            scalar_type = _scalar_type(entry.extra.get("scalar_type"), stored.dtype)
        else:
            scalar_type = None
        return ReadTarget(lambda pieces: _to_scalar(pieces[0], scalar_type, entry))

    def _describe(self, session: LoadSession, entry: tree.Entry, layout: StoredLayout) -> Any:
        return _scalar_type(entry.extra.get("scalar_type"), layout.dtype)(0)
