"""A small checkpoint of every kind of leaf, and what "loads exactly what was saved" means.

The attack tests damage or craft copies of it; a load must then either return
exactly these values (same types, dtypes, shapes and bits) or raise a
``cp.errors.CheckpointError``.
"""

from __future__ import annotations

import shutil
from typing import Any

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
from checkpointables import _verification


def saved_values() -> dict[str, Any]:
    """The checkpointables of the attacked checkpoint: a pytree (an array, a ``jax.Array``,
    a scalar, a string) and a JSON object."""
    return {
        "pytree": {
            "a": np.arange(3, dtype=np.int32),
            "j": jnp.ones(2, jnp.float32),
            "n": 7,
            "s": "x",
        },
        "meta": {"k": 1},
    }


def save(path) -> Any:
    """Saves ``saved_values()`` at ``path``; returns ``path``."""
    cp.save_checkpointables(path, saved_values())
    return path


def copy(source, target) -> Any:
    """A copy of the checkpoint ``source`` at ``target``."""
    shutil.copytree(source, target)
    return target


def _same_leaf(loaded: Any, saved: Any) -> bool:
    if isinstance(saved, np.ndarray | jax.Array):
        return (
            isinstance(loaded, jax.Array) == isinstance(saved, jax.Array)
            and isinstance(loaded, np.ndarray | jax.Array)
            and loaded.dtype == saved.dtype
            and loaded.shape == saved.shape
            and np.array_equal(np.asarray(loaded), np.asarray(saved))
        )
    return type(loaded) is type(saved) and loaded == saved


def is_exactly_saved(loaded: dict[str, Any]) -> bool:
    """Whether ``loaded`` (``cp.load_checkpointables``'s result) is what was saved, bit for bit."""
    saved = saved_values()
    if set(loaded) != set(saved) or loaded["meta"] != saved["meta"]:
        return False
    tree, expected = loaded["pytree"], saved["pytree"]
    return (
        isinstance(tree, dict)
        and set(tree) == set(expected)
        and all(_same_leaf(tree[k], v) for k, v in expected.items())
    )


def load_outcome(path) -> str:
    """``"exact"`` if the checkpoint loads exactly as saved, else the library error's class name.

    Anything else (wrong values, a builtin exception) fails the calling test.
    """
    try:
        loaded = cp.load_checkpointables(path)
    except cp.errors.CheckpointError as e:
        return type(e).__name__
    assert is_exactly_saved(loaded), f"{path} loaded values that differ from what was saved"
    return "exact"


def verify_fails(path) -> bool:
    """Whether ``checkpointables verify`` reports a problem in ``path`` (exit status 1)."""
    return any(f.problem for f in _verification.verify_checkpoint(path))
