"""Boolean arguments of the free functions take True or False, nothing merely truthy.

``if "no":`` is true: a string (or any other object) passed as ``overwrite`` or
``partial_load`` would silently do the opposite of what was meant, so it is refused
with ``cp.errors.InvalidArgumentTypeError`` before anything is read or written.
"""

from __future__ import annotations

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .helpers import NOT_BOOLS, assert_bool_refused

TREE = {"step": 1, "w": np.arange(3, dtype=np.int32)}

# (what is called, the argument) -> a call with that argument set to a value.
CALLS = {
    ("save_pytree", "overwrite"): lambda p, v: cp.save_pytree(p, TREE, overwrite=v),
    ("save_pytree_async", "overwrite"): lambda p, v: cp.save_pytree_async(p, TREE, overwrite=v),
    ("save", "overwrite"): lambda p, v: cp.save(p, TREE, overwrite=v),
    ("save_checkpointables", "overwrite"): lambda p, v: cp.save_checkpointables(
        p, {"pytree": TREE}, overwrite=v
    ),
    ("save_checkpointables_async", "overwrite"): lambda p, v: cp.save_checkpointables_async(
        p, {"pytree": TREE}, overwrite=v
    ),
    ("load_pytree", "partial_load"): lambda p, v: cp.load_pytree(p, {"step": 0}, partial_load=v),
    ("load_pytree_async", "partial_load"): lambda p, v: cp.load_pytree_async(
        p, {"step": 0}, partial_load=v
    ),
    ("load", "partial_load"): lambda p, v: cp.load(p, {"step": 0}, partial_load=v),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("args") / "ck"
    cp.save_pytree(path, TREE)
    return path


def _metadata(path) -> bytes:
    return (path / "_CHECKPOINT_METADATA").read_bytes()


@settings(max_examples=60, deadline=None)
@given(call=st.sampled_from(sorted(CALLS)), value=NOT_BOOLS)
def test_a_non_bool_is_refused_and_nothing_changes(checkpoint, call, value) -> None:
    assert_bool_refused(
        lambda v: CALLS[call](checkpoint, v), call[1], value, lambda: _metadata(checkpoint)
    )


def test_the_reported_cases(checkpoint) -> None:
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=r"partial_load='no' \(str\)"):
        cp.load_pytree(checkpoint, {"step": 0}, partial_load="no")
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="would count as true"):
        cp.save_pytree(checkpoint, {"step": 2}, overwrite="yes")
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="even 0 or 1"):
        cp.save_pytree(checkpoint, {"step": 2}, overwrite=1)
    assert cp.load_pytree(checkpoint)["step"] == 1


@pytest.mark.parametrize("yes", [True, np.True_, np.array(True), jnp.array(True)])
def test_numpy_and_jax_bools_are_taken(tmp_path, yes) -> None:
    path = tmp_path / "ck"
    cp.save_pytree(path, TREE)
    cp.save_pytree(path, {"step": 2, "w": TREE["w"]}, overwrite=yes)
    assert cp.load_pytree(path, {"step": 0}, partial_load=yes) == {"step": 2}
    no = not bool(yes) if type(yes) is bool else np.logical_not(yes)
    with pytest.raises(cp.errors.TreeMismatchError):
        cp.load_pytree(path, {"step": 0}, partial_load=no)
    with pytest.raises(FileExistsError):
        cp.save_pytree(path, TREE, overwrite=no)


def test_checked_bool() -> None:
    assert cp.options.checked_bool(np.False_, "flag") is False
    assert cp.options.checked_bool(jnp.bool_(True), "flag") is True
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=r"has shape \(2,\)"):
        cp.options.checked_bool(np.array([True, False]), "flag")
