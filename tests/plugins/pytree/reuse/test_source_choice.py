"""Which source a reusing save takes its data from, on real files: the checkpointable of
its name, or the source's only pytree; and a source it cannot link (another file system,
or one holding several pytrees of other names), from which it writes every array, says
why, and still records fingerprints for the saves after it."""

from __future__ import annotations

import logging
import os
import shutil

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import ocdbt, reuse

from ....python_subprocess import assert_verifies
from .helpers import linked_names

pytestmark = pytest.mark.fast_path  # Linking is the fast path's.


def _tree(shift: float = 0.0) -> dict:
    rng = np.random.default_rng(0)
    base = {f"w{i}": jnp.asarray(rng.standard_normal((64, 512), np.float32)) for i in range(3)}
    return {"base": base, "adapter": jnp.full((128, 256), shift, jnp.float32)}


def test_an_export_of_a_checkpointer_step_reuses_from_its_state(tmp_path, caplog) -> None:
    with cp.training.Checkpointer(tmp_path / "run", reuse_unchanged=True) as ckptr:
        ckptr.save_pytree(0, _tree())
        ckptr.save_pytree(1, _tree(1.0))
    step = tmp_path / "run" / "1"
    assert (step / "state").is_dir() and not (step / "pytree").exists()
    exported = _tree(2.0)
    with caplog.at_level(logging.INFO, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "export", exported, reuse_from=step)
    assert "holds no checkpointable 'pytree': 'pytree' reuses from its only pytree" in caplog.text
    report = reuse.reuse_report(tmp_path / "export" / "pytree")
    # Not a step beside it: the record names the source by its path, for `inspect`.
    assert report == {
        **dict.fromkeys(["base.w0", "base.w1", "base.w2"], str(step)),
        "adapter": None,
    }
    shutil.rmtree(tmp_path / "run")
    loaded = cp.load_pytree(tmp_path / "export")
    for name in ("w0", "w1", "w2"):
        assert np.array_equal(loaded["base"][name], exported["base"][name])
    assert np.array_equal(loaded["adapter"], exported["adapter"])
    assert_verifies(tmp_path / "export")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_subtree_of_what_the_source_saved_is_warned_about(tmp_path, caplog) -> None:
    # Arrays match by name: a subtree's names lack the prefix ("base.w0", not
    # "params.base.w0"), so nothing can be reused; the save says so and how to match.
    state = {"params": _tree()}
    cp.save_pytree(tmp_path / "1", state)
    cp.save_pytree(tmp_path / "2", state, reuse_from=tmp_path / "1")  # Recorded.
    with caplog.at_level(logging.WARNING, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "whole", state, reuse_from=tmp_path / "2")
        assert not _warnings(caplog)
        cp.save_pytree(tmp_path / "subtree", state["params"], reuse_from=tmp_path / "2")
    (text,) = _warnings(caplog)
    assert "there: 'params.adapter', 'params.base.w0'" in text and "here: 'adapter'" in text
    assert "save {'params': params}" in text
    names = {"params.adapter", "params.base.w0", "params.base.w1", "params.base.w2"}
    assert linked_names(tmp_path / "whole") == names
    assert not linked_names(tmp_path / "subtree")


def test_a_predicate_declaring_nothing_frozen_is_warned_about(tmp_path, caplog) -> None:
    # A predicate written for key paths as printed ("['base']") matches no stored name.
    misspelt = lambda name: name.startswith("['base']")  # noqa: E731
    with (
        caplog.at_level(logging.WARNING, logger="checkpointables.reuse"),
        cp.training.Checkpointer(tmp_path / "run", reuse_unchanged=misspelt) as ckptr,
    ):
        ckptr.save_pytree(0, _tree())
        ckptr.save_pytree(1, _tree(1.0))
    (text,) = _warnings(caplog)  # Once.
    assert "declared none of this save's arrays" in text and "'adapter', 'base.w0'" in text
    caplog.clear()
    with (
        caplog.at_level(logging.WARNING, logger="checkpointables.reuse"),
        cp.training.Checkpointer(
            tmp_path / "run2", reuse_unchanged=lambda name: name.startswith("base.")
        ) as ckptr,
    ):
        ckptr.save_pytree(0, _tree())
    assert not _warnings(caplog)


def test_a_source_of_several_other_pytrees_is_named_in_a_warning(tmp_path, caplog) -> None:
    tree = _tree()
    cp.save_checkpointables(tmp_path / "1", {"params": tree, "ema": tree})
    with caplog.at_level(logging.WARNING, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = warning.getMessage()
    assert str(tmp_path / "1") in text and "'ema', 'params'" in text, text
    assert "checkpointable_name=" in text, text
    assert not linked_names(tmp_path / "2")
    # Named as the source names it, the same save links.
    cp.save_pytree(tmp_path / "3", tree, reuse_from=tmp_path / "1", checkpointable_name="ema")
    assert linked_names(tmp_path / "3", "ema") == {"base.w0", "base.w1", "base.w2", "adapter"}


def test_a_source_on_another_file_system_is_written_and_recorded(
    tmp_path, elsewhere, caplog
) -> None:
    tree = _tree()
    source = os.path.join(elsewhere, "1")
    cp.save_pytree(source, tree)
    cp.save_pytree(os.path.join(elsewhere, "2"), tree, reuse_from=source)
    with caplog.at_level(logging.INFO, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "a", tree, reuse_from=os.path.join(elsewhere, "2"))
    assert "is on another file system than this save" in caplog.text
    assert reuse.reuse_report(tmp_path / "a" / "pytree") == dict.fromkeys(
        ["base.w0", "base.w1", "base.w2", "adapter"]
    )  # Written, and recorded: the next save on this file system links from it.
    cp.save_pytree(tmp_path / "b", tree, reuse_from=tmp_path / "a")
    assert linked_names(tmp_path / "b") == {"base.w0", "base.w1", "base.w2", "adapter"}
    assert_verifies(tmp_path / "b")


def test_a_file_that_cannot_be_hard_linked_is_copied(tmp_path, elsewhere) -> None:
    source = os.path.join(elsewhere, "d", "0a1b")
    os.makedirs(os.path.dirname(source))
    content = os.urandom(100_000)
    with open(source, "wb") as f:
        f.write(content)
    linked = ocdbt.Linked(source, offset=0, length=len(content))
    ocdbt.link_files(tmp_path, [linked])  # Says so once per process in the log.
    copied = tmp_path / linked.name
    assert copied.read_bytes() == content and os.stat(copied).st_nlink == 1


def test_a_source_that_tracked_no_array_is_not_called_unrecorded(tmp_path, caplog) -> None:
    small = {"a": np.ones(10, np.float32), "b": jnp.zeros(100)}  # Under 64 KiB: untracked.
    cp.save_pytree(tmp_path / "1", small)
    cp.save_pytree(tmp_path / "2", small, reuse_from=tmp_path / "1")
    assert (tmp_path / "2" / "pytree" / reuse.RECORD_FILE).exists()
    with caplog.at_level(logging.INFO, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "3", small, reuse_from=tmp_path / "2")
    assert str(tmp_path / "2") not in caplog.text  # A record of no arrays: nothing to say.
    assert np.array_equal(cp.load_pytree(tmp_path / "3")["b"], small["b"])
