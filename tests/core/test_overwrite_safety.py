"""``overwrite=True`` replaces a checkpoint (finished, damaged, or an unfinished save's), never
a directory of checkpoints or files no save wrote (docs/quickstart.md, "Nothing is lost")."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import checkpointables as cp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TREE = {"w": np.arange(3.0)}
CHECKPOINT_FILES = (
    "_CHECKPOINT_METADATA",
    "_CHECKSUMS",
    "commit_success.txt",
    "orbax.checkpoint",
    ".checkpointables-save",
)
WRITTEN_BY_A_SAVE = ("_CHECKPOINT_METADATA", "commit_success.txt", ".checkpointables-save")
LEFTOVERS = ("x.checkpointables-tmp-1-2-ab", "x.orbax-checkpoint-tmp", "y.orbax-checkpoint-tmp-7")


def _is_leftover(name: str) -> bool:
    return ".checkpointables-tmp-" in name or ".orbax-checkpoint-tmp" in name


def _tree(path: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_a_checkpointer_root_is_never_replaced(tmp_path) -> None:
    root = tmp_path / "g"
    with cp.training.Checkpointer(root) as checkpointer:
        for step in (0, 1):
            checkpointer.save_pytree(step, TREE, force=True)
    before = _tree(root)
    for overwrite in (True, False):
        with pytest.raises(FileExistsError, match=r"Checkpointer's root .* with steps 0, 1") as e:
            cp.save_pytree(root, {"w": np.ones(2)}, overwrite=overwrite)
        assert isinstance(e.value, cp.errors.CheckpointExistsError)
        assert f"Save to {root}/<step>" in str(e.value)
        assert "old checkpoint" not in str(e.value)
    assert _tree(root) == before
    np.testing.assert_array_equal(cp.load_pytree(root / "1")["w"], TREE["w"])


def test_user_files_and_a_file_are_never_replaced(tmp_path) -> None:
    mine = tmp_path / "mydata"
    (mine / "experiments").mkdir(parents=True)
    (mine / "experiments" / "results.csv").write_text("1,2\n")
    (mine / "a.csv").write_text("x")
    with pytest.raises(
        cp.errors.CheckpointExistsError, match="holds a.csv, exp.*, which no checkpoint"
    ):
        cp.save_pytree(mine, TREE, overwrite=True)
    with pytest.raises(FileExistsError, match="remove it yourself"):
        cp.save_pytree(mine, TREE)
    assert _tree(mine) == {"a.csv": b"x", "experiments/results.csv": b"1,2\n"}
    waiting = tmp_path / "waiting"  # Partial saves waiting for finalize: no leftovers.
    (waiting / "ck.partial_save").mkdir(parents=True)
    with pytest.raises(
        cp.errors.CheckpointExistsError, match="holds ck.partial_save, which no checkpoint"
    ):
        cp.save_pytree(waiting, TREE, overwrite=True)
    (tmp_path / "f").write_text("keep")
    with pytest.raises(cp.errors.CheckpointExistsError, match="is a file, not a checkpoint"):
        cp.save_pytree(tmp_path / "f", TREE, overwrite=True)
    assert (tmp_path / "f").read_text() == "keep"


def test_what_a_save_may_replace(tmp_path) -> None:
    finished = tmp_path / "finished"
    cp.save_pytree(finished, TREE)
    lost = tmp_path / "lost"  # Committed, then lost its metadata: damaged.
    cp.save_pytree(lost, TREE)
    (lost / "_CHECKPOINT_METADATA").unlink()
    leftovers = tmp_path / "leftovers"
    for name in LEFTOVERS:
        (leftovers / name).mkdir(parents=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, what in [
        (finished, "holds a checkpoint. Pass overwrite=True"),
        (lost, "damaged or was not finished .*_CHECKSUMS"),
        (leftovers, "only temporary directories of saves that did not finish"),
        (empty, r"exists \(an empty directory\)"),
    ]:
        with pytest.raises(cp.errors.CheckpointExistsError, match=what):
            cp.save_pytree(path, TREE)
        cp.save_pytree(path, {"w": np.ones(2)}, overwrite=True)
        np.testing.assert_array_equal(cp.load_pytree(path)["w"], np.ones(2))


@pytest.mark.parametrize(
    "stray",
    ["_CHECKPOINT_METADATA", "commit_success.txt", "_CHECKSUMS", "orbax.checkpoint"],
)
def test_a_stray_checkpoint_file_never_makes_what_is_beside_it_replaceable(tmp_path, stray):
    # Steps of a run, a user's files and folders, a checkpoint with a nested one and notes:
    # one file of a checkpoint's name beside them proves nothing.
    finished = tmp_path / "finished"
    cp.save_pytree(finished, TREE)
    for name, make in {
        "steps": lambda p: [cp.save_pytree(p / str(i), TREE) for i in (1, 2)],
        "user file": lambda p: (p / "thesis.tex").write_text("x"),
        "user folder": lambda p: [(p / "data").mkdir(), (p / "data" / "a.bin").write_text("y")],
        "nested and notes": lambda p: [
            cp.save_pytree(p / "pytree", TREE),
            (p / "notes.txt").write_text("z"),
        ],
    }.items():
        path = tmp_path / name.replace(" ", "_")
        path.mkdir()
        make(path)
        (path / stray).write_bytes((finished / stray).read_bytes())
        check_overwrite(path, False, _tree)
    real = tmp_path / "real"  # A checkpoint with a nested one in a folder it does not name.
    cp.save_pytree(real, TREE)
    cp.save_pytree(tmp_path / "inner", TREE)  # A save inside ``real`` is refused: moved in.
    os.rename(tmp_path / "inner", real / "inner_ckpt")
    check_overwrite(real, False, _tree)


def _save_v0(ocp: Any, path: pathlib.Path) -> None:
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, TREE)
        checkpointer.wait_until_finished()


def test_orbax_checkpoints_are_replaced_and_what_lost_its_records_is_refused(tmp_path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    ocp_v1 = pytest.importorskip("orbax.checkpoint.experimental.v1")
    v0 = tmp_path / "v0"  # A pytree directly at the top: its files are the pytree plugin's.
    _save_v0(ocp, v0)
    with ocp.CheckpointManager(tmp_path / "manager") as manager:
        manager.save(1, args=ocp.args.StandardSave(TREE))
        manager.wait_until_finished()
    v1 = tmp_path / "v1"
    ocp_v1.save(v1, TREE)
    for path in (v0, tmp_path / "manager" / "1", v1):
        check_overwrite(path, True, _tree)
    # Nothing says a save wrote these any more: an Orbax V0 tree without its
    # _CHECKPOINT_METADATA (older releases), ours with only its checkpointable's folder.
    older_v0 = tmp_path / "older_v0"
    _save_v0(ocp, older_v0)
    nothing_left = tmp_path / "nothing_left"
    cp.save_pytree(nothing_left, TREE)
    for path in (older_v0, nothing_left):
        for name in (
            "_CHECKPOINT_METADATA",
            "commit_success.txt",
            "_CHECKSUMS",
            "orbax.checkpoint",
        ):
            (path / name).unlink(missing_ok=True)
        with pytest.raises(cp.errors.CheckpointExistsError, match="older or foreign checkpoint"):
            cp.save_pytree(path, TREE, overwrite=True)


def check_overwrite(path: Any, ours: bool, contents: Callable[[Any], object]) -> None:
    """Saves to ``path`` with ``overwrite=True``: it replaces what is there if that is ``ours``
    (a checkpoint, leftovers of saves), else raises and leaves every file as it was."""
    before = contents(path)
    try:
        cp.save_pytree(path, TREE, overwrite=True)
    except cp.errors.CheckpointExistsError:
        assert not ours, before
        assert contents(path) == before
    else:
        assert ours, before
        assert cp.is_checkpoint(path)


_NAMES = st.one_of(
    st.sampled_from(CHECKPOINT_FILES + LEFTOVERS + ("0", "1", "pytree", "data.csv")),
    st.text("abcXYZ019_.-", min_size=1, max_size=8).filter(lambda n: n not in (".", "..")),
)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(entries=st.dictionaries(_NAMES, st.booleans(), max_size=5))
def test_overwrite_removes_only_checkpoints_and_leftovers(tmp_path_factory, entries) -> None:
    path = tmp_path_factory.mktemp("prop") / "target"
    path.mkdir()
    for name, is_dir in entries.items():
        if is_dir:
            (path / name).mkdir()
            (path / name / "inside").write_text(name)
        else:
            (path / name).write_text(name)
    rest = {n: d for n, d in entries.items() if not _is_leftover(n)}
    # A file only a save writes, and nothing beside it but checkpoint files: random
    # directories are never ones its (random) records name.
    ours = not rest or (
        any(not d and n in WRITTEN_BY_A_SAVE for n, d in rest.items())
        and all(not d and n in CHECKPOINT_FILES for n, d in rest.items())
    )
    check_overwrite(path, ours, _tree)
    assert sorted(os.listdir(path.parent)) == ["target"]  # No temporary directory is left.


def _nothing(path: pathlib.Path) -> None:
    """Nothing there as the save starts."""


def _checkpoint(path: pathlib.Path) -> None:
    cp.save_pytree(path, TREE)


@pytest.mark.parametrize(
    "start, meanwhile, appeared",
    [
        # A checkpoint, which the save may replace; a user's notes are put into it.
        (_checkpoint, lambda p: (p / "notes.txt").write_text("mine"), "notes"),
        # Nothing; a user's folder of results is made there.
        (_nothing, lambda p: [p.mkdir(), (p / "r.csv").write_text("1")], "r.csv"),
        # Nothing; a user's file is put there.
        (_nothing, lambda p: p.write_text("mine"), "a file"),
    ],
    ids=["into a checkpoint", "a folder", "a file"],
)
def test_what_appears_while_an_overwrite_writes_is_never_replaced(
    tmp_path, misbehaving_handlers, start, meanwhile, appeared
) -> None:
    from .helpers import Gate

    path = tmp_path / "ck"
    start(path)
    gate = Gate()
    saving = cp.save_checkpointables_async(path, {"gate": gate}, overwrite=True)
    assert gate.started.wait(30)  # Checked, and writing: the commit's swap is still to come.
    meanwhile(path)
    before = _tree(path) if path.is_dir() else path.read_text()
    gate.release.set()
    with pytest.raises(cp.errors.CheckpointExistsError) as refused:
        saving.result(30)
    message = str(refused.value)
    assert f"{path} changed while this save was writing ({appeared}" in message, message
    assert "was not committed" in message and "left as it is" in message, message
    assert (_tree(path) if path.is_dir() else path.read_text()) == before
    assert os.listdir(tmp_path) == ["ck"]  # The save's temporary directory was removed.


def test_an_overwrite_whose_path_did_not_change_replaces_it(tmp_path, misbehaving_handlers) -> None:
    from .helpers import Gate

    path = tmp_path / "ck"
    cp.save_pytree(path, TREE)
    gate = Gate()
    saving = cp.save_checkpointables_async(path, {"gate": gate}, overwrite=True)
    assert gate.started.wait(30)
    (tmp_path / "beside.txt").write_text("x")  # Beside the path, not in it: no matter.
    gate.release.set()
    saving.result(30)
    assert (path / "gate" / "gate.txt").read_text() == "ok"  # The new checkpoint.
    assert not (path / "pytree").exists() and cp.is_checkpoint(path)


def test_an_overwrite_never_deletes_a_save_still_writing_inside(
    tmp_path, misbehaving_handlers
) -> None:
    from .helpers import Gate

    path = tmp_path / "d"
    path.mkdir()
    gate = Gate()
    saving = cp.save_checkpointables_async(path / "sub", {"gate": gate})
    assert gate.started.wait(30)  # Its temporary directory is in d, alone.
    (writing,) = os.listdir(path)
    with pytest.raises(cp.errors.CheckpointExistsError, match=writing) as refused:
        cp.save_pytree(path, TREE, overwrite=True)
    assert "a save still writing there" in str(refused.value)
    gate.release.set()
    saving.result(30)
    assert cp.is_checkpoint(path / "sub")


def test_a_directory_of_checkpoints_not_named_as_steps_is_not_called_a_root(tmp_path) -> None:
    cp.save_pytree(tmp_path / "nx_orbax", TREE)
    with pytest.raises(cp.errors.CheckpointExistsError) as refused:
        cp.save_pytree(tmp_path, TREE, overwrite=True)
    message = str(refused.value)
    assert "a directory holding checkpoints nx_orbax" in message, message
    assert "steps" not in message and "Checkpointer" not in message, message
