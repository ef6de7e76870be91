"""Protocols: a checkpointable type's handler, or being stateful; pytree readers; and the
optional capabilities a handler may declare.

Core checks optional capabilities with ``isinstance`` against the
runtime-checkable protocols below, never by probing attributes: a handler
has a capability exactly when it defines the protocol's method.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:  # Annotations only: plugin discovery (`checkpointables --help`) needs no etils.
    from etils import epath

    from checkpointables.path import PathAwaitingCreation

__all__ = [
    "CheckpointableHandler",
    "StatefulCheckpointable",
    "PyTreeReader",
    # Optional capabilities of a handler.
    "Recognizing",
    "Finalizable",
    "Verifiable",
    "VerifyNote",
    "Mergeable",
    "CombinesShards",
    "ExplainsUnhandleable",
    "ReportsReuse",
    "typestr",
    "missing_methods",
]

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

    A handler class must be constructible with no arguments. It may also
    declare optional capabilities by meeting the protocols ``Recognizing``,
    ``Finalizable``, ``Verifiable``, ``Mergeable``, ``CombinesShards`` and
    ``ExplainsUnhandleable`` of this module.

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


@runtime_checkable
class PyTreeReader(Protocol):
    """Reads pytrees stored in another format (a file or directory that is not a checkpoint).

    Plugins register readers with the ``register_pytree_readers`` hook.
    ``cp.load_pytree(path)``, ``cp.load_pytree_async`` and
    ``cp.pytree_metadata(path)`` ask them, in ``(priority, name)`` order, for
    any ``path`` that is not a checkpoint directory; the first whose
    ``recognizes`` is true reads it. A reader class must be constructible with
    no arguments. Options (e.g. ``partial_load``) come from
    ``cp.context.get_context().pytree_options``, as for handlers.

    Example (the safetensors plugin)::

        @cp.hookimpl
        def register_pytree_readers(register):
            register(SafetensorsReader, priority=50)
    """

    def recognizes(self, path: epath.Path) -> bool:
        """Whether ``path`` is this reader's format; cheap (names and a stat or two)."""
        ...

    async def load(self, path: epath.Path, abstract_pytree: Any = None) -> Awaitable[Any]:
        """Plans the load (blocking phase); returns the awaitable that reads the pytree.

        ``abstract_pytree`` leaves guide it as for checkpoints: e.g.
        ``jax.ShapeDtypeStruct`` with a sharding gives a ``jax.Array`` on that mesh.
        """
        ...

    async def metadata(self, path: epath.Path) -> Any:
        """A ``cp.CheckpointMetadata`` whose ``.metadata`` is the abstract tree, cheaply."""
        ...


@runtime_checkable
class Recognizing(Protocol):
    """A handler that can tell its own directories, for checkpoints that recorded no handler.

    Older formats (Orbax V0) name no handler in ``_CHECKPOINT_METADATA``; core
    then asks every ``Recognizing`` handler, in resolution order.
    """

    @staticmethod
    def recognizes(directory: epath.Path) -> bool:
        """Whether ``directory`` holds what this handler writes; cheap (a stat or two)."""
        ...


@runtime_checkable
class Finalizable(Protocol):
    """A handler with work to do once every process has written its part of a save."""

    async def finalize(self, directory: epath.Path) -> None:
        """Called once, on the primary host, after every process finished its
        background writes and before the commit (e.g. to merge per-process files)."""
        ...


@runtime_checkable
class Verifiable(Protocol):
    """A handler that checks what it stored (``checkpointables verify``).

    Handlers without it are verified by loading what they stored.
    """

    async def verify(self, directory: epath.Path) -> list[str]:
        """Reads everything back; returns one description per problem found (none: ok),
        and ``VerifyNote``s for what the report says that is no problem."""
        ...


class VerifyNote(str):
    """An entry of ``Verifiable.verify``'s result that the report says without failing the
    check (e.g. that some values carry no checksum and were read unchecked)::

        return problems + [cp.protocols.VerifyNote("2 arrays carry no checksum")]
    """


@runtime_checkable
class Mergeable(Protocol):
    """A handler that builds one checkpointable from several partial saves (``cp.partial``).

    ``cp.partial.finalize`` calls it on the handler named ``pytree``.
    """

    async def merge_partial(self, sources: Sequence[epath.Path], target: epath.Path) -> None:
        """Builds the checkpointable in ``target`` from the partial saves' directories ``sources``
        (oldest first; later ones replace earlier ones' keys).

        Each source is a directory this handler's ``save`` wrote, somewhere inside
        ``target`` (core names the subdirectories, e.g. ``target/partial-000001/pytree``:
        the merge must not depend on those names). The sources stay where they are, so
        the merged result may refer to their files instead of copying them. ``target``
        holds nothing but the sources' subdirectories when this is called (core removes
        what an interrupted earlier merge built); an interrupted merge is called again.
        """
        ...


@runtime_checkable
class CombinesShards(Protocol):
    """A handler that builds one checkpointable from several process-local saves of it,
    each holding different shards of the same global arrays.

    The local tier of ``cp.training.Checkpointer`` saves every process's own shards
    (``MultiprocessingOptions(primary_host=None)``); a restart with fewer processes,
    or onto another mesh, needs shards from several of those saves at once. Core
    then asks the handler of each checkpointable for the union; a handler without
    this capability is loaded from one save only.
    """

    async def combine_shards(self, sources: Sequence[epath.Path], target: epath.Path) -> None:
        """Builds in ``target`` the checkpointable whose arrays hold every shard stored in
        any of ``sources`` (directories this handler's ``save`` wrote for the same item,
        from the same save on different processes); everything that is not an array's
        shard (the tree's structure, values every process holds) is ``sources[0]``'s.

        Each source sits inside ``target`` and stays there while the result is used, so
        the result may refer to the sources' files instead of copying them; the sources
        are read-only (they may be hard links of another checkpoint's files). A shard
        stored in several sources is identical in each (any of them may be used).
        """
        ...


@runtime_checkable
class ExplainsUnhandleable(Protocol):
    """A handler that says why it cannot save an object (shown in ``NoHandlerForObjectError``)."""

    def unhandleable_reason(self, checkpointable: Any) -> str | None:
        """Why ``is_handleable(checkpointable)`` is false (e.g. naming the key paths of
        unsupported leaves), or ``None`` if it is true."""
        ...


@runtime_checkable
class ReportsReuse(Protocol):
    """A handler that says which of its data an incremental save took from an earlier
    checkpoint (``checkpointables inspect``; ``docs/incremental.md``)."""

    def reuse_report(self, directory: epath.Path) -> dict[str, str | None]:
        """Name of each array it tracks -> the checkpoint its data was linked from
        (``None``: written by the save itself). Empty for a save without reuse."""
        ...


def typestr(handler_cls: type) -> str:
    """The string recorded in ``_CHECKPOINT_METADATA`` for a handler class."""
    return f"{handler_cls.__module__}.{handler_cls.__qualname__}"


def missing_methods(cls: type, protocol: type) -> list[str]:
    """The methods of ``protocol`` that ``cls`` lacks (for the message when
    ``issubclass(cls, protocol)`` is false)."""
    wanted = [n for n in vars(protocol) if not n.startswith("_")]
    return sorted(n for n in wanted if not callable(getattr(cls, n, None)))
