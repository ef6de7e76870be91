"""A checkpoint saved sharded over more devices than this process has (16; the tests run
with 8): its metadata says the saved sharding was not rebuilt, and a load that places
such arrays on the default device (no sharding in the abstract tree) warns once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import checkpointables as cp
import jax
import numpy as np
import pytest

P = jax.sharding.PartitionSpec

_SAVE_ON_16_DEVICES = """
import sys
import jax, numpy as np, checkpointables as cp
mesh = jax.make_mesh((16,), ("data",))
on = lambda spec: jax.NamedSharding(mesh, spec)
cp.save_pytree(sys.argv[1], {
    "w": jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4), on(jax.P("data"))),
    "b": jax.device_put(np.ones(3, np.float32), on(jax.P())),
    "step": 3,
})
"""


@pytest.fixture(scope="module")
def saved_on_16(tmp_path_factory):
    """A checkpoint a process with 16 devices saved (a real save, in a subprocess)."""
    path = tmp_path_factory.mktemp("sixteen") / "c"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=16"}
    subprocess.run(
        [sys.executable, "-c", _SAVE_ON_16_DEVICES, str(path)], env=env, check=True, timeout=120
    )
    return path


def test_metadata_repr_says_the_saved_sharding_was_not_rebuilt(saved_on_16) -> None:
    assert jax.device_count() < 16
    metadata = cp.pytree_metadata(saved_on_16).metadata
    assert metadata["w"].sharding is None
    assert repr(metadata["w"]) == (
        "ArrayMetadata(shape=(16, 4), dtype=float32, sharding=None (saved: NamedSharding "
        "over 16 devices, not on this machine's devices))"
    )


def test_metadata_repr_shows_a_rebuilt_sharding(tmp_path, mesh_4x2) -> None:
    w = jax.device_put(np.zeros((8, 4), np.float32), jax.NamedSharding(mesh_4x2, P("x")))
    cp.save_pytree(tmp_path / "c", {"w": w, "one": jax.numpy.ones(2)})
    metadata = cp.pytree_metadata(tmp_path / "c").metadata
    assert metadata["w"].sharding == w.sharding
    assert "sharding=NamedSharding(mesh={'x': 4, 'y': 2}, spec=P('x',))" in repr(metadata["w"])
    assert repr(metadata["one"]).endswith("sharding=SingleDeviceSharding)")


def test_loading_them_onto_one_device_warns_once(saved_on_16, caplog) -> None:
    metadata = cp.pytree_metadata(saved_on_16).metadata
    with caplog.at_level(logging.WARNING, logger="checkpointables.pytree"):
        loaded = cp.load_pytree(saved_on_16, metadata)
    np.testing.assert_array_equal(loaded["w"], np.arange(64, dtype=np.float32).reshape(16, 4))
    warnings = [r.getMessage() for r in caplog.records if "sharded over more" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f"2 array(s) of {saved_on_16 / 'pytree'} were saved sharded over more devices than "
        f"this process has ({jax.device_count()})"
    )
    assert "(['b'], ['w'])" in warnings[0] and "docs/multi-host.md" in warnings[0]


def test_no_warning_where_the_load_says_where_arrays_go(saved_on_16, mesh_2x4, caplog) -> None:
    on = lambda spec: jax.NamedSharding(mesh_2x4, spec)  # noqa: E731
    abstract = {
        "w": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=on(P("x"))),
        "b": jax.ShapeDtypeStruct((3,), np.float32, sharding=on(P())),
        "step": 0,
    }
    with caplog.at_level(logging.WARNING, logger="checkpointables.pytree"):
        loaded = cp.load_pytree(saved_on_16, abstract)
        cp.load_pytree(saved_on_16)  # No abstract tree: the default device, as documented.
    assert loaded["w"].sharding == abstract["w"].sharding
    assert not [r for r in caplog.records if "sharded over more" in r.getMessage()]
