"""Loading a checkpoint in a fresh interpreter with some plugins missing or disabled."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable

from etils import epath

_LOAD = """
import sys
import checkpointables as cp
from checkpointables import plugins

# The entry points named in argv[2] are hidden, as if their distributions were not installed.
hidden = set(filter(None, sys.argv[2].split(",")))
installed = plugins._entry_points
plugins._entry_points = lambda: [ep for ep in installed() if ep.name not in hidden]
try:
    cp.load_checkpointables(sys.argv[1])
except cp.errors.MissingHandlerError as e:
    print(e)
else:
    print("LOADED")
"""


def missing_handler_message(
    path: epath.PathLike, disabled_plugins: Iterable[str], *, how: str = "uninstalled"
) -> str:
    """Loads ``path`` without the named entry points; returns the error message.

    ``how="uninstalled"`` hides them as if their distributions were not
    installed; ``how="disabled"`` blocks them with ``CHECKPOINTABLES_DISABLE_PLUGINS``
    (the message then says so instead of what to install). Runs in a
    subprocess, since discovery happens once per process. Returns the
    ``MissingHandlerError`` text, or ``"LOADED"`` if loading succeeded.

    Example::

        message = missing_handler_message(path, ["point"])
        assert "pip install my-point-plugin" in message
    """
    if how not in ("uninstalled", "disabled"):
        raise ValueError(f"how must be 'uninstalled' or 'disabled', got {how!r}.")
    names = ",".join(disabled_plugins)
    env = {**os.environ, "CHECKPOINTABLES_DISABLE_PLUGINS": names if how == "disabled" else ""}
    result = subprocess.run(
        [sys.executable, "-c", _LOAD, os.fspath(path), "" if how == "disabled" else names],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"loading {path} crashed:\n{result.stderr[-4000:]}")
    return result.stdout.strip()
