"""A save into a finished checkpoint (``ck/pytree/sub``, ``ck/sub``) is refused before
anything is written; a training root holding steps is not a checkpoint, so steps save."""

from __future__ import annotations

import os
import shutil
import threading

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _enclosing, multihost

TREE = {"w": np.arange(4.0)}


@pytest.fixture
def finished(tmp_path):
    """A finished checkpoint, with the listing of everything in it."""
    ck = tmp_path / "ck"
    cp.save_pytree(ck, TREE)
    return ck, sorted(os.walk(ck))


def _refused(ck, before, save, inner) -> None:
    with pytest.raises(cp.errors.InvalidArgumentError) as raised:
        save(inner)
    message = str(raised.value)
    assert str(inner) in message and f"finished checkpoint {ck}" in message, message
    assert "outside" in message, message  # Says what to do.
    assert sorted(os.walk(ck)) == before  # Nothing was added to the checkpoint.
    cp.load_pytree(ck)  # ... which still verifies and loads.


_SAVES = {
    "save_pytree": lambda p: cp.save_pytree(p, TREE),
    "save_pytree_overwrite": lambda p: cp.save_pytree(p, TREE, overwrite=True),
    "save_pytree_async": lambda p: cp.save_pytree_async(p, TREE).result(),
    "save_checkpointables": lambda p: cp.save_checkpointables(p, {"state": TREE}),
    "save_checkpointables_async": lambda p: cp.save_checkpointables_async(
        p, {"state": TREE}
    ).result(),
    "partial_save": lambda p: cp.partial.save(p, TREE),
}


@pytest.mark.parametrize("save", list(_SAVES.values()), ids=list(_SAVES))
@pytest.mark.parametrize("where", ["pytree/sub", "sub", "pytree/a/b"])
def test_every_save_refuses_a_path_inside_a_finished_checkpoint(finished, save, where) -> None:
    ck, before = finished
    _refused(ck, before, save, ck / where)


def test_a_link_into_a_checkpoint_counts(finished, tmp_path) -> None:
    ck, before = finished
    os.symlink(ck / "pytree", tmp_path / "link")
    _refused(ck, before, _SAVES["save_pytree"], tmp_path / "link" / "sub")


def test_a_checkpointer_whose_root_is_in_a_checkpoint_saves_no_step(finished) -> None:
    ck, before = finished
    # Refused as it opens the root (its step saves look again, as any save does).
    with pytest.raises(cp.errors.InvalidArgumentError, match="inside the finished"):
        cp.training.Checkpointer(ck / "run")
    assert sorted(os.walk(ck)) == before


def test_steps_in_a_root_and_siblings_of_a_checkpoint_still_save(finished, tmp_path) -> None:
    ck, _ = finished
    cp.save_pytree(tmp_path / "ck2", TREE)  # Next to a checkpoint.
    cp.save_pytree(ck, TREE, overwrite=True)  # The checkpoint itself, replaced.
    with cp.training.Checkpointer(tmp_path / "run") as checkpointer:
        for step in range(3):
            assert checkpointer.save_pytree(step, TREE, force=True)
    assert [s.step for s in checkpointer.steps()] == [0, 1, 2]
    # A partial save's session (its parts are checkpoints) is no enclosing checkpoint.
    cp.partial.save(tmp_path / "parts", {"a": TREE})
    cp.partial.save(tmp_path / "parts", {"b": TREE})
    cp.partial.finalize(tmp_path / "parts")
    assert set(cp.load_pytree(tmp_path / "parts")) == {"a", "b"}


def test_object_store_looks_at_a_bounded_number_of_parents() -> None:
    levels = _enclosing.OBJECT_STORE_LEVELS
    deep = "s3://bucket/" + "/".join(f"d{i}" for i in range(10))
    parents = _enclosing._parents(deep)
    assert len(parents) == levels and parents[0] == "s3://bucket/d0/d1/d2/d3/d4/d5/d6/d7/d8"
    assert _enclosing._parents("gs://bucket/a/b/") == ["gs://bucket/a", "gs://bucket"]


def test_a_parent_that_becomes_a_checkpoint_while_a_save_writes_stops_its_commit(
    tmp_path, misbehaving_handlers
) -> None:
    from .helpers import Gate

    other = tmp_path / "other"  # What another process commits at a/, while a/x is written.
    cp.save_pytree(other, TREE)
    gate = Gate()
    saving = cp.save_checkpointables_async(tmp_path / "a" / "x", {"gate": gate})
    assert gate.started.wait(30)  # The start's look found a/ to be no checkpoint.
    shutil.copytree(other, tmp_path / "a", dirs_exist_ok=True)
    before = sorted(os.listdir(tmp_path / "a"))
    gate.release.set()
    with pytest.raises(cp.errors.InvalidArgumentError, match="about to commit") as refused:
        saving.result(30)
    assert f"finished checkpoint {tmp_path / 'a'} (" in str(refused.value)
    after = sorted(os.listdir(tmp_path / "a"))
    assert after == [n for n in before if ".checkpointables-tmp-" not in n]  # Temp dir gone.
    assert "x" not in after
    cp.load_pytree(tmp_path / "a")


def test_a_save_broadcasts_its_checks_once(tmp_path, monkeypatch) -> None:
    told: list[str] = []
    real = multihost.broadcast_from_primary

    def counted(name, value, **kwargs):
        told.append(name)
        return real(name, value, **kwargs)

    monkeypatch.setattr(multihost, "broadcast_from_primary", counted)
    cp.save_pytree(tmp_path / "ck", TREE)
    # The look for an enclosing checkpoint shares the existence check's broadcast.
    assert [name.rsplit("/", 1)[1] for name in told] == ["check", "tmp"]


def _commit_elsewhere(tmp_path, at) -> None:
    """A checkpoint committed at ``at`` as another process would: its files copied in."""
    cp.save_pytree(tmp_path / "other", TREE, overwrite=True)
    shutil.copytree(tmp_path / "other", at, dirs_exist_ok=True)


def _same_refusal_as_a_free_function(refused: BaseException, path) -> None:
    with pytest.raises(cp.errors.InvalidArgumentError) as free:
        cp.save_pytree(path, TREE)
    assert str(refused) == str(free.value)


def test_a_parent_that_becomes_a_checkpoint_stops_a_checkpointers_next_save(tmp_path) -> None:
    with cp.training.Checkpointer(tmp_path / "a" / "run") as checkpointer:
        assert checkpointer.save_pytree(0, TREE, force=True)
        _commit_elsewhere(tmp_path, tmp_path / "a")  # After the root was opened.
        with pytest.raises(cp.errors.InvalidArgumentError) as refused:
            checkpointer.save_pytree(1, TREE, force=True)
        _same_refusal_as_a_free_function(refused.value, tmp_path / "a" / "run" / "1")
        assert sorted(os.listdir(tmp_path / "a" / "run")) == ["0"]


def test_a_parent_that_becomes_a_checkpoint_while_a_step_writes_stops_its_commit(
    tmp_path, misbehaving_handlers
) -> None:
    from .helpers import Gate

    checkpointer = cp.training.Checkpointer(tmp_path / "a" / "run")
    gate = Gate()
    saving = checkpointer.save_checkpointables_async(0, {"gate": gate}, force=True)
    assert gate.started.wait(30)
    _commit_elsewhere(tmp_path, tmp_path / "a")
    gate.release.set()
    with pytest.raises(cp.errors.InvalidArgumentError, match="about to commit") as refused:
        saving.result(30)
    assert f"finished checkpoint {tmp_path / 'a'} (" in str(refused.value)
    assert os.listdir(tmp_path / "a" / "run") == []  # Its temporary directory was removed.
    checkpointer.close()


def test_a_parent_that_becomes_a_checkpoint_while_a_partial_save_writes_stops_it(
    tmp_path,
) -> None:
    from checkpointables import partial
    from checkpointables._asyncio import start_background

    path = tmp_path / "a" / "p"
    release = threading.Event()  # Holds the commit: saves of a session commit in call order.
    partial._state(partial.session_path(path)).last_save = start_background(
        lambda: release.wait(30), "an earlier save"
    )
    saving = cp.partial.save_async(path, {"x": TREE})  # Its start's look finds a/ clear.
    _commit_elsewhere(tmp_path, tmp_path / "a")
    release.set()
    with pytest.raises(cp.errors.InvalidArgumentError, match="about to commit") as refused:
        saving.result(30)
    assert f"{path} is inside the finished checkpoint {tmp_path / 'a'} (" in str(refused.value)
    session = partial.session_path(path)
    assert not session.exists() or not list((session / "pytree").iterdir())  # Not promoted.
