"""Loads read an object store's data files in ranges that cut and share arrays."""

from __future__ import annotations

import concurrent.futures

import checkpointables as cp
import jax
import numpy as np
import pytest

# The read-size knob and the copying thread are internals: patched where they live.
from checkpointables_pytree.io import _remote_reads


@pytest.mark.fast_path  # Ranged GETs located by our own index.
def test_ranges_cutting_and_sharing_arrays_load_bit_for_bit_in_concurrent_loads(
    bucket, monkeypatch
) -> None:
    # Ranges of 64 KiB: the large array spans many, and a range holds many small arrays.
    monkeypatch.setattr(_remote_reads, "RANGE_BYTES", 64 << 10)
    copies = []  # One per range, each handed to the copying thread.
    copier = _remote_reads._copier
    monkeypatch.setattr(_remote_reads, "_copier", lambda pid: copies.append(pid) or copier(pid))
    rng = np.random.default_rng(0)
    tree = {"big": rng.random((300, 300)).astype(np.float32), "jax": jax.numpy.arange(70_000.0)}
    tree |= {f"small{i}": rng.random(int(rng.integers(10, 3000))) for i in range(40)}
    path = f"{bucket}/ranges"
    cp.save_pytree(path, tree)
    # Two loads at once, each on its own thread and event loop, share the copying thread.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        loads = list(pool.map(lambda _: cp.load_pytree(path), range(2)))
    assert len(copies) >= 2 * 10, len(copies)
    for loaded in loads:
        assert loaded.keys() == tree.keys()
        for name, expected in tree.items():
            assert type(loaded[name]) is type(expected), name
            np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(expected))
