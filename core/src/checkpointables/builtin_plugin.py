"""The core's own plugin: the handler for objects with ``save``/``load`` methods.

It is registered through the ``checkpointables`` entry point of the core
distribution, like any third-party plugin.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from etils import epath

from checkpointables import errors
from checkpointables.hookspecs import hookimpl
from checkpointables.path import PathAwaitingCreation
from checkpointables.protocols import StatefulCheckpointable

_ORBAX_TYPESTR = (
    "orbax.checkpoint.experimental.v1._src.handlers.stateful_checkpointable_handler."
    "StatefulCheckpointableHandler"
)


def _is_stateful(obj: Any) -> bool:
    return not isinstance(obj, type) and isinstance(obj, StatefulCheckpointable)


class StatefulCheckpointableHandler:
    """Saves and loads objects that implement ``cp.StatefulCheckpointable``.

    The object writes its own files in ``save``; loading needs an instance (the
    abstract checkpointable), which ``load`` fills in place and returns.
    """

    async def save(
        self, directory: PathAwaitingCreation, checkpointable: Any
    ) -> Awaitable[None] | None:
        """Runs the object's blocking phase and returns its background phase."""
        return await checkpointable.save(directory)

    async def load(
        self, directory: epath.Path, abstract_checkpointable: Any = None
    ) -> Awaitable[Any]:
        """Returns an awaitable that loads into ``abstract_checkpointable`` and returns it."""
        if not _is_stateful(abstract_checkpointable):
            raise errors.InvalidArgumentError(
                f"The checkpointable in {directory} was saved by a stateful object's own save(); "
                f"to load it, pass an instance of that object as its abstract checkpointable, e.g. "
                f"load_checkpointables(path, {{{directory.name!r}: MyObject(...)}})."
            )
        pending = await abstract_checkpointable.load(directory)

        async def finish() -> Any:
            if pending is not None:
                await pending
            return abstract_checkpointable

        return finish()

    async def metadata(self, directory: epath.Path) -> None:
        """Stateful objects describe nothing on their own: always ``None``."""
        return None

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for instances with ``save`` and ``load`` methods."""
        return _is_stateful(checkpointable)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """True for instances to load into; ``None`` (undecided) otherwise."""
        return True if _is_stateful(abstract_checkpointable) else None


@hookimpl
def register_checkpointable_handlers(register: Any) -> None:
    """Registers the stateful handler ahead of generic ones (priority 20)."""
    register(
        StatefulCheckpointableHandler,
        priority=20,
        name="stateful",
        secondary_typestrs=(_ORBAX_TYPESTR,),
    )
