"""Local disks: what killed and racing saves leave, and what loads racing an overwrite see."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import checkpointables as cp
import numpy as np
import pytest

from ..python_subprocess import wait_for_file
from ..races import load_while_overwriting
from .helpers import Gate
from .test_crash import _SCRIPT


def _kill_mid_save(path, started) -> None:
    """Runs a save of ``path`` with overwrite=True in another process, killed mid-way."""
    with subprocess.Popen([sys.executable, "-c", _SCRIPT, str(path), str(started)]) as proc:
        try:
            wait_for_file(proc, started)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(30)
    started.unlink()


def test_killed_overwrites_leave_temporaries_the_next_save_removes(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.save_checkpointables(path, {"extra": {"v": 1}})
    started = tmp_path.parent / f"{tmp_path.name}-started"

    def temporaries() -> set[str]:
        return {n for n in os.listdir(tmp_path) if cp.layout.is_temporary_path(tmp_path / n)}

    _kill_mid_save(path, started)
    first = temporaries()
    assert len(first) == 1
    _kill_mid_save(path, started)  # This save removed the first one's directory.
    assert len(temporaries()) == 1 and not first & temporaries()
    # A save in progress in this process (a live pid) must survive the cleanup.
    live = cp.layout.temporary_path_for(tmp_path / "other")
    live.mkdir()
    # The next save into the same directory removes what the dead saves left.
    cp.save_checkpointables(tmp_path / "next", {"extra": {"v": 3}})
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", "next", live.name])
    assert cp.load_checkpointables(path) == {"extra": {"v": 1}}  # The old one is intact.


def test_loads_racing_overwrites_return_one_checkpoint_whole_or_say_it_changed(tmp_path) -> None:
    versions = [{f"leaf{i}": np.full(100, v) for i in range(40)} | {"n": v} for v in range(2)]
    outcomes = load_while_overwriting(tmp_path / "ckpt", versions, 30)
    assert "whole" in outcomes
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt"]


def test_a_checkpoint_in_a_deleted_ones_inode_is_told_from_it(tmp_path) -> None:
    # ext4 gives the next directory made the inode of one just deleted: a load that opened
    # the first (and so a check that nothing replaced it) must not take the second for it.
    from checkpointables import _commit

    path = tmp_path / "ckpt"
    for _ in range(20):
        cp.save_pytree(path, {"n": 1}, overwrite=True)
        inode, opened = path.stat().st_ino, _commit.identity(path)
        cp.save_pytree(path, {"n": 2}, overwrite=True)  # Frees the first one's inode,
        cp.save_pytree(path, {"n": 3}, overwrite=True)  # which this one may get.
        if path.stat().st_ino == inode:
            assert _commit.identity(path) != opened
            return
    pytest.skip("this file system gave no inode back within 20 tries")


def test_racing_saves_name_no_directory_that_does_not_exist(tmp_path, misbehaving_handlers) -> None:
    path = tmp_path / "ckpt"
    gate = Gate()
    response = cp.save_checkpointables_async(path, {"g": gate})
    assert gate.started.wait(30)
    path.mkdir()  # Another writer gets there first.
    gate.release.set()
    with pytest.raises(FileExistsError) as raised:
        response.result()
    for named in re.findall(re.escape(str(tmp_path)) + r"[^\s,;)]*", str(raised.value)):
        assert os.path.exists(named.rstrip(".")), f"the message names {named}, which is gone"
    assert os.listdir(tmp_path) == ["ckpt"]


def test_overwrite_through_a_symbolic_link_replaces_its_target(tmp_path) -> None:
    cp.save_pytree(tmp_path / "100", {"step": 100})
    (tmp_path / "latest").symlink_to(tmp_path / "100")
    cp.save_pytree(tmp_path / "latest", {"step": 101}, overwrite=True)
    assert os.readlink(tmp_path / "latest") == str(tmp_path / "100")  # Still the same link.
    assert cp.load_pytree(tmp_path / "100") == {"step": 101}
    assert sorted(os.listdir(tmp_path)) == ["100", "latest"]
    with pytest.raises(FileExistsError):
        cp.save_pytree(tmp_path / "latest", {"step": 102})
