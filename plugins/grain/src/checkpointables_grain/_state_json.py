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

Anything else (objects, sets, functions) is refused with an error naming
where in the state it sits.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

__all__ = ["TAG", "dumps", "loads", "StateEncodingError", "StateDecodingError"]

TAG = "__checkpointables__"
_MAX_DEPTH = 200


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
    if value is None or isinstance(value, bool | str):
        return value
    if type(value) is int:
        return value
    if type(value) is float:
        return value if math.isfinite(value) else _tagged("float", value=repr(value))
    if isinstance(value, bytes | bytearray):
        return _tagged("bytes", base64=base64.b64encode(bytes(value)).decode("ascii"))
    if isinstance(value, np.ndarray):
        return _encode_array(value, where)
    if isinstance(value, np.generic):
        return _encode_numpy_scalar(value, where)
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
                    _encode(k, f"{where} key {k!r}", depth + 1),
                    _encode(v, f"{where}[{k!r}]", depth + 1),
                ]
                for k, v in value.items()
            ],
        )
    raise StateEncodingError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which cannot be "
        f"stored as JSON. Iterator states may hold dicts, lists, tuples, str, int, float, bool, "
        f"None, bytes and NumPy numbers or arrays; make get_state() return those."
    )


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
    fields: dict[str, Any] = {
        "dtype": value.dtype.str,
        "shape": list(value.shape),
        "base64": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode("ascii"),
    }
    if scalar:
        fields["scalar"] = True
    return _tagged("ndarray", **fields)


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
        dtype = np.dtype(value["dtype"])
        if dtype.hasobject:
            raise ValueError("object arrays are never loaded")
        data = base64.b64decode(value["base64"], validate=True)
        array = np.frombuffer(data, dtype=dtype).reshape(value["shape"]).copy()
        return array[()] if value.get("scalar") else array
    raise StateDecodingError(
        f"{where} has the unknown tag {kind!r}; it was written by a newer checkpointables-grain. "
        f"Upgrade checkpointables-grain to load it."
    )
