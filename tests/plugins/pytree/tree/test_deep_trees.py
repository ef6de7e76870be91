"""Trees nested deeper than a checkpoint may be: a clear error at every depth, saving or loading.

jax's flatten recurses in C++: past ~1,000 levels it fails with a SystemError (and, with
an ``is_leaf`` callback, leaves the thread's recursion depth raised for good).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import checkpointables as cp
import jax
import numpy as np
import pytest

DEPTHS = [300, 1000, 5000]


def _nested(kind: str, depth: int, bottom: Any) -> Any:
    tree = bottom
    for _ in range(depth):
        tree = {"k": tree} if kind == "dict" else [tree] if kind == "list" else (tree,)
    return tree


@functools.partial(jax.tree_util.register_dataclass, data_fields=["child"], meta_fields=[])
@dataclasses.dataclass
class Box:
    """A registered pytree node holding one child (flattened by jax without calling Python:
    a node flattened by a Python callback that runs out of stack leaves the thread's
    recursion depth used up, in jax itself)."""

    child: Any


def _stack_left() -> int:
    """How many frames this thread can still recurse (a leaked recursion depth shows here)."""
    frames = 0

    def down() -> None:
        nonlocal frames
        frames += 1
        down()

    with pytest.raises(RecursionError):
        down()
    return frames


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
def test_saving_a_tree_nested_too_deep_is_refused_clearly(tmp_path, kind, depth) -> None:
    start = _stack_left()
    with pytest.raises(cp.errors.InvalidArgumentError, match="more than 256 levels deep"):
        cp.save_pytree(tmp_path / "c", _nested(kind, depth, np.ones(2)))
    assert not (tmp_path / "c").exists()
    assert _stack_left() >= start - 5


@pytest.mark.parametrize("depth", [300, 3000])
def test_a_deep_chain_of_registered_nodes_is_refused_clearly(tmp_path, depth) -> None:
    tree: Any = np.ones(2)
    for _ in range(depth):
        tree = Box(tree)
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"\['child'\]\['child'\]"):
        cp.save_pytree(tmp_path / "c", tree)


def test_a_tree_that_holds_itself_is_refused_clearly(tmp_path) -> None:
    tree: list[Any] = [np.ones(2)]
    tree.append(tree)
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"\[1\]\[1\]\[1\]\[1\]\.\.\."):
        cp.save_pytree(tmp_path / "c", tree)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("kind", ["dict", "list"])
def test_loading_into_an_abstract_tree_nested_too_deep_is_refused_clearly(
    tmp_path, kind, depth
) -> None:
    cp.save_pytree(tmp_path / "c", {"k": np.ones(2)})
    abstract = _nested(kind, depth, jax.ShapeDtypeStruct((2,), np.float64))
    start = _stack_left()
    with pytest.raises(cp.errors.InvalidArgumentError, match="no checkpoint holds a tree"):
        cp.load_pytree(tmp_path / "c", abstract)
    # jax's flatten with a callback, had it run out of stack, would have kept it used up.
    assert _stack_left() >= start - 5
    assert cp.load_pytree(tmp_path / "c")["k"].tolist() == [1.0, 1.0]


def test_the_deepest_abstract_tree_still_loads(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", _nested("dict", 256, np.ones(2)))
    loaded = cp.load_pytree(tmp_path / "c", _nested("dict", 256, np.zeros(2)))
    for _ in range(256):
        loaded = loaded["k"]
    assert loaded.tolist() == [1.0, 1.0]
    assert sys.getrecursionlimit() >= 1000
