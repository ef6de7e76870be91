"""An abstract leaf whose sharding cannot split its shape is refused while the load plans."""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
import pytest

P = jax.sharding.PartitionSpec


@pytest.fixture
def mesh_8() -> jax.sharding.Mesh:
    """Eight CPU devices on one axis 'x' (tests/conftest.py asks XLA for them)."""
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))


def test_a_sharding_that_cannot_split_the_shape_names_leaf_shape_and_sharding(
    tmp_path, mesh_8
) -> None:
    path = tmp_path / "ckpt"
    cp.save_pytree(path, {"b": np.arange(8.0), "layer": {"w": np.ones((4, 3), np.float32)}})
    fits = jax.sharding.NamedSharding(mesh_8, P("x"))
    bad = jax.sharding.NamedSharding(mesh_8, P(None, "x"))
    abstract = {
        "b": jax.ShapeDtypeStruct((8,), np.float64, sharding=fits),
        "layer": {"w": jax.ShapeDtypeStruct((4, 3), np.float32, sharding=bad)},
    }
    # Raised by the call itself (the planning), not by .result() (the reads).
    with pytest.raises(cp.errors.InvalidArgumentError) as info:
        cp.load_pytree_async(path, abstract)
    message = str(info.value)
    assert message.startswith(
        f"The abstract leaf ['layer']['w'] asks for shape (4, 3) with sharding {bad}, which "
        "cannot split that shape: dimension 1 (size 3) is split into 8 parts by mesh axis 'x'."
    )
    assert "(e.g. P(None, None), which leaves those dimensions whole)" in message
    assert isinstance(info.value, ValueError)
    # As the message says: a spec that fits loads.
    abstract["layer"]["w"] = jax.ShapeDtypeStruct(
        (4, 3), np.float32, sharding=jax.sharding.NamedSharding(mesh_8, P(None, None))
    )
    loaded = cp.load_pytree(path, abstract)
    assert loaded["layer"]["w"].sharding.spec == P(None, None)
    np.testing.assert_array_equal(loaded["layer"]["w"], np.ones((4, 3), np.float32))


def test_only_the_dimensions_that_do_not_divide_are_named(tmp_path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    path = tmp_path / "ckpt"
    cp.save_pytree(path, {"w": np.zeros((6, 6), np.float32)})

    def refused(spec: P) -> str:
        sharding = jax.sharding.NamedSharding(mesh, spec)
        with pytest.raises(cp.errors.InvalidArgumentError) as info:
            cp.load_pytree(path, {"w": jax.ShapeDtypeStruct((6, 6), np.float32, sharding=sharding)})
        return str(info.value)

    message = refused(P("data", "model"))
    assert "dimension 1 (size 6) is split into 4 parts by mesh axis 'model'" in message
    assert "dimension 0" not in message and "e.g. P('data', None)" in message
    message = refused(P(None, ("data", "model")))
    assert "dimension 1 (size 6) is split into 8 parts by mesh axes ('data', 'model')" in message
