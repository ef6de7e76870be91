"""Running Python in a fresh interpreter: for tests of what a new process sees.

Plugin discovery, lazy imports and ``CHECKPOINTABLES_DISABLE_PLUGINS`` are
read once per process, so such tests start their own.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap
import time


def install_fake_distribution(root, name: str, module_source: str) -> dict[str, str]:
    """Writes plugin module ``name`` (``-`` read as ``_``) of ``module_source`` and a
    ``.dist-info`` whose entry point (group ``checkpointables``) names it, into ``root``.

    Returns an environment with ``root`` on ``PYTHONPATH``: a process started with it
    discovers the plugin exactly as an installed distribution's, version 0.3.
    """
    module = name.replace("-", "_")
    (root / f"{module}.py").write_text(textwrap.dedent(module_source))
    info = root / f"{module}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[checkpointables]\n{name} = {module}\n")
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


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


def run_on_terminal(*args: str) -> str:
    """Runs ``checkpointables *args`` with stderr on a pseudo-terminal; returns what it shows.

    Progress bars are shown at once (no delay). Fails unless the command exits 0.
    """
    code = (
        "import sys, checkpointables as cp; from checkpointables import cli; "
        "cp.progress.DELAY_SECS = 0; sys.exit(cli.main(sys.argv[1:]))"
    )
    leader, follower = pty.openpty()
    # A new pseudo-terminal is 0 columns wide; give it a usual width.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    chunks = []
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=follower
        )
        os.close(follower)  # Reading ends (EIO) once the child's copy closes too.
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        returncode = process.wait(timeout=120)
    finally:
        os.close(leader)
    shown = b"".join(chunks).decode(errors="replace")
    assert returncode == 0, shown
    return shown


def wait_for_file(proc: subprocess.Popen, path, seconds: float = 60) -> None:
    """Waits until ``proc`` created ``path`` (its signal that it got where a test wants it);
    fails if ``proc`` exits first or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None, f"the process ended (code {proc.returncode}) before {path}"
        assert time.monotonic() < deadline, f"no {path} after {seconds} s"
        time.sleep(0.02)


def run_command(*args: str, seconds: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m checkpointables <args>`` (the command line a user types)."""
    return subprocess.run(
        [sys.executable, "-m", "checkpointables", *args],
        capture_output=True,
        text=True,
        timeout=seconds,
        check=False,
    )


def assert_verifies(path) -> None:
    """Fails unless ``checkpointables verify <path>`` passes."""
    done = run_command("verify", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
