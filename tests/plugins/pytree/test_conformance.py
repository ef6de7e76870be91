"""The core's handler conformance suite, run against the pytree handler."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from checkpointables.testing import HandlerConformance


class TestPyTreeHandlerConformance(HandlerConformance):
    handler_name = "pytree"
    checkpointable_name = "state"

    def make_checkpointables(self) -> list[Any]:
        return [
            {"w": np.arange(6.0).reshape(2, 3), "step": 2, "name": "x"},
            {
                "params": {"j": jnp.ones((2, 2), jnp.bfloat16)},
                "history": [np.int32(1), (2.5, True)],
            },
            np.arange(5),
        ]

    def make_unhandleable(self) -> list[Any]:
        return [{"a": object()}, {"x": [np.zeros(1), {1, 2}]}, object()]

    def abstract_for(self, checkpointable: Any) -> Any:
        return None

    def assert_loaded_equal(self, loaded: Any, original: Any) -> None:
        assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(original)
        for a, b in zip(
            jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(original), strict=True
        ):
            if isinstance(b, np.ndarray | jax.Array):
                assert type(a) is type(b) or isinstance(a, jax.Array)
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                assert type(a) is type(b) and a == b

    def assert_metadata_matches(self, metadata: Any, original: Any) -> None:
        assert jax.tree_util.tree_structure(metadata) == jax.tree_util.tree_structure(original)
        for m, b in zip(
            jax.tree_util.tree_leaves(metadata), jax.tree_util.tree_leaves(original), strict=True
        ):
            if isinstance(b, np.ndarray | jax.Array):
                assert (m.shape, m.dtype) == (b.shape, b.dtype)
            else:
                assert type(m) is type(b)
