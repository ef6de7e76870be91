"""What the reuse tests read back from a checkpoint."""

from __future__ import annotations

import jax
import numpy as np
from checkpointables_pytree import reuse


def linked_names(checkpoint, name: str = "pytree") -> set[str]:
    """The arrays of ``checkpoint``'s checkpointable ``name`` that its save linked from
    its source (as its record, and ``checkpointables inspect``, say)."""
    report = reuse.reuse_report(checkpoint / name)
    return {array for array, source in report.items() if source is not None}


def assert_same(loaded: dict, expected: dict) -> None:
    """Fails unless ``loaded`` has ``expected``'s structure, and its arrays the same kind,
    dtype, shape and bytes (bit-exact)."""
    flat_l = jax.tree_util.tree_leaves_with_path(loaded)
    flat_e = jax.tree_util.tree_leaves_with_path(expected)
    assert [p for p, _ in flat_l] == [p for p, _ in flat_e]
    for (path, a), (_, b) in zip(flat_l, flat_e, strict=True):
        if isinstance(b, np.ndarray | jax.Array):
            assert type(a) is type(b) or isinstance(a, jax.Array) == isinstance(b, jax.Array)
            assert a.dtype == b.dtype and a.shape == b.shape, path
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path
        else:
            assert a == b, path
