"""Fixtures for the pytree plugin's tests: real 8-device CPU meshes, and the ``orbax`` marker."""

from __future__ import annotations

import jax
import numpy as np
import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Tests against the real orbax-checkpoint package: deselect with -m "not orbax".
    config.addinivalue_line("markers", "orbax: compatibility test against orbax-checkpoint")
    config.addinivalue_line(
        "markers", "fast_path: tests of the OCDBT fast path itself (run with it on, always)"
    )


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    devices = jax.devices()
    count = int(np.prod(shape))
    assert len(devices) >= count, "tests/conftest.py asks XLA for 8 CPU devices"
    return jax.sharding.Mesh(np.array(devices[:count]).reshape(shape), names)


@pytest.fixture
def mesh_4x2() -> jax.sharding.Mesh:
    """Eight devices as a 4x2 mesh with axes ('x', 'y')."""
    return _mesh((4, 2), ("x", "y"))


@pytest.fixture
def mesh_2x4() -> jax.sharding.Mesh:
    """Eight devices as a 2x4 mesh with axes ('x', 'y')."""
    return _mesh((2, 4), ("x", "y"))


@pytest.fixture
def one_device() -> jax.sharding.Sharding:
    """A single-device sharding on the last device (not the default one)."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[-1])
