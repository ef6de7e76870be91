"""Objects shared by the core tests: a stateful point and handlers that misbehave."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st


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


class SaveOnlyHandler:
    """A checkpointable handler whose tests exercise its ``save`` alone: it accepts
    instances of ``handles`` and loads and describes nothing. Subclasses set ``handles``
    and write ``save``."""

    handles: ClassVar[type]

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> None:
        return None

    async def metadata(self, directory: Any) -> None:
        return None

    def is_handleable(self, checkpointable: Any) -> bool:
        return isinstance(checkpointable, self.handles)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> None:
        return None


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


# Values that are neither True nor False, though `if` would take each for one of them.
NOT_BOOLS = st.one_of(
    st.text(max_size=5),
    st.sampled_from(["no", "false", "False", "0", "yes", ""]),
    st.integers(),  # 0 and 1 too: an int is not a bool here.
    st.floats(allow_nan=True),
    st.none(),
    st.binary(max_size=3),
    st.lists(st.booleans(), max_size=2),
    st.sampled_from([np.int64(1), np.float32(0), np.array([True]), jnp.array([False, True])]),
)


def assert_bool_refused(
    call: Callable[[Any], object], argument: str, value: Any, state: Callable[[], object]
) -> None:
    """``call(value)``, ``value`` given as the bool ``argument``, raises
    ``InvalidArgumentTypeError`` naming both, and ``state()`` reads the same after it."""
    before = state()
    with pytest.raises(cp.errors.InvalidArgumentTypeError) as raised:
        call(value)
    message = str(raised.value)
    assert f"{argument}={value!r}" in message and "True or False" in message
    assert isinstance(raised.value, cp.errors.InvalidArgumentError)  # As a bad option's.
    assert state() == before  # Nothing was replaced or written.
