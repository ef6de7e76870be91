"""``cp.partial`` survives SIGKILL between saves, during a save and during ``finalize``.

A child process runs partial saves (and maybe ``finalize``) and is killed at a
chosen point: a function of the library is wrapped so that its n-th call
signals the parent and sleeps (before or after doing its work). The parent
then resumes the session (more saves, ``finalize``) and checks that the
checkpoint holds exactly the saves that committed, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables.cli import main as cli_main

_PART = textwrap.dedent(
    """
    import numpy as np

    def part(i):
        rng = np.random.default_rng(i)
        return {
            "params": {f"layer{i}": {"w": rng.standard_normal((128, 256)).astype(np.float32),
                                     "b": rng.standard_normal(7)}},
            "step": i,
            "shared": rng.standard_normal(64),
        }
    """
)
_namespace: dict = {}
exec(_PART, _namespace)
part = _namespace["part"]

_CHILD = _PART + textwrap.dedent(
    """
    import importlib, json, sys, time
    import checkpointables as cp

    spec = json.loads(sys.argv[1])

    def signal_and_sleep():
        open(spec["ready"], "w").close()
        time.sleep(600)

    if spec["hang"]:
        module_name, attribute, nth, after = spec["hang"]
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)
        calls = [0]

        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth and not after:
                signal_and_sleep()
            result = original(*args, **kwargs)
            if calls[0] == nth and after:
                signal_and_sleep()
            return result

        setattr(module, attribute, wrapper)

    for i in spec["saves"]:
        cp.partial.save(spec["path"], part(i))
    if spec["finalize"]:
        cp.partial.finalize(spec["path"])
    signal_and_sleep()
    """
)


def _start_child(tmp_path, saves, *, hang=None, finalize=False) -> subprocess.Popen:
    """Starts the child; returns once it sleeps at its point (it is then killed if that fails)."""
    ready = tmp_path / "ready"
    spec = {
        "path": str(tmp_path / "ckpt"),
        "ready": str(ready),
        "saves": saves,
        "hang": hang,
        "finalize": finalize,
    }
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(spec)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, "the child died before reaching the kill point"
            assert time.monotonic() < deadline, "the child never reached the kill point"
            time.sleep(0.02)
    except BaseException:
        _kill(proc)
        raise
    ready.unlink()
    return proc


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)


def _kill_child(tmp_path, saves, *, hang=None, finalize=False) -> None:
    _kill(_start_child(tmp_path, saves, hang=hang, finalize=finalize))


def _merged(indices):
    tree: dict = {"params": {}}
    for i in indices:
        p = part(i)
        tree["params"].update(p["params"])
        tree["step"], tree["shared"] = p["step"], p["shared"]
    return tree


def _assert_holds(path, indices) -> None:
    loaded = cp.load_pytree(path)
    expected = _merged(indices)
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(expected)
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(loaded), leaves(expected), strict=True):
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        else:
            assert a == b and type(a) is type(b)
    assert sorted(os.listdir(path)) == [
        "_CHECKPOINT_METADATA",
        "_CHECKSUMS",
        "commit_success.txt",
        "orbax.checkpoint",
        "pytree",
    ]
    assert not cp.partial.session_path(path).exists()


def _assert_unpublished(path) -> None:
    assert not path.exists() and not cp.is_checkpoint(path)


def test_killed_between_saves(tmp_path) -> None:
    path = tmp_path / "ckpt"
    _kill_child(tmp_path, [0, 1])
    _assert_unpublished(path)
    cp.partial.save(path, part(2))
    cp.partial.finalize(path)
    _assert_holds(path, [0, 1, 2])


@pytest.mark.parametrize(
    "hang",
    [
        # Save 1's data is written, its checkpoint not yet renamed into place.
        ("checkpointables.layout", "commit", 2, False),
        # Save 1 is a complete checkpoint, not yet promoted into the session.
        ("checkpointables.partial", "_promote", 2, False),
    ],
    ids=["before-commit", "before-promotion"],
)
def test_killed_during_a_save(tmp_path, hang) -> None:
    path = tmp_path / "ckpt"
    _kill_child(tmp_path, [0, 1], hang=list(hang))
    _assert_unpublished(path)
    names = os.listdir(cp.partial.session_path(path))
    assert "partial-000001" in os.listdir(cp.partial.session_path(path) / "pytree")
    # The interrupted save left its (temporary, then staged) directory behind.
    assert any(n.startswith("staged-000002") for n in names)
    cp.partial.save(path, part(2))
    cp.partial.finalize(path)
    _assert_holds(path, [0, 2])  # The interrupted save did not happen; the others did.


_INTERRUPTED = [
    ("checkpointables.layout", "commit", 2, False),
    ("checkpointables.partial", "_promote", 2, False),
]


@pytest.mark.parametrize("hang", _INTERRUPTED, ids=["before-commit", "before-promotion"])
def test_the_next_save_removes_what_a_killed_session_left(tmp_path, hang) -> None:
    path = tmp_path / "ckpt"
    session = cp.partial.session_path(path)
    _kill_child(tmp_path, [0, 1], hang=list(hang))
    assert any(n.startswith("staged-000002") for n in os.listdir(session))
    cp.partial.save(path, part(2))  # A new session on the path: it resumes the dead one.
    assert sorted(os.listdir(session)) == ["pytree"]  # Only committed saves remain.
    assert sorted(os.listdir(session / "pytree")) == ["partial-000001", "partial-000003"]
    cp.partial.finalize(path)
    _assert_holds(path, [0, 2])


@pytest.mark.parametrize("hang", _INTERRUPTED, ids=["before-commit", "before-promotion"])
def test_a_live_sessions_save_is_never_removed(tmp_path, hang) -> None:
    path = tmp_path / "ckpt"
    session = cp.partial.session_path(path)
    child = _start_child(tmp_path, [0, 1], hang=list(hang))
    try:
        held = sorted(os.listdir(session))
        assert any(n.startswith("staged-000002") for n in held)
        cp.partial.save(path, part(2))  # Another writer's running save is left alone...
        assert set(held) <= set(os.listdir(session))
        with pytest.raises(cp.errors.CheckpointExistsError, match="still writing"):
            cp.partial.finalize(path)  # ... and finalize refuses to drop or publish it.
        assert set(held) <= set(os.listdir(session)) and not path.exists()
    finally:
        _kill(child)
    cp.partial.finalize(path)  # Its process is gone: what it left is removed.
    _assert_holds(path, [0, 2])


def test_finalize_sees_another_processs_save_before_it_writes_anything(tmp_path) -> None:
    # The child is stopped in its save's call, before any of its files exist: a finalize
    # then must not publish without it (its save would return, its data in no checkpoint).
    path = tmp_path / "ckpt"
    child = _start_child(tmp_path, [0], hang=["checkpointables._saving", "start", 1, False])
    try:
        with pytest.raises(cp.errors.CheckpointExistsError, match="still writing"):
            cp.partial.finalize(path)
        assert not path.exists()
    finally:
        _kill(child)
    cp.partial.save(path, part(1))  # What the killed save left is removed.
    cp.partial.finalize(path)
    _assert_holds(path, [1])


def _held_child(tmp_path, code: str, meanwhile) -> str:
    """Runs ``code`` (argv: the checkpoint path, a file it makes once held, a file it waits
    for), calls ``meanwhile`` while it is held, lets it go; returns what it printed."""
    path, ready, go = tmp_path / "ckpt", tmp_path / "ready", tmp_path / "go"
    args = [sys.executable, "-c", code, str(path), str(ready), str(go)]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        meanwhile()
        go.touch()
        return child.communicate(timeout=120)[0]
    finally:
        if child.poll() is None:
            _kill(child)


_SAVE_WHILE_PUBLISHED = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import checkpointables as cp
    from checkpointables import partial

    path, ready, go = sys.argv[1:4]
    promote = partial._promote

    def held(*args):
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.02)
        return promote(*args)

    partial._promote = held
    try:
        cp.partial.save(path, {"late": np.ones(3)})
        print("SAVED")
    except cp.errors.CheckpointExistsError as e:
        print("REFUSED", e)
    """
)


def test_a_partial_save_whose_path_was_published_meanwhile_fails(tmp_path) -> None:
    path = tmp_path / "ckpt"

    def meanwhile() -> None:
        cp.save_pytree(path, {"other": np.zeros(2)})  # Another writer publishes the path.

    out = _held_child(tmp_path, _SAVE_WHILE_PUBLISHED, meanwhile)
    assert out.startswith("REFUSED") and "its data is in no checkpoint" in out
    assert set(cp.load_pytree(path)) == {"other"}
    assert not cp.partial.session_path(path).exists()  # Nothing of it left behind.


_FINALIZE_HELD_IN_MERGE = textwrap.dedent(
    """
    import os, sys, time
    import checkpointables as cp
    from checkpointables import partial

    path, ready, go = sys.argv[1:4]
    merge = partial._merge_pytrees

    def held(*args):
        if not os.path.exists(ready):  # The first merge only.
            open(ready, "w").close()
            while not os.path.exists(go):
                time.sleep(0.02)
        return merge(*args)

    partial._merge_pytrees = held
    cp.partial.finalize(path)
    print("FINALIZED")
    """
)


def test_a_save_committed_while_another_process_finalizes_is_in_the_checkpoint(tmp_path) -> None:
    # The save starts after finalize listed the session (it saw nothing running) and
    # commits while finalize merges: finalize merges again, and the save's data is there.
    path = tmp_path / "ckpt"
    cp.partial.save(path, part(0))
    out = _held_child(tmp_path, _FINALIZE_HELD_IN_MERGE, lambda: cp.partial.save(path, part(1)))
    assert out == "FINALIZED\n"
    _assert_holds(path, [0, 1])


# In the child, `_promote` is called once per save (calls 1-3); finalize then
# merges the saves' metadata (`_merged_metadata`, once) and pytrees (`merge_into`).
# `layout.commit` and `metadata_checksums.record` are called once per save, and a
# 4th time to publish the checkpoint. Each point names what the session holds
# when the child is killed (checked, so the points stay real).
_FINALIZE_POINTS = {
    "sources-listed": (
        ("checkpointables.partial", "_merged_metadata", 1, False),
        {"pytree/partial-000001", "pytree/partial-000002", "pytree/partial-000003/pytree"},
    ),
    "database-merged": (
        ("checkpointables_pytree.ocdbt", "merge_into", 1, True),
        {"pytree/manifest.ocdbt"},
    ),
    # The 4th: each of the three saves recorded its own first.
    "checksums-recorded": (
        ("checkpointables.metadata_checksums", "record", 4, True),
        {"_CHECKSUMS", "pytree/_METADATA"},
    ),
    "before-publish": (
        ("checkpointables.layout", "commit", 4, False),
        {"pytree/_METADATA", "orbax.checkpoint"},
    ),
}


@pytest.mark.parametrize(
    ("point", "more"),
    [(p, False) for p in _FINALIZE_POINTS] + [("sources-listed", True), ("database-merged", True)],
)
def test_killed_during_finalize(tmp_path, point, more) -> None:
    path = tmp_path / "ckpt"
    hang, present = _FINALIZE_POINTS[point]
    _kill_child(tmp_path, [0, 1, 2], hang=list(hang), finalize=True)
    _assert_unpublished(path)
    session = cp.partial.session_path(path)
    assert all((session / name).exists() for name in present)
    if more:  # Saves may go on after an interrupted finalize.
        cp.partial.save(path, part(3))
    cp.partial.finalize(path)
    _assert_holds(path, [0, 1, 2, 3] if more else [0, 1, 2])
    assert cli_main(["verify", str(path)]) == 0


def test_folders_of_unreleased_layouts_are_not_partial_saves(tmp_path) -> None:
    """Folders named as no released version names partial saves (``pending-<seq>/``,
    ``pytree/ocdbt.partial_<seq>/``) are leftovers: ``finalize`` removes them."""
    path = tmp_path / "ckpt"
    session = cp.partial.session_path(path)
    cp.save_pytree(tmp_path / "old", part(0))
    (session / "pytree").mkdir(parents=True)
    os.rename(tmp_path / "old" / "pytree", session / "pytree" / "ocdbt.partial_000001")
    cp.save_pytree(session / "pending-000002", part(1))
    with pytest.raises(cp.errors.CheckpointNotFoundError, match="No committed partial save"):
        cp.partial.finalize(path)
    cp.partial.save(path, part(2))
    cp.partial.finalize(path)
    _assert_holds(path, [2])
    assert not [n for n in os.listdir(path / "pytree") if n.startswith("ocdbt.partial_")]


def test_loading_a_path_with_unfinalized_partial_saves_says_to_finalize(tmp_path) -> None:
    path = tmp_path / "p4" / "ckpt"
    session = cp.partial.session_path(path)
    cp.partial.save(path, part(0))
    for load in (cp.load_pytree, cp.load_checkpointables, cp.pytree_metadata):
        with pytest.raises(cp.errors.CheckpointNotFoundError) as missing:
            load(path)
        assert "does not exist (nothing is stored there). But " in str(missing.value)
        assert f"{session} exists" in str(missing.value)
        assert f"cp.partial.finalize({str(path)!r})" in str(missing.value)
    # Loading the session itself says what it is and what to do.
    with pytest.raises(cp.errors.NotACheckpointError, match=r"partial saves .* not published"):
        cp.load_pytree(session)
    with pytest.raises(cp.errors.NotACheckpointError, match=r"cp.partial.finalize\("):
        cp.load_pytree(str(session) + "/")
    cp.partial.finalize(path)
    assert cp.load_pytree(path).keys() == part(0).keys()
    # Without a session the message is unchanged.
    with pytest.raises(cp.errors.CheckpointNotFoundError) as missing:
        cp.load_pytree(tmp_path / "other")
    assert str(missing.value).endswith("does not exist (nothing is stored there).")


def _two_saves(tmp_path):
    path = tmp_path / "ckpt"
    cp.partial.save(path, {"a": np.arange(4.0), "n": 3})
    cp.partial.save(path, {"b": np.arange(6, dtype=np.int32)})
    return path, cp.partial.session_path(path) / "pytree" / "partial-000001"


def test_a_committed_save_that_lost_its_metadata_stops_finalize(tmp_path) -> None:
    """A renamed ``partial-<seq>`` is committed: without ``_CHECKPOINT_METADATA`` it is
    damaged, not a leftover; dropping it would publish a checkpoint lacking its keys."""
    path, piece = _two_saves(tmp_path)
    (piece / "_CHECKPOINT_METADATA").unlink()
    with pytest.raises(cp.errors.IntegrityError, match="partial-000001 is a committed partial"):
        cp.partial.finalize(path)
    assert piece.is_dir() and not cp.is_checkpoint(path)


@pytest.mark.parametrize("damaged", ["pytree/manifest.ocdbt", "pytree/_METADATA"])
def test_a_partial_saves_damaged_metadata_is_reported_naming_it(tmp_path, damaged) -> None:
    path, piece = _two_saves(tmp_path)
    data = bytearray((piece / damaged).read_bytes())
    data[len(data) // 2] ^= 4
    (piece / damaged).write_bytes(bytes(data))
    with pytest.raises(cp.errors.IntegrityError, match=f"{piece}.*{damaged}"):
        cp.partial.finalize(path)
    assert not cp.is_checkpoint(path)


def test_finalize_still_removes_temporary_leftovers_in_the_pytree_directory(tmp_path) -> None:
    path, piece = _two_saves(tmp_path)
    leftover = piece.parent / f"partial-000003{cp.layout.TMP_INFIX}1-2-abcd"
    leftover.mkdir()
    cp.partial.finalize(path)
    assert not leftover.exists()
    assert sorted(cp.load_pytree(path)) == ["a", "b", "n"]
