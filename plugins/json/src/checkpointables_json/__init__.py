"""checkpointables plugin: JSON-like objects stored as ``<name>/data.json``.

Dicts and lists of strings, numbers, booleans and ``None`` (no arrays) are
claimed by this handler ahead of the generic pytree handler, so they stay
human-readable on disk. The format is Orbax's ``JsonHandler``'s, and
checkpoints name that handler, so Orbax loads them too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable
from typing import Any

import checkpointables as cp
from etils import epath

__all__ = ["JsonHandler", "is_json_like"]

DATA_FILE = "data.json"
# Older file names this handler also reads: Orbax V0's JsonCheckpointHandler.
_LEGACY_FILES = ("metadata",)
# Checkpoints record Orbax's typestr for this handler: Orbax's own JSON handler reads
# data.json exactly as written here (json.loads), so Orbax loads these checkpointables.
ORBAX_TYPESTR = "orbax.checkpoint.experimental.v1._src.handlers.json_handler.JsonHandler"
_READABLE_TYPESTRS = (
    "checkpointables_json.JsonHandler",  # What checkpoints recorded before.
    "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler",
    "orbax.checkpoint.experimental.v1._src.handlers.json_handler.MetricsHandler",
)


def is_json_like(obj: Any, _depth: int = 0) -> bool:
    """Whether ``obj`` round-trips through JSON unchanged: dicts with string keys,
    lists, strings, finite numbers, booleans and ``None``.

    Tuples are excluded (they would come back as lists) and so are NumPy
    values and arrays.
    """
    if _depth > 100:
        return False
    if obj is None or isinstance(obj, bool | str):
        return True
    if type(obj) is int:
        return True
    if type(obj) is float:
        return math.isfinite(obj)
    if type(obj) is list:
        return all(is_json_like(v, _depth + 1) for v in obj)
    if type(obj) is dict:
        return all(isinstance(k, str) and is_json_like(v, _depth + 1) for k, v in obj.items())
    return False


class JsonHandler:
    """Saves JSON-like objects as ``data.json``; loads them back as saved."""

    async def save(
        self, directory: cp.path.PathAwaitingCreation, checkpointable: Any
    ) -> Awaitable[None]:
        """Encodes now (a snapshot), writes in the background on the primary host."""
        text = json.dumps(checkpointable)

        async def write() -> None:
            path = await directory.await_creation()
            if cp.multihost.is_primary_host():
                # Local or object store; the commit flushes every file of the checkpoint.
                cp.storage.write_text(path / DATA_FILE, text)

        return write()

    async def load(
        self, directory: epath.Path, abstract_checkpointable: Any = None
    ) -> Awaitable[Any]:
        """Returns an awaitable that reads the stored object."""
        file = self._find(directory)

        async def read() -> Any:
            # Checked against the checksum recorded when the checkpoint was committed.
            return cp.safe_json.loads(cp.metadata_checksums.read_file(file), source=file)

        return read()

    async def metadata(self, directory: epath.Path) -> Any:
        """JSON objects are their own metadata: returns the stored object."""
        return await (await self.load(directory))

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for JSON-like objects (see ``is_json_like``)."""
        return is_json_like(checkpointable)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """Undecided for everything: the recorded typestr decides."""
        return None

    @staticmethod
    def recognizes(directory: epath.Path) -> bool:
        """Whether ``directory`` looks like a JSON checkpointable (for untyped checkpoints)."""
        return any(cp.storage.is_file(directory / n) for n in (DATA_FILE, *_LEGACY_FILES))

    @staticmethod
    def _find(directory: epath.Path) -> epath.Path:
        for name in (DATA_FILE, *_LEGACY_FILES):
            if cp.storage.is_file(directory / name):
                return directory / name
        raise cp.errors.IntegrityError(
            f"{directory} holds no {DATA_FILE}: it is not a JSON checkpointable, or it was "
            f"damaged. Restore the checkpoint from a copy, or load an older one."
        )


@cp.hookimpl
def register_checkpointable_handlers(register: Any) -> None:
    """Registers the JSON handler ahead of the pytree handler (priority 60 < 90)."""
    register(
        JsonHandler,
        priority=60,
        name="json",
        typestr=ORBAX_TYPESTR,
        secondary_typestrs=_READABLE_TYPESTRS,
    )
