"""User paths as ``Path``s, with a library error for what cannot be one.

TensorStore's file driver refuses paths with ``..`` components ("Invalid file
path"), which users write naturally (``../runs/7``). Such a local path is
resolved as the operating system would resolve it (``os.path.realpath``:
symbolic links first, then ``..``); any other path is left as given, so
messages show what the user wrote.
"""

from __future__ import annotations

import os

from etils import epath

from checkpointables import errors


def as_path(path: epath.PathLike) -> epath.Path:
    """``path`` as a ``cp.path.Path`` (an ``etils.epath.Path``).

    Example::

        cp.path.as_path("/tmp/ckpt/100")       # a local path
        cp.path.as_path("memory://x")          # raises cp.errors.UnsupportedPathError

    Raises:
      cp.errors.InvalidArgumentTypeError: ``path`` is not a str or path-like object.
      cp.errors.UnsupportedPathError: the path names a scheme (``memory://``,
        ``ftp://``, ``file://``...) that no storage here reaches.
    """
    try:
        text = os.fspath(path)
    except TypeError:
        raise errors.InvalidArgumentTypeError(
            f"A checkpoint path must be a str or a path-like object, got {type(path).__name__}."
        ) from None
    if "://" not in text and ".." in text.split(os.sep):
        return epath.Path(os.path.realpath(text))
    if isinstance(path, epath.Path):
        return path
    try:
        return epath.Path(path)
    except KeyError:
        text = str(path)
        scheme = text.split("://", 1)[0] + "://" if "://" in text else text
        raise errors.UnsupportedPathError(
            f"Cannot use {text!r} as a checkpoint path: no storage for {scheme} is available. "
            "Use a local path (for file:// URLs, the path without the scheme), or a gs:// or "
            "s3:// URL."
        ) from None
