"""Which data files a load opens from Python (TensorStore opens its files natively).

Only the direct read paths (``_value_files``, ``_local_values``) show up here,
so a test can tell that they were taken.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import checkpointables as cp

_opened: list[str] = []
_recording = threading.Event()


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _recording.is_set() and isinstance(args[0], str):
        _opened.append(args[0])


sys.addaudithook(_audit)


def load_recording_opens(path: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """``cp.load_pytree(path, ...)``, and the data files of ``path`` it opened, in order."""
    _opened.clear()
    _recording.set()
    try:
        loaded = cp.load_pytree(path, *args, **kwargs)
    finally:
        _recording.clear()
    data = os.path.join(os.fspath(path), "pytree", "d")
    return loaded, [p for p in _opened if os.path.dirname(p) == data]
