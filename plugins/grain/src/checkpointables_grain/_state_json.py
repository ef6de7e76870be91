"""Iterator states as JSON text, exactly and without pickle.

Grain's own iterators produce plain JSON-able states, which are written as
plain JSON (the same text Grain's own checkpointing writes, so either side can
read the other's files). Values JSON cannot hold exactly are written as tagged
objects and come back as they were:

    bytes                         {"__checkpointables__": "bytes", "base64": "..."}
    tuple                         {"__checkpointables__": "tuple", "items": [...]}
    dict with non-str keys        {"__checkpointables__": "dict", "items": [[k, v], ...]}
    NaN / infinity                {"__checkpointables__": "float", "value": "nan"}
    NumPy scalar                  {"__checkpointables__": "numpy", "dtype": "int64", "value": 3}
    NumPy array                   {"__checkpointables__": "ndarray", "dtype": "<f4",
                                   "shape": [2], "base64": "..."}

Other NumPy scalars (``np.str_``, ``np.complex64``, structured ``np.void``)
are stored as 0-d arrays with ``"scalar": true`` and come back as the same
NumPy type. A structured dtype is stored as the object ``np.dtype`` takes
(``{"names": [...], "formats": [...], "offsets": [...], "itemsize": 12}``,
formats nested the same way, a field's sub-array as ``{"base": ..., "shape":
[...]}``), checked on load to describe exactly the dtype it builds; nothing
is evaluated or imported.

Anything else (objects, sets, functions, integers over 4300 digits) is
refused with an error naming where in the state it sits.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from typing import Any

import numpy as np

__all__ = ["TAG", "dumps", "loads", "StateEncodingError", "StateDecodingError"]

TAG = "__checkpointables__"
_MAX_DEPTH = 200
# Python converts no integer of more digits to or from text by default: a state
# holding one could not be loaded elsewhere, whatever this process allows.
_MAX_INT_DIGITS = sys.int_info.default_max_str_digits
_INT_LIMIT = 10**_MAX_INT_DIGITS


class StateEncodingError(TypeError):
    """A state holds a value that cannot be stored as JSON exactly."""


class StateDecodingError(ValueError):
    """Stored text is not a state this module wrote (not JSON, or a bad tag)."""


def dumps(state: Any) -> str:
    """The JSON text of ``state``; raises ``StateEncodingError`` naming the bad value."""
    return json.dumps(_encode(state, "state", 0), indent=4, allow_nan=False)


def loads(text: str) -> Any:
    """The state ``dumps`` wrote (or any plain JSON); raises ``StateDecodingError``."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise StateDecodingError(f"not valid JSON ({e})") from e
    return _decode(raw, "state")


def _tagged(kind: str, **fields: Any) -> dict[str, Any]:
    return {TAG: kind, **fields}


def _encode(value: Any, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise StateEncodingError(f"{where} is nested more than {_MAX_DEPTH} levels deep.")
    if isinstance(value, np.generic):
        # Before str and float: np.str_ and np.float64 subclass them, and come back as such.
        return _encode_numpy_scalar(value, where)
    if value is None or isinstance(value, bool | str):
        return value
    if type(value) is int:
        if abs(value) >= _INT_LIMIT:
            raise StateEncodingError(
                f"{where} is an integer of {value.bit_length():,} bits, more than the "
                f"{_MAX_INT_DIGITS} digits Python reads from JSON text by default, so it could "
                f"not be loaded. Store it in another form, e.g. hex(n) or n.to_bytes(...)."
            )
        return value
    if type(value) is float:
        return value if math.isfinite(value) else _tagged("float", value=repr(value))
    if isinstance(value, bytes | bytearray):
        return _tagged("bytes", base64=base64.b64encode(bytes(value)).decode("ascii"))
    if isinstance(value, np.ndarray):
        return _encode_array(value, where)
    if type(value) is list:
        return [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if type(value) is tuple:
        return _tagged(
            "tuple", items=[_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        )
    if type(value) is dict:
        if all(type(k) is str for k in value) and TAG not in value:
            return {k: _encode(v, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}
        return _tagged(
            "dict",
            items=[
                [
                    _encode(k, f"{where} key {_key_text(k)}", depth + 1),
                    _encode(v, f"{where}[{_key_text(k)}]", depth + 1),
                ]
                for k, v in value.items()
            ],
        )
    raise StateEncodingError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which cannot be "
        f"stored as JSON. Iterator states may hold dicts, lists, tuples, str, int, float, bool, "
        f"None, bytes and NumPy numbers or arrays; make get_state() return those."
    )


def _key_text(key: Any) -> str:
    """``repr(key)``, which raises for an integer of more digits than Python converts."""
    if type(key) is int and abs(key) >= _INT_LIMIT:
        return f"<an integer of {key.bit_length():,} bits>"
    return repr(key)


def _encode_numpy_scalar(value: np.generic, where: str) -> Any:
    kind = value.dtype.kind
    if kind in "biu" or (kind == "f" and value.dtype.itemsize <= 8):
        return _tagged("numpy", dtype=value.dtype.name, value=_encode(value.item(), where, 0))
    return _encode_array(np.asarray(value), where, scalar=True)


def _encode_array(value: np.ndarray, where: str, *, scalar: bool = False) -> Any:
    if value.dtype.hasobject:
        raise StateEncodingError(
            f"{where} is a NumPy array of Python objects, which cannot be stored as JSON; "
            f"use a numeric, bool or fixed-width string dtype."
        )
    _refuse_unstorable_dtype(value.dtype, where)
    fields: dict[str, Any] = {
        "dtype": _dtype_json(value.dtype),
        "shape": list(value.shape),
        "base64": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode("ascii"),
    }
    if scalar:
        fields["scalar"] = True
    return _tagged("ndarray", **fields)


def _refuse_unstorable_dtype(dtype: np.dtype, where: str) -> None:
    """Refuses the dtypes ``_dtype_json`` cannot describe so that they come back as they
    were: named fields over a numeric base (a "union": ``np.dtype((np.int32, {...}))``,
    which would come back as a record), and records of no bytes (NumPy cannot rebuild an
    array of them from its bytes), at any depth of the record."""
    for inner in _nested_dtypes(dtype):
        if inner.names is not None and inner.kind != "V":
            raise StateEncodingError(
                f"{where} has dtype {dtype}, with named fields over a {inner.base.kind!r}-kind "
                f"base, which a state cannot store as it is; store the base array, or a plain "
                f"record."
            )
    if dtype.itemsize == 0 and (dtype.names is not None or dtype.subdtype is not None):
        raise StateEncodingError(
            f"{where} has dtype {dtype!r}, of records holding no bytes, which a state cannot "
            f"store; drop it, or give its fields a size."
        )


def _nested_dtypes(dtype: np.dtype) -> list[np.dtype]:
    """``dtype`` and every dtype inside it (fields, sub-array bases), outermost first."""
    found, pending = [], [dtype]
    while pending:  # No recursion: NumPy nests records as deep as memory allows.
        inner = pending.pop()
        found.append(inner)
        if inner.subdtype is not None:
            pending.append(inner.subdtype[0])
        pending.extend(inner.fields[n][0] for n in inner.names or ())  # type: ignore[index]
    return found


def _dtype_json(dtype: np.dtype) -> Any:
    """``dtype`` as JSON: its ``.str`` (``"<f4"``), or for a structured or sub-array dtype
    (whose ``.str`` is only ``"|V12"``) the object ``_dtype_from_json`` rebuilds it from."""
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return {"base": _dtype_json(base), "shape": list(shape)}
    if dtype.names is None:
        return dtype.str
    # (dtype, offset) or, for a field with a title, (dtype, offset, title).
    fields: list[tuple[Any, ...]] = [dtype.fields[name] for name in dtype.names]  # type: ignore[index]
    described: dict[str, Any] = {
        "names": list(dtype.names),
        "formats": [_dtype_json(f[0]) for f in fields],
        "offsets": [f[1] for f in fields],
        "itemsize": dtype.itemsize,
    }
    if any(len(f) > 2 for f in fields):
        described["titles"] = [f[2] if len(f) > 2 else None for f in fields]
    if dtype.isalignedstruct:
        described["aligned"] = True
    return described


_STRUCTURED_KEYS = {"names", "formats", "offsets", "itemsize", "titles", "aligned"}


def _dtype_from_json(described: Any, depth: int) -> np.dtype:
    """The dtype ``_dtype_json`` described; raises ``ValueError`` (or ``TypeError``) for
    anything it would not have written."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"a dtype nested more than {_MAX_DEPTH} levels deep")
    if type(described) is str:
        return np.dtype(described)  # NumPy parses the text itself; nothing is evaluated.
    if type(described) is not dict:
        raise TypeError(f"a dtype must be a string or an object, not {type(described).__name__}")
    if set(described) == {"base", "shape"}:
        shape = described["shape"]
        if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"bad sub-array shape {shape!r}")
        return np.dtype((_dtype_from_json(described["base"], depth + 1), tuple(shape)))
    formats = described["formats"]
    if type(formats) is not list or not set(described) <= _STRUCTURED_KEYS:
        raise ValueError(f"not a structured dtype ({sorted(described)})")
    spec: Any = {k: v for k, v in described.items() if k != "aligned"}
    spec["formats"] = [_dtype_from_json(f, depth + 1) for f in formats]
    dtype = np.dtype(spec, align=described.get("aligned") is True)
    # Only what _dtype_json writes (and so exactly the dtype that was saved).
    if _dtype_json(dtype) != described:
        raise ValueError("the structured dtype does not describe itself as stored")
    return dtype


def _decode(value: Any, where: str) -> Any:
    if type(value) is list:
        return [_decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) is not dict:
        return value
    if TAG not in value:
        return {k: _decode(v, f"{where}[{k!r}]") for k, v in value.items()}
    try:
        return _decode_tagged(value, where)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        # OverflowError: a NumPy scalar out of its dtype's range (int8 3000).
        raise StateDecodingError(f"{where} is a malformed {value.get(TAG)!r} value ({e})") from e


def _decode_tagged(value: dict[str, Any], where: str) -> Any:
    kind = value[TAG]
    if kind == "bytes":
        return base64.b64decode(value["base64"], validate=True)
    if kind == "tuple":
        return tuple(_decode(v, f"{where}[{i}]") for i, v in enumerate(value["items"]))
    if kind == "dict":
        return {_decode(k, where): _decode(v, f"{where}[{k!r}]") for k, v in value["items"]}
    if kind == "float":
        if value["value"] not in ("nan", "inf", "-inf"):
            raise ValueError(f"unknown float {value['value']!r}")
        return float(value["value"])
    if kind == "numpy":
        dtype = np.dtype(value["dtype"])
        number = _decode(value["value"], where)
        if dtype.kind not in "biuf" or type(number) not in (bool, int, float):
            # Only what _encode_numpy_scalar writes: np.void(10**12) would take 1 TB.
            raise ValueError(f"not a NumPy bool, integer or float ({dtype.str})")
        return dtype.type(number)
    if kind == "ndarray":
        dtype = _dtype_from_json(value["dtype"], 0)
        if dtype.hasobject:
            raise ValueError("object arrays are never loaded")
        # A writable bytearray, not .copy(): that copies a structured array's fields, not
        # the padding between them, which would then hold whatever memory held.
        data = bytearray(base64.b64decode(value["base64"], validate=True))
        array = np.frombuffer(data, dtype=dtype).reshape(value["shape"])
        return array[()] if value.get("scalar") else array
    raise StateDecodingError(
        f"{where} has the unknown tag {kind!r}; it was written by a newer checkpointables-grain. "
        f"Upgrade checkpointables-grain to load it."
    )
