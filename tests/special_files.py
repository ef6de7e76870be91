"""Named pipes, links to them and directories where a checkpoint has a file; calls bounded in time.

Opening a named pipe (FIFO) for reading waits until something opens it for
writing, so a library that opens one without care blocks forever. ``bounded``
runs a call in a thread and, if it has not returned in time, opens every pipe
under the checkpoint for writing and closes it again: the blocked reader then
reads an end of file and returns, the test fails, and no thread is left
hanging.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

KINDS = ("fifo", "link to fifo", "directory")


def replace_with(path, kind: str) -> None:
    """Replaces the file at ``path`` by a ``kind`` (one of ``KINDS``) of the same name."""
    path = os.fspath(path)
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to fifo":
        target = f"{path}.pipe"
        os.mkfifo(target)
        os.symlink(os.path.basename(target), path)  # Relative: stays inside the checkpoint.
    elif kind == "directory":
        os.mkdir(path)
    else:
        raise ValueError(kind)


def release_pipes(root) -> None:
    """Gives every blocked reader of a pipe under ``root`` an end of file."""
    for directory, _, names in os.walk(os.fspath(root)):
        for name in names:
            path = os.path.join(directory, name)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO if nobody reads it.
            except OSError:
                continue
            os.close(fd)


def bounded(call: Callable[[], Any], root, seconds: float = 20) -> tuple[float, Any]:
    """``(seconds taken, call's result or exception)``; fails the test if ``call`` blocks.

    A call still running after ``seconds`` has its pipes under ``root``
    released (see the module's docstring) and fails with ``AssertionError``.
    """
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as e:  # Returned to the test, which judges it.
            outcome.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        while thread.is_alive():
            release_pipes(root)
            thread.join(0.5)
        raise AssertionError(f"the call blocked for more than {seconds} s on a pipe under {root}")
    return time.monotonic() - start, outcome[0]


def copy(source, target):
    """A copy of the checkpoint ``source`` at ``target`` (returns ``target``)."""
    shutil.copytree(source, target, symlinks=True)
    return target
