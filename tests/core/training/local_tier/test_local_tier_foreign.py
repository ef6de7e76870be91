"""The local tier against what it did not write: a directory holding checkpoints (a
Checkpointer root, free-function checkpoints) or a user's files is refused; what appears
in its directory later (a checkpoint, a stray file, a link, a loop) is never removed nor
followed; a named pipe, a device or a huge sparse file in place of a manifest, a copy's
file, the record or the lock never hangs, never fills memory, and never gives a raw
OSError."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkpointables as cp
import numpy as np
import pytest
from checkpointables.training.local_tier._owner import LOCK_FILE, OWNER_FILE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_local_tier import checkpointer, run

EveryN = cp.training.save_decision_policies.EveryNStepsPolicy


def within(seconds: float, call: Callable[[], Any], pipes: list[Path] = ()) -> Any:
    """``call()``, which must return within ``seconds``; if it hangs (reading one of the
    named ``pipes``), the pipes get a writer and a reader so that its thread ends, and the
    test fails."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = call()
        except BaseException as e:  # Raised in the test's thread.
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for pipe in pipes:  # Releases an open() waiting for the other end.
            with contextlib.suppress(OSError):
                os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
            with contextlib.suppress(OSError):
                os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"{call} did not return within {seconds} s (it waits on a named pipe)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def snapshot(directory: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under ``directory`` (links not followed): its mode, and a file's bytes."""
    found = {}
    for parent, dirs, names in os.walk(directory):
        for name in dirs + names:
            path = os.path.join(parent, name)
            st_ = os.lstat(path)
            data = (
                Path(path).read_bytes()
                if os.path.isfile(path) and not os.path.islink(path)
                else None
            )
            found[os.path.relpath(path, directory)] = (st_.st_mode, data)
    return found


def tier(tmp_path: Path, local: Path, *, keep: int = 1) -> cp.training.Checkpointer:
    return cp.training.Checkpointer(
        tmp_path / "persistent",
        save_decision_policy=EveryN(1000),
        local_tier=cp.training.LocalTier(
            local, save_decision_policy=EveryN(10), keep=keep, replicas=0
        ),
    )


def w(restored) -> float:
    return float(np.asarray(restored["w"]).ravel()[0])


# 1. A directory that holds what the tier did not write is never taken over.


def test_a_checkpoint_root_is_refused_and_keeps_its_steps(tmp_path) -> None:
    root = tmp_path / "exp1"
    with cp.training.Checkpointer(root) as ckptr:
        for step in range(3):
            ckptr.save_pytree(step, {"w": np.full(4, step, np.float32)})
    before = snapshot(root)
    with pytest.raises(cp.errors.InvalidArgumentError) as raised:
        tier(tmp_path, root)
    message = str(raised.value)
    assert str(root) in message and "0 (a committed checkpoint)" in message
    assert "empty or dedicated directory" in message
    assert snapshot(root) == before  # No record, no lock, no step removed.
    assert [s.step for s in cp.training.Checkpointer(root).steps()] == [0, 1, 2]


@pytest.mark.parametrize("what", ["free-function checkpoint", "user file", "step with a file"])
def test_a_directory_of_other_files_is_refused(tmp_path, what) -> None:
    local = tmp_path / "local"
    local.mkdir()
    if what == "free-function checkpoint":
        cp.save_pytree(local / "5", {"w": np.ones(3)})
        expected = "5 (a committed checkpoint)"
    elif what == "user file":
        (local / "notes.txt").write_text("mine")
        expected = "notes.txt"
    else:
        (local / "7").mkdir()
        (local / "7" / "results.csv").write_text("1,2")
        expected = "7 (a directory holding results.csv)"
    before = snapshot(local)
    with pytest.raises(cp.errors.InvalidArgumentError, match="did not write") as raised:
        tier(tmp_path, local)
    assert expected in str(raised.value) and str(local) in str(raised.value)
    assert snapshot(local) == before


def test_an_empty_or_own_directory_is_taken(tmp_path) -> None:
    local = tmp_path / "local"
    (local / "lost+found").mkdir(parents=True)  # A file system's own: not refused.
    with tier(tmp_path, local) as ckptr:
        ckptr.save_pytree(10, {"w": np.full(4, 10.0)})
    (local / OWNER_FILE).unlink()  # Its own steps, without a record: adopted.
    with tier(tmp_path, local) as ckptr:
        assert w(ckptr.load_pytree(10)) == 10 and ckptr.last_restore_stats.tier == "local"


@pytest.mark.parametrize("under", [False, True])
def test_a_directory_that_is_a_file_or_under_one_is_refused(tmp_path, under) -> None:
    blocking = tmp_path / "notes.txt"
    blocking.write_text("mine")
    local = blocking / "local" if under else blocking
    with pytest.raises(cp.storage.PathIsAFileError, match=r"notes.txt is a file") as raised:
        tier(tmp_path, local).__enter__()
    assert isinstance(raised.value, cp.errors.InvalidArgumentError)
    assert blocking.read_text() == "mine"


# 1 (defence in depth) and 4. What appears in the tier's own directory later is left alone.


def test_retention_never_removes_nor_follows_what_the_tier_did_not_write(tmp_path) -> None:
    local, outside = tmp_path / "local", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    with tier(tmp_path, local) as ckptr:
        ckptr.save_pytree(0, {"w": np.zeros(4)})
        # A link inside the tier's own step 0, which retention removes: the link goes, not
        # what it leads to.
        os.symlink(outside, local / "0" / "p0-of-1" / "link")
        cp.save_pytree(local / "3", {"w": np.ones(3)})  # A checkpoint saved there later.
        (local / "4").write_text("a stray file")
        os.symlink(outside, local / "5")  # A link out of the tier: never followed.
        os.symlink("999", local / "999")  # A loop.
        (local / "6").mkdir()
        (local / "6" / "p0-of-1").mkdir()
        (local / "6" / "mine.txt").write_text("user")  # Not only the tier's names.
        placed = {n: snapshot(local).get(n) for n in ("3", "4", "5", "999", "6")}
        outside_before = snapshot(outside)
        for step in (10, 20, 30):
            ckptr.save_pytree(step, {"w": np.full(4, float(step))})
        assert [s.step for s in ckptr.steps(tier="local")] == [30]
        assert w(ckptr.load_pytree()) == 30
        # A local save of a step held by something else is refused, naming it.
        (local / "40").mkdir()
        (local / "40" / "data").write_text("user")
        with pytest.raises(cp.errors.InvalidArgumentError, match="40 is a directory holding"):
            ckptr.save_pytree(40, {"w": np.zeros(4)})
    after = snapshot(local)
    assert {n: after.get(n) for n in placed} == placed
    assert (local / "3" / "_CHECKPOINT_METADATA").exists() and cp.is_checkpoint(local / "3")
    assert snapshot(outside) == outside_before and not (local / "0").exists()
    assert (local / "40" / "data").read_text() == "user"


def test_stray_entries_do_not_break_saves_and_listings(tmp_path) -> None:
    with checkpointer(tmp_path, persistent=1000, local=10, keep=2) as ckptr:
        run(ckptr, range(0, 11))
        local = tmp_path / "local"
        (local / "7").write_text("stray")
        os.symlink("999", local / "999")
        run(ckptr, range(11, 31))
        assert [s.step for s in ckptr.steps(tier="local")] == [20, 30]
        assert ckptr.latest_step().step == 30
        assert float(np.asarray(ckptr.load_pytree()["w"])[0, 0]) == 30
    assert (local / "7").read_text() == "stray" and os.readlink(local / "999") == "999"


@pytest.mark.parametrize("kind", ["directory", "named pipe", "symbolic link"])
def test_an_unusable_lock_file_is_a_documented_error(tmp_path, kind) -> None:
    local = tmp_path / "local"
    local.mkdir()
    lock = local / LOCK_FILE
    target = tmp_path / "elsewhere"
    {
        "directory": lambda: lock.mkdir(),
        "named pipe": lambda: os.mkfifo(lock),
        "symbolic link": lambda: os.symlink(target, lock),
    }[kind]()
    with pytest.raises(cp.errors.InvalidArgumentError, match="lock file .*remove what is there"):
        within(10, lambda: tier(tmp_path, local), [lock])
    assert not target.exists()  # A link is not followed (nor its target created).


# 2 and 3. Pipes, devices and sparse files in place of what the tier reads.


def saved(tmp_path) -> Path:
    """Local steps 0 and 10 (and persistent step 0): the local directory."""
    with checkpointer(tmp_path, persistent=1000, local=10, keep=2) as ckptr:
        run(ckptr, range(0, 11))
    return tmp_path / "local"


def fifo_for(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def test_a_named_pipe_for_a_manifest_is_passed_over(tmp_path) -> None:
    manifest = fifo_for(saved(tmp_path) / "10" / "p0-of-1.manifest.json")

    def restore():
        with checkpointer(tmp_path, persistent=1000, local=10, keep=2) as ckptr:
            return [s.step for s in ckptr.steps(tier="local")], ckptr.load_pytree()

    local_steps, restored = within(20, restore, [manifest])
    assert local_steps == [0] and restored["step"] == 0  # Step 10's copy: passed over.


def test_a_named_pipe_for_an_empty_file_of_a_copy_damages_it(tmp_path) -> None:
    copy = saved(tmp_path) / "10" / "p0-of-1"
    empty = next(p for p in copy.rglob("*") if p.is_file() and p.stat().st_size == 0)
    fifo_for(empty)  # Its size, 0, matches the manifest's.

    def restore():
        with checkpointer(tmp_path, persistent=1000, local=10, keep=2) as ckptr:
            return ckptr.load_pytree(), ckptr.last_restore_stats.step

    restored, step = within(20, restore, [empty])
    assert restored["step"] == step == 0  # Step 10's copy: damaged, passed over.


def test_a_named_pipe_for_the_record_is_refused(tmp_path) -> None:
    record = fifo_for(saved(tmp_path) / OWNER_FILE)
    with pytest.raises(cp.errors.InvalidArgumentError, match="record .* is unreadable"):
        within(20, lambda: checkpointer(tmp_path, persistent=1000, local=10), [record])


# Run in a process of its own, limited to 3 GiB: without the bounds, reading /dev/zero
# or a sparse file of 3 GB would take all the memory it could.
_HUGE = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import checkpointables as cp
E = cp.training.save_decision_policies.EveryNStepsPolicy
base, what = sys.argv[1:]
local = f"{base}/local"
def replace(path, how):
    os.remove(path)
    if how == "/dev/zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.truncate(3 << 30)
def ckptr():
    tier = cp.training.LocalTier(local, save_decision_policy=E(10), keep=2)
    return cp.training.Checkpointer(f"{base}/persistent", save_decision_policy=E(1000),
                                    local_tier=tier)
found = {}
for how in ("/dev/zero", "sparse") if what == "manifest" else ():
    replace(f"{local}/10/p0-of-1.manifest.json", how)
    with ckptr() as c:
        found[f"manifest {how}"] = [[s.step for s in c.steps(tier="local")],
                                    c.load_pytree()["step"]]
for how in ("/dev/zero", "sparse") if what == "record" else ():
    replace(f"{local}/.checkpointables-local-tier.json", how)
    try:
        ckptr().close()
        found[f"record {how}"] = "taken"
    except cp.errors.InvalidArgumentError as e:
        found[f"record {how}"] = str(e)
print(json.dumps(found))
"""


@pytest.mark.parametrize("what", ["manifest", "record"])
def test_a_device_or_huge_sparse_manifest_or_record_costs_no_memory(tmp_path, what) -> None:
    saved(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _HUGE, str(tmp_path), what],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    if what == "manifest":  # Step 10's copy is passed over, and step 0's restored.
        assert found == {"manifest /dev/zero": [[0], 0], "manifest sparse": [[0], 0]}
        return
    assert "character device" in found["record /dev/zero"]
    assert "more than 1,048,576 bytes" in found["record sparse"]
    for how in ("/dev/zero", "sparse"):
        assert OWNER_FILE in found[f"record {how}"] and "is unreadable" in found[f"record {how}"]


# Property: for any contents placed before the first save, nothing not the tier's goes.

_ENTRY = st.sampled_from(["checkpoint", "file", "link out", "loop", "dir with file", "empty"])


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    placed=st.dictionaries(st.sampled_from(["1", "2", "10", "15", "20", "25", "x"]), _ENTRY),
    after_claim=st.booleans(),
)
def test_nothing_the_tier_did_not_make_is_ever_removed(
    tmp_path_factory, placed, after_claim
) -> None:
    base = tmp_path_factory.mktemp("p")
    local, outside = base / "local", base / "outside"
    local.mkdir()
    outside.mkdir()
    (outside / "precious").write_text("keep me")

    def place() -> None:
        for name, kind in placed.items():
            path = local / name
            if kind == "checkpoint":
                cp.save_pytree(path, {"w": np.ones(2)})
            elif kind == "file":
                path.write_text("mine")
            elif kind == "link out":
                os.symlink(outside, path)
            elif kind == "loop":
                os.symlink(name, path)
            elif kind == "dir with file":
                path.mkdir()
                (path / "mine").write_text("mine")
            else:
                path.mkdir()

    def saves(ckptr) -> None:
        for step in (10, 20, 30):
            with contextlib.suppress(cp.errors.InvalidArgumentError):  # A step held by another.
                ckptr.save_pytree(step, {"w": np.full(2, float(step))})

    if not after_claim:
        place()
    before = snapshot(local)
    nonempty = any(kind != "empty" or not name.isdigit() for name, kind in placed.items())
    try:
        with tier(base, local) as ckptr:
            assert not (nonempty and not after_claim), "taken over a directory holding files"
            if after_claim:
                place()
                before = snapshot(local)
            saves(ckptr)
    except cp.errors.InvalidArgumentError:
        assert nonempty and not after_claim
    after = snapshot(local)
    for name, kind in placed.items():
        if kind == "empty" and name.isdigit():
            continue  # An empty step directory holds nothing: the tier's to use or remove.
        for path, entry in before.items():
            if path == name or path.startswith(name + os.sep):
                assert after.get(path) == entry, f"{path} ({kind}) was changed or removed"
    assert (outside / "precious").read_text() == "keep me"
    shutil.rmtree(base)
