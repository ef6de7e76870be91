"""Parsing JSON read from a checkpoint, which may be damaged or hostile.

Every failure becomes a ``cp.errors.MetadataError`` naming the file: bytes
that are not UTF-8 (a bit flip, a pickle written in its place), text that is
not JSON, and nesting deeper than the interpreter can parse (the parser's
``RecursionError``, which unwinds cleanly). Nothing is evaluated or imported.
Messages give the position of a problem, never the file's bytes.

Example::

    document = cp.safe_json.loads_object(raw_bytes, source=path)
"""

from __future__ import annotations

import json
from typing import Any

from checkpointables import errors

__all__ = ["loads", "loads_object", "dumps_checked"]

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
    """``json.dumps(value)``, or an ``InvalidArgumentError`` saying why ``value`` is not JSON.

    For values given by the caller at save time (custom metadata, metrics): what
    cannot be written must fail before anything is written.
    """
    try:
        return json.dumps(value)
    except RecursionError:
        raise errors.InvalidArgumentError(
            f"{what} is nested too deeply (or refers to itself) to be stored as JSON; flatten it."
        ) from None
    except (TypeError, ValueError) as e:
        raise errors.InvalidArgumentError(
            f"{what} must be JSON-serializable ({e}); convert arrays and objects to numbers, "
            f"strings, lists or dicts."
        ) from None
