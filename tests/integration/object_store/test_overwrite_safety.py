"""On an object store too, ``overwrite=True`` replaces a checkpoint (finished, damaged, or an
unfinished save's) and never a root of steps or objects no save wrote; a load that meets an
overwrite says the checkpoint is being replaced, and never contradicts its own listing."""

from __future__ import annotations

import json

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _commit, _leftovers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ...core.test_overwrite_safety import (
    CHECKPOINT_FILES,
    TREE,
    WRITTEN_BY_A_SAVE,
    check_overwrite,
)


def _objects(prefix: str) -> dict[str, bytes]:
    files = sorted(cp.storage.list_files(prefix))
    return {f: cp.storage.read_bytes(f"{prefix}/{f}") for f in files}


def test_a_checkpointer_root_is_never_replaced(bucket) -> None:
    root = f"{bucket}/run-8"
    with cp.training.Checkpointer(root) as checkpointer:
        for step in (2, 3):
            checkpointer.save_pytree(step, TREE, force=True)
    before = _objects(root)
    for overwrite in (True, False):
        with pytest.raises(FileExistsError, match=r"Checkpointer's root .* with steps 2, 3"):
            cp.save_pytree(root, {"w": np.ones(2)}, overwrite=overwrite)
    assert _objects(root) == before
    assert [s.step for s in cp.training.Checkpointer(root).steps()] == [2, 3]


def test_objects_no_save_wrote_are_never_replaced(bucket) -> None:
    mine = f"{bucket}/mydata"
    cp.storage.write_bytes(f"{mine}/experiments/results.csv", b"1,2\n")
    cp.storage.write_bytes(f"{mine}/a.csv", b"x")
    with pytest.raises(
        cp.errors.CheckpointExistsError, match="holds a.csv, exp.*, which no checkpoint"
    ):
        cp.save_pytree(mine, TREE, overwrite=True)
    assert _objects(mine) == {"a.csv": b"x", "experiments/results.csv": b"1,2\n"}


def test_what_a_save_may_replace(bucket) -> None:
    finished, lost, unfinished, orbax = (f"{bucket}/{n}" for n in ("fin", "lost", "unf", "orb"))
    cp.save_pytree(finished, TREE)
    cp.save_pytree(lost, TREE)  # Committed, then lost its metadata: damaged.
    cp.storage.remove_file(f"{lost}/_CHECKPOINT_METADATA")
    live = _leftovers.SaveRecord.new()  # A save of this (live) process that did not finish.
    cp.storage.write_bytes(f"{unfinished}/.checkpointables-save", live.to_json().encode())
    cp.storage.write_bytes(f"{unfinished}/pytree/x", b"x")
    # Orbax's save in place (commit-file mode) between its metadata and commit_success.txt.
    handler = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
    metadata = json.dumps({"item_handlers": {"state": handler}})
    cp.storage.write_bytes(f"{orbax}/_CHECKPOINT_METADATA", metadata.encode())
    cp.storage.write_bytes(f"{orbax}/state/x", b"x")
    for path in (finished, lost, unfinished, orbax):
        with pytest.raises(cp.errors.CheckpointExistsError, match=f"{path} .*overwrite=True"):
            cp.save_pytree(path, TREE)
        cp.save_pytree(path, {"w": np.ones(2)}, overwrite=True)
        np.testing.assert_array_equal(cp.load_pytree(path)["w"], np.ones(2))


_NAMES = st.one_of(
    st.sampled_from((*CHECKPOINT_FILES, "0", "data.csv")),
    st.text("abc_.", min_size=1, max_size=6).filter(lambda n: n not in (".", "..")),
)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(entries=st.dictionaries(_NAMES, st.booleans(), min_size=1, max_size=4))
def test_overwrite_removes_only_checkpoints(bucket, entries) -> None:
    path = f"{bucket}/p{abs(hash(tuple(entries.items())))}"
    for name, is_dir in entries.items():
        cp.storage.write_bytes(f"{path}/{name}/inside" if is_dir else f"{path}/{name}", b"v")
    ours = any(not d and n in WRITTEN_BY_A_SAVE for n, d in entries.items()) and all(
        not d and n in CHECKPOINT_FILES for n, d in entries.items()
    )  # Random records and metadata name no directory (see the local test).
    check_overwrite(path, ours, _objects)


def _being_replaced(path: str, **record: bool) -> None:
    """``path`` as a save of this process with ``record``'s flags leaves it while it writes:
    its record, the old marker deleted."""
    cp.save_pytree(path, TREE)
    saving = _leftovers.SaveRecord.new(**record)
    cp.storage.write_bytes(f"{path}/.checkpointables-save", saving.to_json().encode())
    cp.storage.remove_file(f"{path}/commit_success.txt")


def test_a_load_during_an_overwrite_says_it_is_being_replaced(bucket) -> None:
    _being_replaced(f"{bucket}/ck", replacing=True)
    with pytest.raises(cp.errors.CheckpointChangedError, match="being replaced .*load it again"):
        cp.load_pytree(f"{bucket}/ck")
    _being_replaced(f"{bucket}/first")  # A first save (nothing replaced): no checkpoint yet.
    with pytest.raises(cp.errors.NotACheckpointError, match="did not finish"):
        cp.load_pytree(f"{bucket}/first")


def test_an_overwrite_records_that_it_replaces_a_checkpoint(bucket) -> None:
    cp.save_pytree(f"{bucket}/ck", TREE)
    assert _commit.check_can_save(
        cp.path.Path(f"{bucket}/ck"), overwrite=True, replace_unfinished=False, timeout_secs=60
    )
    assert not _commit.check_can_save(
        cp.path.Path(f"{bucket}/new"), overwrite=True, replace_unfinished=False, timeout_secs=60
    )


def test_a_refusal_whose_listing_shows_the_marker_is_looked_at_again(bucket) -> None:
    # The listing of a refusal of a load saw the marker of a save that committed meanwhile.
    path = f"{bucket}/ck"
    cp.save_pytree(path, TREE)
    refusal = cp.errors.NotACheckpointError(f"{path} has no commit_success.txt")
    opened = _commit.committed_after_refusal(path, refusal, timeout_secs=60)
    assert opened == _commit.identity(path)
