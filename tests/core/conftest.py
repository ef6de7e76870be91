"""Fixtures for the core tests."""

from __future__ import annotations

from collections.abc import Iterator

import checkpointables as cp
import pytest

from .helpers import FailingHandler, GatedHandler


@pytest.fixture
def misbehaving_handlers() -> Iterator[None]:
    """Registers the test-only handlers for the duration of one test."""
    cp.handlers.register_handler(FailingHandler, priority=5)
    cp.handlers.register_handler(GatedHandler, priority=6)
    yield
    cp.handlers.unregister_handler(FailingHandler)
    cp.handlers.unregister_handler(GatedHandler)
