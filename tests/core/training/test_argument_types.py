"""The Checkpointer's and the policies' arguments are checked where they are given.

A string where a bool goes (``overwrite="false"``) is refused rather than taken as
true; a policy class where an instance goes, or a single value where a list goes,
is refused at construction rather than failing with a bare ``TypeError`` at a save.
"""

from __future__ import annotations

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ..helpers import NOT_BOOLS, assert_bool_refused

D = cp.training.save_decision_policies
P = cp.training.preservation_policies
TREE = {"step": 1, "w": np.arange(3, dtype=np.int32)}
NEVER = D.SpecificStepsPolicy([])  # Saves only what is forced.

CALLS = {
    ("save_pytree", "overwrite"): lambda c, v: c.save_pytree(10, TREE, overwrite=v),
    ("save_pytree", "force"): lambda c, v: c.save_pytree(10, TREE, force=v),
    ("save_pytree_async", "overwrite"): lambda c, v: c.save_pytree_async(10, TREE, overwrite=v),
    ("save_pytree_async", "force"): lambda c, v: c.save_pytree_async(10, TREE, force=v),
    ("save", "force"): lambda c, v: c.save(10, TREE, force=v, overwrite=True),
    ("save_checkpointables", "overwrite"): lambda c, v: c.save_checkpointables(
        10, {"state": TREE}, force=True, overwrite=v
    ),
    ("save_checkpointables_async", "force"): lambda c, v: c.save_checkpointables_async(
        10, {"state": TREE}, force=v
    ),
    ("load_pytree", "partial_load"): lambda c, v: c.load_pytree(10, {"step": 0}, partial_load=v),
    ("load_pytree_async", "partial_load"): lambda c, v: c.load_pytree_async(
        None, {"step": 0}, partial_load=v
    ),
    ("load", "partial_load"): lambda c, v: c.load(99, {"step": 0}, partial_load=v),
}


@pytest.fixture(scope="module")
def ckptr(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    with cp.training.Checkpointer(root, save_decision_policy=NEVER) as ckptr:
        assert ckptr.save_pytree(10, TREE, force=True)
        yield ckptr


def _metadata(ckptr) -> bytes:
    return (ckptr.directory / "10" / "_CHECKPOINT_METADATA").read_bytes()


@settings(max_examples=60, deadline=None)
@given(call=st.sampled_from(sorted(CALLS)), value=NOT_BOOLS)
def test_a_non_bool_is_refused_and_nothing_changes(ckptr, call, value) -> None:
    def state() -> tuple[bytes, list[int]]:
        return _metadata(ckptr), [s.step for s in ckptr.steps()]

    assert_bool_refused(lambda v: CALLS[call](ckptr, v), call[1], value, state)


def test_the_reported_case(ckptr) -> None:
    before = _metadata(ckptr)
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="force='no'"):
        ckptr.save_pytree(10, {"step": 2}, overwrite="false", force="no")
    assert _metadata(ckptr) == before


def test_numpy_and_jax_bools_are_taken(tmp_path) -> None:
    with cp.training.Checkpointer(tmp_path, save_decision_policy=NEVER) as ckptr:
        assert not ckptr.save_pytree(1, TREE, force=np.False_)
        assert ckptr.save_pytree(1, TREE, force=jnp.array(True))
        assert ckptr.save_pytree(1, {**TREE, "step": 2}, force=True, overwrite=np.True_)
        assert ckptr.load_pytree(1, {"step": 0}, partial_load=np.True_) == {"step": 2}
    with cp.training.Checkpointer(tmp_path, reuse_unchanged=np.False_) as ckptr:
        assert ckptr.load_pytree()["step"] == 2


@pytest.mark.parametrize("value", ["base", 1, np.array([True])])
def test_reuse_unchanged_takes_a_bool_none_or_predicate(tmp_path, value) -> None:
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="reuse_unchanged"):
        cp.training.Checkpointer(tmp_path, reuse_unchanged=value)


@pytest.mark.parametrize(
    ("argument", "cls"),
    [
        ("save_decision_policy", D.EveryNStepsPolicy),
        ("save_decision_policy", D.InitialSavePolicy),
        ("preservation_policy", P.LatestN),
        ("preservation_policy", P.PreserveAll),
    ],
)
def test_a_policy_class_is_refused_at_construction(tmp_path, argument, cls) -> None:
    hint = rf"{argument} must be an instance.*pass an instance: {cls.__name__}\(\.\.\.\)"
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=hint):
        cp.training.Checkpointer(tmp_path, **{argument: cls})
    assert not any(tmp_path.iterdir())  # Refused before the root was touched.


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: D.SpecificStepsPolicy(10), r"a list of steps .*got 10 \(int\)"),
        (lambda: D.SpecificStepsPolicy("10"), "a list of steps"),
        (lambda: D.AnySavePolicy(D.InitialSavePolicy()), r"a list of policies .*got Initial"),
        (lambda: D.AnySavePolicy([D.InitialSavePolicy]), r"instance: InitialSavePolicy\(\.\.\.\)"),
        (lambda: P.AnyPreservationPolicy(P.LatestN(2)), "a list of policies"),
        (lambda: P.AnyPreservationPolicy([P.LatestN]), r"instance: LatestN\(\.\.\.\)"),
    ],
)
def test_a_single_item_or_a_class_is_refused_in_a_policy(make, match) -> None:
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=match):
        make()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: D.EveryNStepsPolicy("100"), r"EveryNStepsPolicy.steps='100' \(str\)"),
        (lambda: D.SpecificStepsPolicy([1, "2"]), r"ints >= 0 \(not '2'\)"),
        (lambda: D.ContinuousCheckpointingPolicy("10"), "minimum_interval_secs='10'"),
        (lambda: P.LatestN("3"), r"LatestN.n='3' \(str\)"),
        (lambda: P.EveryNSteps(2.5), "EveryNSteps.interval_steps=2.5"),
        (lambda: P.EveryNSeconds("60"), "EveryNSeconds.interval_secs='60'"),
        (lambda: P.BestN(get_metric_fn=len, n="2"), "BestN.n='2'"),
        (lambda: P.BestN(get_metric_fn=len, reverse="no"), "BestN.reverse='no'"),
        (lambda: P.BestN(len, keep_checkpoints_without_metrics=1), "True or False"),
    ],
)
def test_a_wrong_type_in_a_policy_is_a_type_error(make, match) -> None:
    # Also an InvalidArgumentError, as it was: `except cp.errors.InvalidArgumentError` holds.
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=match) as raised:
        make()
    assert isinstance(raised.value, cp.errors.InvalidArgumentError)


def test_numpy_and_jax_integers_are_taken_by_policies() -> None:
    assert D.EveryNStepsPolicy(np.int64(100)).steps == 100
    assert type(P.LatestN(jnp.int32(3)).n) is int
    assert D.SpecificStepsPolicy([np.int32(5), 6]).steps == frozenset({5, 6})
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"\(not -1\)"):
        D.SpecificStepsPolicy([1, -1])
