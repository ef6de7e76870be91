"""Parsing JSON read from a checkpoint, which may be damaged or hostile.

Every failure becomes a ``cp.errors.MetadataError`` naming the file: bytes
that are not UTF-8 (a bit flip, a pickle written in its place), text that is
not JSON, and nesting deeper than the interpreter can parse (the parser's
``RecursionError``, which unwinds cleanly). Nothing is evaluated or imported.
Messages give the position of a problem, never the file's bytes.

Values a caller gives at save time (custom metadata, metrics) go the other
way: ``to_json_value`` turns NumPy and JAX scalars into Python numbers and
names the key path of anything JSON cannot store.

Example::

    document = cp.safe_json.loads_object(raw_bytes, source=path)
    ready = cp.safe_json.to_json_value({"lr": np.float32(0.1)}, what="custom_metadata")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from checkpointables import errors

__all__ = ["loads", "loads_object", "dumps_checked", "to_json_value"]

_ADVICE = "The file is damaged; restore the checkpoint from a copy, or load an older one."


def _damaged(source: object, problem: str) -> errors.MetadataError:
    return errors.MetadataError(f"{source} {problem}. {_ADVICE}")


def loads(data: bytes | str, *, source: object) -> Any:
    """The JSON value in ``data`` (UTF-8 bytes or text) read from ``source`` (named in errors).

    Raises:
      cp.errors.MetadataError: ``data`` is not UTF-8, not JSON, or nested too deeply.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _damaged(
                source, f"is not UTF-8 text (byte {e.start} cannot be decoded)"
            ) from None
    else:
        text = data
    try:
        return json.loads(text)
    except RecursionError:
        raise _damaged(source, "holds JSON nested too deeply to parse") from None
    except ValueError as e:  # JSONDecodeError; the message holds a position, not the text.
        raise _damaged(source, f"is not valid JSON ({e})") from None


def loads_object(data: bytes | str, *, source: object) -> dict[str, Any]:
    """Like ``loads``, and the value must be a JSON object.

    Raises:
      cp.errors.MetadataError: as ``loads``, or the value is not an object.
    """
    value = loads(data, source=source)
    if not isinstance(value, dict):
        raise _damaged(source, f"holds a JSON {type(value).__name__}, expected an object")
    return value


def dumps_checked(value: Any, *, what: str) -> str:
    """``json.dumps(to_json_value(value, what=what))``: the JSON text of a caller's value.

    For values given by the caller at save time (custom metadata, metrics): what
    cannot be written must fail before anything is written.

    Raises:
      cp.errors.InvalidArgumentError: as ``to_json_value``.
    """
    return json.dumps(to_json_value(value, what=what))


def to_json_value(
    value: Any, *, what: str, one_element_arrays: bool = False, string_keys: bool = False
) -> Any:
    """A copy of ``value`` that ``json.dumps`` writes, NumPy and JAX scalars made Python's.

    Dicts (any mapping), lists and tuples are copied; ``None``, bools, ints,
    floats and strings kept (NaN and infinities too: Python's JSON writes
    them); NumPy scalars (``np.float32(0.1)``) and 0-d NumPy or JAX arrays (a
    ``jnp`` loss) become the Python number they hold, as ``.item()`` gives it
    (converting a device value waits for its computation).
    ``one_element_arrays``: arrays of shape ``(1,)`` too. ``string_keys``:
    refuse keys that are not strings (``None``, numbers), which JSON would
    give back as strings (``{1: x}`` loads as ``{"1": x}``).

    Example::

        to_json_value({"lr": np.float32(0.5)}, what="custom_metadata")  # {"lr": 0.5}

    Raises:
      cp.errors.InvalidArgumentError: something else (an array, an object, a
        key JSON cannot hold), naming its key path from ``what``
        (``custom_metadata['cfg']['lr']``) and what to do; or nesting too deep.
    """
    try:
        return _converted(value, what, _Choices(one_element_arrays, string_keys))
    except RecursionError:
        raise errors.InvalidArgumentError(
            f"{what} is nested too deeply (or refers to itself) to be stored as JSON; flatten it."
        ) from None


def _not_json(where: str, problem: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(
        f"{where} {problem}, which JSON cannot store: what is saved as JSON must be "
        f"JSON-serializable, numbers, strings, booleans, None, or dicts/lists of them (NumPy "
        f"and JAX scalars are converted). Convert it first, e.g. float(x), x.tolist() or str(x)."
    )


def _key_checked(key: Any, where: str, string_keys: bool) -> Any:
    if isinstance(key, str):
        return key
    if string_keys and (key is None or isinstance(key, int | float)):
        raise errors.InvalidArgumentError(
            f"{where} has the key {key!r} ({type(key).__name__}); its keys must be strings, "
            f"as JSON gives every key back as one. Name it with a string, e.g. {str(key)!r}."
        )
    if not (key is None or isinstance(key, int | float)):
        raise _not_json(where, f"has the key {key!r} ({type(key).__name__})")
    return key


class _Choices(NamedTuple):
    """What ``to_json_value`` was asked to take, passed down its recursion as one."""

    one_element_arrays: bool
    string_keys: bool


def _converted(value: Any, where: str, choices: _Choices) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return float(value)  # np.float64 is a float subclass: store a plain float.
    if isinstance(value, Mapping):
        result = {}
        for key, inner in value.items():
            key = _key_checked(key, where, choices.string_keys)
            result[key] = _converted(inner, f"{where}[{key!r}]", choices)
        return result
    if isinstance(value, list | tuple):
        return [_converted(v, f"{where}[{i}]", choices) for i, v in enumerate(value)]
    shape = getattr(value, "shape", None)
    item = getattr(value, "item", None)
    scalar_shapes = ((), (1,)) if choices.one_element_arrays else ((),)
    if callable(item) and isinstance(shape, tuple) and shape in scalar_shapes:
        held = item()
        if held is None or isinstance(held, bool | int | float | str):
            return held
    kind = type(value).__name__
    if isinstance(shape, tuple) and shape:
        kind = f"{kind} of shape {shape}"
    raise _not_json(where, f"is {'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}")
