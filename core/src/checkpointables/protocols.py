"""The two protocols a checkpointable type can meet: a handler, or being stateful."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from etils import epath

from checkpointables.path import PathAwaitingCreation

__all__ = ["CheckpointableHandler", "StatefulCheckpointable", "typestr"]

T = TypeVar("T")
AbstractT = TypeVar("AbstractT")


@runtime_checkable
class CheckpointableHandler(Protocol, Generic[T, AbstractT]):
    """Saves and loads one kind of checkpointable in its own directory.

    Both ``save`` and ``load`` have two phases. The coroutine itself is the
    *blocking* phase: it runs before ``save_*_async`` returns, and must finish
    everything that cannot safely happen later (copying device arrays to host,
    snapshotting mutable state). The awaitable it returns is the *background*
    phase, run on a background thread.

    A handler class must be constructible with no arguments. Optional
    methods used when present:

    - ``recognizes(directory) -> bool`` (a staticmethod): for checkpoints that
      recorded no handler (older formats), whether the directory is this
      handler's.
    - ``async finalize(directory)``: called once, on the primary host, after
      every process finished its background writes and before the commit
      (e.g. to merge per-process files).
    - ``async verify(directory) -> list[str]``: reads everything back and
      describes each problem found (``checkpointables verify``).

    Example::

        class PointHandler(cp.CheckpointableHandler[Point, AbstractPoint]):
            async def save(self, directory, checkpointable):
                data = dataclasses.asdict(checkpointable)      # blocking: copy
                async def write():
                    path = await directory.await_creation()    # background
                    (path / "point.json").write_text(json.dumps(data))
                return write()
            ...
    """

    async def save(self, directory: PathAwaitingCreation, checkpointable: T) -> Awaitable[None]:
        """Snapshots ``checkpointable``; returns the awaitable that writes it."""
        ...

    async def load(
        self, directory: epath.Path, abstract_checkpointable: AbstractT | None = None
    ) -> Awaitable[T]:
        """Plans a load; returns the awaitable that reads and returns the object."""
        ...

    async def metadata(self, directory: epath.Path) -> AbstractT:
        """Returns the abstract form of what is stored, cheaply."""
        ...

    def is_handleable(self, checkpointable: Any) -> bool:
        """Whether this handler can save ``checkpointable``."""
        ...

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """Whether ``abstract_checkpointable`` can guide a load by this handler.

        ``None`` means "cannot tell": the typestr recorded at save time decides.
        """
        ...


@runtime_checkable
class StatefulCheckpointable(Protocol):
    """An object that saves and loads itself.

    ``load`` mutates the object in place; loading needs an instance, passed as
    the abstract checkpointable.
    """

    async def save(self, directory: PathAwaitingCreation) -> Awaitable[None]:
        """Snapshots the object; returns the awaitable that writes it."""
        ...

    async def load(self, directory: epath.Path) -> Awaitable[None]:
        """Returns the awaitable that reads the directory into ``self``."""
        ...


def typestr(handler_cls: type) -> str:
    """The string recorded in ``_CHECKPOINT_METADATA`` for a handler class."""
    return f"{handler_cls.__module__}.{handler_cls.__qualname__}"
