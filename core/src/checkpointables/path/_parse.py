"""User paths as ``Path``s, with a library error for what cannot be one."""

from __future__ import annotations

from etils import epath

from checkpointables import errors


def as_path(path: epath.PathLike) -> epath.Path:
    """``path`` as a ``cp.path.Path`` (an ``etils.epath.Path``).

    Example::

        cp.path.as_path("/tmp/ckpt/100")       # a local path
        cp.path.as_path("memory://x")          # raises cp.errors.UnsupportedPathError

    Raises:
      cp.errors.UnsupportedPathError: the path names a scheme (``memory://``,
        ``ftp://``, ``file://``...) that no storage here reaches.
    """
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
