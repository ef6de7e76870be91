"""Local disks: what killed and racing saves leave, and what loads racing an overwrite see."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _leftovers
from etils import epath
from hypothesis import given, settings
from hypothesis import strategies as st

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


# A save that writes until its parent creates argv[3], with AsyncOptions.timeout_secs of
# argv[4], on the host named argv[5] (another host sharing the storage, where it is not "-").
_SLOW_SAVE = textwrap.dedent(
    """
    import os, socket, sys, time
    if sys.argv[5] != "-":
        socket.gethostname = lambda: sys.argv[5]  # What a save on that host writes.
    import checkpointables as cp

    class Slow:
        async def save(self, directory):
            async def write():
                path = await directory.await_creation()
                open(sys.argv[2], "w").close()   # Tell the parent we are mid-save.
                while not os.path.exists(sys.argv[3]):
                    time.sleep(0.01)
                (path / "data.txt").write_text("x")
            return write()
        async def load(self, directory):
            return None

    timeout = cp.options.AsyncOptions(timeout_secs=float(sys.argv[4]))
    with cp.Context(async_options=timeout):
        cp.save_checkpointables(sys.argv[1], {"slow": Slow(), "extra": {"v": 2}})
    """
)
_TIMEOUT = 0.5  # Seconds: a save beats every eighth of a second.


def _cleanup_by_another_process(directory) -> None:
    """What a save into ``directory`` and a new Checkpointer of it delete, with the timeout."""
    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=_TIMEOUT)):
        cp.save_checkpointables(directory / "2", {"extra": {"v": 1}}, overwrite=True)
        with cp.training.Checkpointer(directory):
            pass  # Its cleanup runs in the background, and ends before it closes.


def _temporaries(directory) -> list[str]:
    return [n for n in os.listdir(directory) if cp.layout.is_temporary_path(n)]


@pytest.mark.parametrize("host", ["-", "elsewhere"])
def test_a_save_running_past_the_timeout_is_kept_while_its_heartbeat_is_fresh(
    tmp_path, host
) -> None:
    root, started, release = tmp_path / "root", tmp_path / "started", tmp_path / "release"
    root.mkdir()
    args = [str(root / "1"), str(started), str(release), str(_TIMEOUT), host]
    with subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, *args]) as proc:
        try:
            wait_for_file(proc, started)
            time.sleep(2 * _TIMEOUT)  # Older than the timeout, still writing.
            _cleanup_by_another_process(root)
            assert len(_temporaries(root)) == 1
            if host == "-":  # Still writing: it commits.
                release.touch()
                assert proc.wait(30) == 0
                assert cp.is_checkpoint(root / "1") and not _temporaries(root)
                return
        finally:
            proc.kill()  # If it still runs.
            proc.wait(30)
    # Killed on another host: its pid proves nothing here, its heartbeat stops.
    assert not _leftovers.abandoned_entries([root], timeout_secs=_TIMEOUT)
    time.sleep(1.5 * _TIMEOUT)
    _cleanup_by_another_process(root)
    assert _temporaries(root) == [] and "1" not in os.listdir(root)


def test_a_killed_save_on_this_host_is_removed_at_once(tmp_path) -> None:
    root, started = tmp_path / "root", tmp_path / "started"
    root.mkdir()
    args = [str(root / "1"), str(started), str(tmp_path / "never"), "1200", "-"]
    with subprocess.Popen([sys.executable, "-c", _SLOW_SAVE, *args]) as proc:
        try:
            wait_for_file(proc, started)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(30)
    assert len(_temporaries(root)) == 1
    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=1200)):
        cp.save_checkpointables(root / "2", {"extra": {"v": 1}})
    assert _temporaries(root) == []


@settings(max_examples=20, deadline=None)
@given(
    entries=st.lists(
        st.tuples(
            st.integers(-10, 10**4),  # The heartbeat's age, in seconds.
            st.booleans(),  # Made on another host.
            st.sampled_from(["tmp", "old"]),
        ),
        max_size=5,
    ),
    timeout=st.floats(0.001, 2000),
)
def test_nothing_committed_is_ever_removed(entries, timeout) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = epath.Path(directory)
        cp.save_checkpointables(root / "0", {"extra": {"v": 0}})
        now = time.time_ns()
        for i, (age, foreign, infix) in enumerate(entries):
            tag = cp.layout.host_tag("elsewhere" if foreign else None)
            name = f"{i}.checkpointables-{infix}-{now - 10**13}-{_dead_pid()}-{tag}ab12"
            (root / name).mkdir()
            os.utime(root / name, ns=(now - age * 10**9,) * 2)
        found = _leftovers.abandoned_entries([root], timeout_secs=timeout)
        _leftovers.remove(found)
        assert cp.load_checkpointables(root / "0") == {"extra": {"v": 0}}
        for i, (age, foreign, _) in enumerate(entries):
            kept = foreign and age <= timeout  # Another host's, heartbeat fresh.
            assert any(n.startswith(f"{i}.") for n in os.listdir(root)) == kept


@functools.cache
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_step_renamed_aside_for_deletion_is_fresh_by_its_name(tmp_path) -> None:
    # Its directory keeps the time of its save; the deletion that renamed it is still running.
    from checkpointables import _commit

    cp.save_checkpointables(tmp_path / "1", {"extra": {"v": 1}})
    old = time.time_ns() - 10**12
    os.utime(tmp_path / "1", ns=(old, old))
    retired = _commit.retire(tmp_path / "1")
    assert retired is not None and os.path.exists(retired.path)
    assert not _leftovers.abandoned_entries([tmp_path], timeout_secs=60)
    retired.remove()
