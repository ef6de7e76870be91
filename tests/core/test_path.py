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


@pytest.mark.parametrize("url", ["memory://x/y", "ftp://host/ckpt", "file:///tmp/ckpt"])
def test_a_path_no_storage_reaches_is_a_library_error(tmp_path, url) -> None:
    import checkpointables as cp

    calls = [
        lambda: cp.save_checkpointables(url, {"config": {"a": 1}}),
        lambda: cp.load_checkpointables(url),
        lambda: cp.pytree_metadata(url),
        lambda: cp.is_checkpoint(url),
        lambda: cp.partial.save(url, {"a": 1}),
        lambda: cp.training.Checkpointer(url),
    ]
    for call in calls:
        with pytest.raises(cp.errors.UnsupportedPathError, match=url.split("://")[0] + "://"):
            call()
    assert isinstance(cp.errors.UnsupportedPathError("x"), ValueError)
    assert cp.path.as_path(tmp_path) == cp.path.Path(tmp_path)
