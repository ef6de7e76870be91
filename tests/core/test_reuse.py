"""``cp.reuse``: a declaration of frozen leaves (``reuse_unchanged=predicate``) is checked,
since a leaf it declares frozen is saved without a fingerprint: a predicate that cannot be
called with a leaf's name, raises, or answers other than True or False is refused with an
error naming the leaf, and nothing is committed."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest


def _tree() -> dict:
    return {"base": {"w": np.ones(1 << 15, np.float32)}, "adapter": np.zeros(1 << 15, np.float32)}


def test_a_predicate_of_two_arguments_is_refused_at_once(tmp_path) -> None:
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="one argument, a leaf's name"):
        cp.training.Checkpointer(tmp_path, reuse_unchanged=lambda name, extra: True)
    with pytest.raises(
        cp.errors.InvalidArgumentTypeError,
        match=r"a predicate on leaf names, got str: .*startswith",
    ):
        cp.training.Checkpointer(tmp_path, reuse_unchanged="base")


@pytest.mark.parametrize(
    ("predicate", "error", "said"),
    [
        (lambda name: {"base.w": True}[name], cp.errors.InvalidArgumentError, "raised KeyError"),
        (lambda name: "yes", cp.errors.InvalidArgumentTypeError, "returned 'yes'"),
        (lambda name: None, cp.errors.InvalidArgumentTypeError, "returned None"),
    ],
    ids=["raises", "a-string", "none"],
)
def test_a_predicate_that_does_not_answer_true_or_false_fails_the_save(
    tmp_path, predicate, error, said
) -> None:
    with cp.training.Checkpointer(tmp_path, reuse_unchanged=predicate) as ckptr:
        with pytest.raises(error, match=said) as raised:
            ckptr.save_pytree(0, _tree())
        assert "'adapter'" in str(raised.value) or "'base.w'" in str(raised.value)
        assert ckptr.latest_step() is None


def test_numpy_booleans_are_answers(tmp_path) -> None:
    frozen = cp.reuse.checked_frozen(lambda name: np.str_(name).startswith("base."))
    assert frozen("base.w") is True and frozen("adapter") is False
    assert cp.reuse.checked_frozen(frozen) is frozen  # Checked once, not wrapped twice.
    with cp.training.Checkpointer(tmp_path, reuse_unchanged=lambda n: np.bool_(n == "base.w")) as c:
        c.save_pytree(0, _tree())
        c.save_pytree(1, _tree())
        assert c.last_save_stats.bytes_reused > 0


def test_a_checkpointer_save_given_reuse_from_names_itself(tmp_path) -> None:
    # A Checkpointer reuses from its latest step; the error names the method called, not
    # the asynchronous one it starts.
    with cp.training.Checkpointer(tmp_path / "run") as ckptr:
        ckptr.save_pytree(0, _tree())
        with pytest.raises(TypeError, match=r"^Checkpointer\.save_pytree\(\) got an unexpected"):
            ckptr.save_pytree(1, _tree(), reuse_from=tmp_path / "run" / "0")


def test_reuse_from_a_checkpointer_root_names_a_step_to_pass(tmp_path) -> None:
    with cp.training.Checkpointer(tmp_path / "run") as ckptr:
        for step in (2, 10):
            ckptr.save_pytree(step, _tree(), force=True)
    with pytest.raises(cp.errors.NotACheckpointError) as raised:
        cp.save_pytree(tmp_path / "x", _tree(), reuse_from=tmp_path / "run")
    assert f"reuse_from={tmp_path / 'run' / '10'}" in str(raised.value)
    with pytest.raises(cp.errors.NotACheckpointError) as raised:  # No steps: no hint.
        cp.save_pytree(tmp_path / "y", _tree(), reuse_from=tmp_path)
    assert "pass one" not in str(raised.value)
