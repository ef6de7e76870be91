"""Shared test setup: eight CPU devices for real meshes, before JAX is imported; the
``fast_path`` marker."""

import os

# Real multi-device meshes on CPU; must be set before jax initializes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import attrs
import checkpointables as cp
import pytest
from checkpointables_pytree import FAST_PATH_ENVIRONMENT_VARIABLE


@pytest.fixture(autouse=True)
def _fast_path_where_tested(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Turns the OCDBT fast path on for tests marked ``fast_path``, even in CI's second run
    of these tests with ``CHECKPOINTABLES_OCDBT_FAST_PATH=0``."""
    if request.node.get_closest_marker("fast_path") is None:
        yield
        return
    monkeypatch.setenv(FAST_PATH_ENVIRONMENT_VARIABLE, "1")
    before = cp.context.get_context().array_options  # The global default.
    cp.configure(array_options=attrs.evolve(before, ocdbt_fast_path=True))
    try:
        yield
    finally:
        cp.configure(array_options=before)
