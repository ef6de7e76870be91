"""A save killed with SIGKILL never leaves a checkpoint behind or damages an old one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import checkpointables as cp
import pytest

from ..python_subprocess import wait_for_file

_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import checkpointables as cp

    class Slow:
        async def save(self, directory):
            async def write():
                path = await directory.await_creation()
                (path / "big.txt").write_text("x" * 1000)
                open(sys.argv[2], "w").close()   # Tell the parent we are mid-save.
                time.sleep(60)
            return write()
        async def load(self, directory):
            return None

    cp.save_checkpointables(sys.argv[1], {"slow": Slow(), "extra": {"v": 2}}, overwrite=True)
    """
)


@pytest.mark.parametrize("existing", [False, True])
def test_sigkill_mid_save(tmp_path, existing) -> None:
    path = tmp_path / "ckpt"
    if existing:
        cp.save_checkpointables(path, {"extra": {"v": 1}})
    started = tmp_path.parent / f"{tmp_path.name}-started"
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(path), str(started)])
    try:
        wait_for_file(proc, started)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    leftovers = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert all(cp.layout.is_temporary_path(tmp_path / n) for n in leftovers)
    assert not any(cp.is_checkpoint(tmp_path / n) for n in leftovers)
    if existing:
        assert cp.load_checkpointables(path) == {"extra": {"v": 1}}
    else:
        assert not path.exists() and not cp.is_checkpoint(path)
