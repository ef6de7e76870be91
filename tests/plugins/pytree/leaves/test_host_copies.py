"""Host copies of a save's snapshot (on CPU devices: views; on GPUs: pinned host memory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree.leaves import host_copies


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_])
def test_copies_equal_their_arrays_and_outlive_them(dtype) -> None:
    arrays = [jnp.arange(n * 7, dtype=jnp.int32).astype(dtype) for n in (1, 1000, 3)]
    expected = [np.array(a) for a in arrays]
    copies = host_copies(arrays)
    for a in arrays:
        a.delete()  # The caller may delete (or donate) its arrays once the copies are made.
    for copy, want in zip(copies, expected, strict=True):
        assert copy.dtype == want.dtype and copy.shape == want.shape
        np.testing.assert_array_equal(copy, want)


def test_arrays_on_several_devices(request) -> None:
    devices = jax.devices()
    arrays = [
        jax.device_put(np.full(5, i, np.float32), devices[i % len(devices)]) for i in range(4)
    ]
    assert [int(c[0]) for c in host_copies(arrays)] == list(range(len(arrays)))
    assert host_copies([]) == []
