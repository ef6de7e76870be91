"""On an object store too, a save into a finished checkpoint is refused before anything is
written, and a training root holding steps is not taken for a checkpoint."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _enclosing

TREE = {"w": np.arange(4.0)}


@pytest.mark.parametrize("where", ["pytree/sub", "sub"])
def test_a_save_inside_a_finished_checkpoint_is_refused(bucket, where) -> None:
    ck = f"{bucket}/ck"
    cp.save_pytree(ck, TREE)
    before = sorted(cp.storage.list_files(ck))
    for save in (
        lambda p: cp.save_pytree(p, TREE),
        lambda p: cp.save_checkpointables_async(p, {"state": TREE}).result(),
        lambda p: cp.partial.save(p, TREE),
    ):
        with pytest.raises(cp.errors.InvalidArgumentError, match=f"finished checkpoint {ck}:"):
            save(f"{ck}/{where}")
    assert sorted(cp.storage.list_files(ck)) == before
    cp.load_pytree(ck)


def test_steps_of_a_root_still_save(bucket) -> None:
    with cp.training.Checkpointer(f"{bucket}/run") as checkpointer:
        for step in range(2):
            assert checkpointer.save_pytree(step, TREE, force=True)
    assert [s.step for s in checkpointer.steps()] == [0, 1]


def test_a_parent_this_process_made_a_checkpoint_is_asked_again(bucket) -> None:
    # The save to a/x found a/ to be no checkpoint (remembered); the save to a/ forgets it.
    cp.save_pytree(f"{bucket}/a/x", TREE)
    # Removed by hand: a save never replaces a directory of checkpoints, overwrite or not.
    cp.storage.remove_tree(f"{bucket}/a/x")
    cp.save_pytree(f"{bucket}/a", TREE)
    with pytest.raises(cp.errors.InvalidArgumentError, match=f"finished checkpoint {bucket}/a:"):
        cp.save_pytree(f"{bucket}/a/y", TREE)


def test_a_parent_found_clear_while_its_own_save_wrote_is_asked_again(bucket) -> None:
    # A check of this process that ran while the save to a/ was writing found a/ clear (and
    # remembered it); a/'s commit forgets it, so the next save into a/ is refused.
    big = {"w": np.random.default_rng(0).random(2 << 20)}  # 16 MiB: a save that takes a while.
    writing = cp.save_pytree_async(f"{bucket}/a", big)
    assert _enclosing.enclosing_checkpoint(f"{bucket}/a/z") is None  # Before a/'s commit.
    writing.result()
    with pytest.raises(cp.errors.InvalidArgumentError, match=f"finished checkpoint {bucket}/a:"):
        cp.save_pytree(f"{bucket}/a/y", TREE)


def _committed_elsewhere(source: str, path: str) -> None:
    """Copies the checkpoint ``source`` to ``path`` object by object, as another process's
    save would commit one there: nothing this process remembers about ``path`` changes."""
    names = sorted(cp.storage.list_files(source))
    names.remove("commit_success.txt")
    for name in [*names, "commit_success.txt"]:  # The marker last, as a commit writes it.
        cp.storage.write_bytes(f"{path}/{name}", cp.storage.read_bytes(f"{source}/{name}"))


def test_a_parent_another_process_made_a_checkpoint_stops_the_commit(bucket) -> None:
    # The save to a/x found a/ clear (remembered); another process then commits a/. The next
    # save into a/ starts on what this process remembers, but its commit asks again.
    cp.save_pytree(f"{bucket}/a/x", TREE)
    cp.storage.remove_tree(f"{bucket}/a/x")
    cp.save_pytree(f"{bucket}/other", TREE)
    _committed_elsewhere(f"{bucket}/other", f"{bucket}/a")
    before = sorted(cp.storage.list_files(f"{bucket}/a"))
    refused = f"finished checkpoint {bucket}/a .found as this save was about to commit"
    with pytest.raises(cp.errors.InvalidArgumentError, match=refused):
        cp.save_pytree(f"{bucket}/a/y", TREE)
    assert sorted(cp.storage.list_files(f"{bucket}/a")) == before  # y removed.
    # The commit's answers are remembered: the next save is refused as it starts.
    with pytest.raises(cp.errors.InvalidArgumentError, match=f"finished checkpoint {bucket}/a:"):
        cp.save_pytree(f"{bucket}/a/z", TREE)
    cp.load_pytree(f"{bucket}/a")
