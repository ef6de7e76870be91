"""``PathAwaitingCreation``: a directory that is being created in the background."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from etils import epath


class _Creation:
    """Runs a directory-creating function once, from whichever thread asks first."""

    def __init__(self, create: Callable[[], None]) -> None:
        self._create = create
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def ensure(self) -> None:
        with self._lock:
            if not self._done:
                try:
                    self._create()
                except BaseException as e:
                    self._error = e
                self._done = True
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return self._done


class PathAwaitingCreation:
    """A directory that will exist once ``await_creation()`` returns.

    ``path`` and ``/`` are safe to use at any time; they never touch the file
    system. Creation is triggered by whoever waits first, so awaiting it from a
    handler's blocking phase is allowed (it simply creates the directory then).

    Example::

        async def save(self, directory, checkpointable):
            async def write():
                path = await directory.await_creation()
                (path / "data.txt").write_text("...")
            return write()
    """

    def __init__(self, path: epath.PathLike, creation: _Creation | Callable[[], None]) -> None:
        self._path = epath.Path(path)
        self._creation = creation if isinstance(creation, _Creation) else _Creation(creation)

    @property
    def path(self) -> epath.Path:
        """The directory's path (it may not exist yet)."""
        return self._path

    @property
    def name(self) -> str:
        """The directory's last path component."""
        return self._path.name

    def __truediv__(self, other: str) -> PathAwaitingCreation:
        return PathAwaitingCreation(self._path / other, self._creation)

    def create_now(self) -> epath.Path:
        """Creates the directory from synchronous code and returns its path."""
        self._creation.ensure()
        return self._path

    async def await_creation(self) -> epath.Path:
        """Waits until the directory exists and returns its path."""
        if not self._creation.done:
            await asyncio.to_thread(self._creation.ensure)
        else:
            self._creation.ensure()
        return self._path

    def __fspath__(self) -> str:
        return str(self._path)

    def __repr__(self) -> str:
        return f"PathAwaitingCreation({str(self._path)!r})"
