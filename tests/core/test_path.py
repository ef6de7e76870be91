"""PathAwaitingCreation: creation is triggered once, by whoever waits first."""

from __future__ import annotations

import asyncio

import pytest
from checkpointables.path import PathAwaitingCreation


def test_await_creation_creates_once(tmp_path) -> None:
    calls = []

    def create() -> None:
        calls.append(1)
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "sub").mkdir()

    root = PathAwaitingCreation(tmp_path / "d", create)
    child = root / "sub"
    assert child.path == tmp_path / "d" / "sub" and child.name == "sub"
    assert not child.path.exists()

    async def both():
        return await asyncio.gather(root.await_creation(), child.await_creation())

    assert asyncio.run(both()) == [tmp_path / "d", tmp_path / "d" / "sub"]
    assert calls == [1]
    assert root.create_now() == tmp_path / "d"
    assert calls == [1]


def test_creation_error_is_raised_to_every_waiter(tmp_path) -> None:
    def create() -> None:
        raise PermissionError("no")

    root = PathAwaitingCreation(tmp_path / "d", create)
    with pytest.raises(PermissionError):
        asyncio.run(root.await_creation())
    with pytest.raises(PermissionError):
        root.create_now()
