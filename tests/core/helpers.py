"""Objects shared by the core tests: a stateful point and handlers that misbehave."""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import checkpointables as cp


@dataclasses.dataclass
class StatefulPoint:
    """A StatefulCheckpointable, as in the custom-handlers guide."""

    x: int
    y: int

    async def save(self, directory: cp.path.PathAwaitingCreation) -> Any:
        values = dataclasses.asdict(self)  # Snapshot now: the caller may change us.

        async def write() -> None:
            path = await directory.await_creation()
            (path / "point.json").write_text(json.dumps(values))

        return write()

    async def load(self, directory: cp.path.Path) -> Any:
        async def read() -> None:
            values = json.loads((directory / "point.json").read_text())
            self.x, self.y = values["x"], values["y"]

        return read()


class Boom:
    """An object only FailingHandler accepts."""


class FailingHandler:
    """Fails in the background phase of save, after writing a file."""

    async def save(self, directory: cp.path.PathAwaitingCreation, checkpointable: Any) -> Any:
        async def write() -> None:
            path = await directory.await_creation()
            (path / "partial.bin").write_bytes(b"half")
            raise OSError("disk on fire")

        return write()

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Any:
        raise AssertionError("never loaded")

    async def metadata(self, directory: Any) -> None:
        return None

    def is_handleable(self, checkpointable: Any) -> bool:
        return isinstance(checkpointable, Boom)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        return None


class Gate:
    """An object whose save/load waits for a threading.Event in the background."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()


class GatedHandler:
    """Blocks its background phases until the object's gate is released."""

    gate: Gate | None = None

    async def save(self, directory: cp.path.PathAwaitingCreation, checkpointable: Gate) -> Any:
        async def write() -> None:
            checkpointable.started.set()
            assert checkpointable.release.wait(30)
            path = await directory.await_creation()
            (path / "gate.txt").write_text("ok")

        return write()

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Any:
        gate = GatedHandler.gate

        async def read() -> str:
            assert gate is not None
            gate.started.set()
            assert gate.release.wait(30)
            return (directory / "gate.txt").read_text()

        return read()

    async def metadata(self, directory: Any) -> None:
        return None

    def is_handleable(self, checkpointable: Any) -> bool:
        return isinstance(checkpointable, Gate)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        return None
