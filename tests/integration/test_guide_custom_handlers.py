"""The checkpointable examples of the custom-handlers guide, with `cp.` for `ocp.`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiofiles
import checkpointables as cp
import numpy as np
import pytest


@dataclasses.dataclass
class StatefulPoint(cp.StatefulCheckpointable):
    x: int
    y: int

    async def save(self, directory: cp.path.PathAwaitingCreation):
        return self._background_save(directory, dataclasses.asdict(self))

    async def load(self, directory: cp.path.Path):
        return self._background_load(directory)

    async def _background_save(self, directory, value):
        if cp.multihost.process_index() == 0:
            directory = await directory.await_creation()
            async with aiofiles.open(directory / "point.txt", "w") as f:
                await f.write(json.dumps(value))

    async def _background_load(self, directory):
        async with aiofiles.open(directory / "point.txt") as f:
            contents = json.loads(await f.read())
            self.x = contents["x"]
            self.y = contents["y"]


@dataclasses.dataclass
class Point:
    x: int | float
    y: int | float


@dataclasses.dataclass
class AbstractPoint:
    x: type
    y: type


class PointHandler(cp.CheckpointableHandler[Point, AbstractPoint]):
    async def _background_save(self, directory, checkpointable):
        directory = await directory.await_creation()

        async def write(name, value):
            async with aiofiles.open(directory / name, "w") as f:
                await f.write(json.dumps(value))

        await asyncio.gather(
            write("point.txt", checkpointable),
            write("point_metadata.txt", {k: type(v).__name__ for k, v in checkpointable.items()}),
        )

    async def _background_load(self, directory, abstract_checkpointable=None):
        async with aiofiles.open(directory / "point.txt") as f:
            contents = json.loads(await f.read())
        if abstract_checkpointable is None:
            return Point(**contents)
        return Point(
            abstract_checkpointable.x(contents["x"]), abstract_checkpointable.y(contents["y"])
        )

    async def save(self, directory, checkpointable):
        return self._background_save(directory, dataclasses.asdict(checkpointable))

    async def load(self, directory, abstract_checkpointable=None):
        return self._background_load(directory, abstract_checkpointable)

    async def metadata(self, directory) -> AbstractPoint:
        async with aiofiles.open(directory / "point_metadata.txt") as f:
            contents = json.loads(await f.read())
        return AbstractPoint(**{k: {"int": int, "float": float}[v] for k, v in contents.items()})

    def is_handleable(self, checkpointable: Any) -> bool:
        return isinstance(checkpointable, Point)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool:
        return isinstance(abstract_checkpointable, AbstractPoint)


@pytest.fixture
def point_handler():
    cp.handlers.register_handler(PointHandler)
    yield
    cp.handlers.unregister_handler(PointHandler)


def test_stateful_point(tmp_path) -> None:
    cp.save_checkpointables(
        tmp_path / "ckpt1", {"extra": {"step": 3}, "point": StatefulPoint(1, 2)}
    )
    uninitialized = StatefulPoint(0, 0)
    cp.load_checkpointables(tmp_path / "ckpt1", {"point": uninitialized})
    assert uninitialized == StatefulPoint(1, 2)


def test_point_handler(tmp_path, point_handler) -> None:
    cp.save_checkpointables(tmp_path / "ckpt2", {"extra": {"a": 1}, "point": Point(1, 2.4)})
    assert cp.load_checkpointables(tmp_path / "ckpt2")["point"] == Point(1, 2.4)
    loaded = cp.load_checkpointables(tmp_path / "ckpt2", {"point": AbstractPoint(x=float, y=int)})
    assert loaded["point"] == Point(1.0, 2) and isinstance(loaded["point"].x, float)
    assert cp.checkpointables_metadata(tmp_path / "ckpt2").metadata["point"] == AbstractPoint(
        int, float
    )


def test_unregistered_point_fails_with_a_clear_error(tmp_path) -> None:
    with pytest.raises(cp.errors.NoHandlerForObjectError, match="'point'"):
        cp.save_checkpointables(tmp_path / "c", {"point": Point(1, 2), "arr": {"a": 1}})


def test_point_next_to_arrays_needs_pytree_plugin(tmp_path, point_handler) -> None:
    pytest.importorskip("checkpointables_pytree")
    try:
        cp.handlers.get("pytree")
    except cp.errors.MissingHandlerError:
        pytest.skip("pytree plugin not registered yet")
    model_state = {"params": np.arange(16), "opt_state": np.ones(16)}
    cp.save_checkpointables(tmp_path / "c", {"model_state": model_state, "point": Point(1, 2)})
    loaded = cp.load_checkpointables(tmp_path / "c")
    np.testing.assert_array_equal(loaded["model_state"]["params"], np.arange(16))
    assert loaded["point"] == Point(1, 2)
