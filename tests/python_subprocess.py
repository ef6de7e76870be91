"""Running Python in a fresh interpreter: for tests of what a new process sees.

Plugin discovery, lazy imports and ``CHECKPOINTABLES_DISABLE_PLUGINS`` are
read once per process, so such tests start their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` (dedented) with ``args`` in a new interpreter, with ``env`` added.

    Returns the finished process, with its output as text; bounded to two minutes.
    """
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
