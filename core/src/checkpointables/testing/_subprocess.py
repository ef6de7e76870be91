"""Loading a checkpoint in a fresh interpreter with some plugins disabled."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable

from etils import epath

_LOAD = """
import sys
import checkpointables as cp
try:
    cp.load_checkpointables(sys.argv[1])
except cp.errors.MissingHandlerError as e:
    print(e)
else:
    print("LOADED")
"""


def missing_handler_message(path: epath.PathLike, disabled_plugins: Iterable[str]) -> str:
    """Loads ``path`` with the named entry points disabled; returns the error message.

    Runs in a subprocess, since discovery reads ``CHECKPOINTABLES_DISABLE_PLUGINS``
    once per process. Returns the ``MissingHandlerError`` text, or ``"LOADED"``
    if loading succeeded.

    Example::

        message = missing_handler_message(path, ["point"])
        assert "pip install my-point-plugin" in message
    """
    env = {**os.environ, "CHECKPOINTABLES_DISABLE_PLUGINS": ",".join(disabled_plugins)}
    result = subprocess.run(
        [sys.executable, "-c", _LOAD, os.fspath(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"loading {path} crashed:\n{result.stderr[-4000:]}")
    return result.stdout.strip()
