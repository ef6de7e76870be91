"""``checkpointables inspect`` shows the sharding an array was saved with, as recorded,
whatever devices the inspecting machine has."""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ..python_subprocess import run_python


def test_inspect_on_one_device_shows_the_mesh_of_eight(tmp_path) -> None:
    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")
    if jax.device_count() < 8:
        pytest.skip("the tests' conftest gives this process 8 CPU devices")
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tree = {
        "w": jax.device_put(
            np.ones((16, 64), np.float32), NamedSharding(mesh, PartitionSpec(None, "model"))
        ),
        "v": jax.device_put(
            np.ones((8, 4), np.float32), NamedSharding(mesh, PartitionSpec(("data", "model")))
        ),
    }
    cp.save_pytree(tmp_path / "ckpt", tree)
    code = """
        import sys, jax
        from checkpointables import cli
        assert jax.device_count() == 1, jax.devices()
        sys.exit(cli.main(["inspect", "-q", sys.argv[1]]))
    """
    done = run_python(code, str(tmp_path / "ckpt"), XLA_FLAGS="")
    assert done.returncode == 0, done.stderr
    mesh_text = "sharding: mesh (data=2, model=4)"
    assert (
        f"['w']: ArrayMetadata shape=(16, 64) dtype=float32 {mesh_text} spec P(None, 'model')"
        in (done.stdout)
    )
    assert (
        f"['v']: ArrayMetadata shape=(8, 4) dtype=float32 {mesh_text} spec P(('data', 'model'))"
        in (done.stdout)
    )


def test_inspect_shows_a_single_device_record(tmp_path, capsys) -> None:
    from checkpointables import cli

    try:
        cp.handlers.get("pytree")
    except cp.errors.CheckpointError:
        pytest.skip("needs the pytree plugin (checkpointables-pytree)")
    cp.save_pytree(tmp_path / "one", {"x": jax.device_put(np.zeros(3), jax.devices()[0])})
    assert cli.main(["inspect", "-q", str(tmp_path / "one")]) == 0
    assert "sharding: device cpu:0" in capsys.readouterr().out
