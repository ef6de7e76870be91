"""Progress of long command-line operations: bytes done, the total and the rate.

The ``checkpointables`` command shows a progress bar on stderr for
``verify``, ``inspect`` and plugin commands such as ``export`` and
``import``, when stderr is a terminal, ``--quiet`` was not given and `tqdm
<https://tqdm.github.io>`_ is installed (``pip install checkpointables``
brings it; ``checkpointables-core`` alone shows no bars). Nothing is printed
otherwise, so logs and pipes stay clean. The bar appears only for operations
that last more than half a second.

A command (or a plugin's command) opens the bar; the code doing the work,
possibly on other threads or deep inside a handler, reports into it::

    with cp.progress.bytes_progress(total_bytes, "export"):
        for array in arrays:
            write(array)
            cp.progress.advance(array.nbytes)

``advance`` does nothing when no bar is open, so handlers may call it
unconditionally (the pytree plugin's ``verify`` does).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["bytes_progress", "advance", "enabled", "set_enabled"]

# Bars appear only for operations that last longer than this (seconds).
DELAY_SECS = 0.5

_lock = threading.Lock()
_bar: Any = None  # The open bar (a tqdm instance), if any; one at a time.
_enabled = True


def enabled() -> bool:
    """Whether bars may be shown (``False`` after ``--quiet``)."""
    return _enabled


def set_enabled(value: bool) -> None:
    """Allows or forbids bars for the rest of the process (the CLI's ``--quiet``)."""
    global _enabled
    _enabled = bool(value)


def _new_bar(total: int | None, description: str) -> Any:
    if not _enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # An optional dependency: no bars without it.
        return None
    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        delay=DELAY_SECS,
        dynamic_ncols=True,
    )


@contextlib.contextmanager
def bytes_progress(total: int | None, description: str) -> Iterator[None]:
    """Shows a bar of ``total`` bytes while the block runs (if bars are shown at all).

    ``total`` may be ``None`` when unknown (the bar then counts bytes and the
    rate only). Bars do not nest: inside an open bar this opens none.
    """
    global _bar
    with _lock:
        bar = None if _bar is not None else _new_bar(total, description)
        if bar is not None:
            _bar = bar
    try:
        yield
    finally:
        if bar is not None:
            with _lock:
                _bar = None
            bar.close()


def advance(nbytes: int) -> None:
    """Adds ``nbytes`` to the open bar; does nothing when none is open. Thread-safe."""
    if _bar is None:
        return
    with _lock:
        if _bar is not None:
            _bar.update(nbytes)
