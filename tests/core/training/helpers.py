"""Stateful checkpointables for the training tests: values, gates and failures."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import checkpointables as cp

TIMEOUT = 60  # Generous bound on waits for events; never reached when things work.


class Value:
    """A StatefulCheckpointable holding an int, with optional gates and failures.

    ``save_gate``: the background write waits until it is set.
    ``load_gate``: the background read waits until it is set.
    ``fail``: the background write raises it (after writing a partial file).
    ``log``: records ("save-start", v), ("save-end", v), ("load-start", v).
    """

    def __init__(
        self,
        value: int = -1,
        *,
        save_gate: threading.Event | None = None,
        load_gate: threading.Event | None = None,
        fail: BaseException | None = None,
        log: list[tuple[str, int]] | None = None,
    ) -> None:
        self.value = value
        self.save_gate, self.load_gate, self.fail = save_gate, load_gate, fail
        self.log = log if log is not None else []
        self.writing = threading.Event()
        self.reading = threading.Event()

    async def save(self, directory: cp.path.PathAwaitingCreation) -> Any:
        value = self.value
        self.log.append(("save-start", value))

        async def write() -> None:
            path = await directory.await_creation()
            (path / "partial").write_text("x")
            self.writing.set()
            if self.save_gate is not None:
                assert await asyncio.to_thread(self.save_gate.wait, TIMEOUT)
            if self.fail is not None:
                raise self.fail
            (path / "value.txt").write_text(str(value))
            self.log.append(("save-end", value))

        return write()

    async def load(self, directory: cp.path.Path) -> Any:
        async def read() -> None:
            self.reading.set()
            if self.load_gate is not None:
                assert await asyncio.to_thread(self.load_gate.wait, TIMEOUT)
            self.value = int((directory / "value.txt").read_text())
            self.log.append(("load-start", self.value))

        return read()


def load_value(ckptr: cp.training.Checkpointer, step: Any = None) -> int:
    """The value saved as ``{"v": Value(...)}`` at ``step``."""
    return ckptr.load_checkpointables(step, {"v": Value()})["v"].value
