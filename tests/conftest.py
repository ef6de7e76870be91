"""Shared test setup: eight CPU devices for real meshes, before JAX is imported; the
tests' example plugin switched on; the ``fast_path`` marker."""

import os

# Real multi-device meshes on CPU; must be set before jax initializes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The example plugin (tests/example_plugin) registers nothing without it, so that a
# development checkout's command line shows no test plugin; subprocesses inherit it.
os.environ["CHECKPOINTABLES_EXAMPLE_PLUGIN"] = "1"

import contextlib
from collections.abc import Iterator

import attrs
import checkpointables as cp
import pytest
from checkpointables_pytree import FAST_PATH_ENVIRONMENT_VARIABLE


@pytest.fixture(autouse=True)
def _fast_path_where_tested(request: pytest.FixtureRequest):
    """Turns the OCDBT fast path on for tests marked ``fast_path``, even in CI's second run
    of these tests with ``CHECKPOINTABLES_OCDBT_FAST_PATH=0``."""
    if request.node.get_closest_marker("fast_path") is None:
        yield
        return
    with _fast_path_on():
        yield


@pytest.fixture(autouse=True, scope="module")
def _fast_path_for_marked_modules(request: pytest.FixtureRequest):
    """The same for a module marked ``fast_path`` as a whole, so that its module-scoped
    fixtures (checkpoints saved once for every test) are saved with the fast path too."""
    marks = getattr(request.module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    if not any(mark.name == "fast_path" for mark in marks):
        yield
        return
    with _fast_path_on():
        yield


@contextlib.contextmanager
def _fast_path_on() -> Iterator[None]:
    before = cp.context.get_context().array_options  # The global default.
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(FAST_PATH_ENVIRONMENT_VARIABLE, "1")
        cp.configure(array_options=attrs.evolve(before, ocdbt_fast_path=True))
        try:
            yield
        finally:
            cp.configure(array_options=before)
