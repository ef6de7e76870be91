"""checkpointables plugin: JSON-like objects stored as ``<name>/data.json``.

Dicts and lists of strings, numbers, booleans and ``None`` (no arrays) are
claimed by this handler ahead of the generic pytree handler, so they stay
human-readable on disk. The format is Orbax's ``JsonHandler``'s, and
checkpoints name that handler, so Orbax loads them too.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Awaitable
from typing import Any

import checkpointables as cp
from etils import epath

__all__ = ["JsonHandler", "is_json_like"]

# Python refuses to convert an int of more digits to text or back (json.dumps and
# json.loads raise ValueError) unless a program raises its limit, which the program
# loading the checkpoint may not have done.
_INT_LIMIT = 10**sys.int_info.default_max_str_digits

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
    values and arrays, and ints of more digits than Python converts to text
    by default (4300), which other handlers (or none) may take.
    """
    if _depth > 100:
        return False
    if obj is None or isinstance(obj, bool | str):
        return True
    if type(obj) is int:
        return -_INT_LIMIT < obj < _INT_LIMIT
    if type(obj) is float:
        return math.isfinite(obj)
    if type(obj) is list:
        return all(is_json_like(v, _depth + 1) for v in obj)
    if type(obj) is dict:
        return all(isinstance(k, str) and is_json_like(v, _depth + 1) for k, v in obj.items())
    return False


def _encode(checkpointable: Any, name: str) -> str:
    """The text of ``data.json``; refuses what JSON cannot hold, or a file over the limit."""
    try:
        text = json.dumps(checkpointable)
    except (TypeError, ValueError, RecursionError) as e:
        raise cp.errors.InvalidArgumentError(
            f"Checkpointable {name!r} cannot be stored as JSON ({e}). Give the JSON handler "
            f"dicts, lists, str, finite floats, bool, None and ints of at most "
            f"{sys.int_info.default_max_str_digits} digits (see is_json_like)."
        ) from None
    limit = cp.metadata_checksums.MAX_FILE_BYTES
    if len(text) > limit:  # json.dumps writes ASCII: one byte a character.
        raise cp.errors.InvalidArgumentError(
            f"Checkpointable {name!r} is {len(text):,} bytes of JSON, more than the {limit:,} "
            f"a {DATA_FILE} may hold (a larger file would not be covered by the checkpoint's "
            f"checksums). Store large data as arrays in a pytree checkpointable, which "
            f"checksums every chunk, and keep the JSON small."
        )
    return text


class JsonHandler:
    """Saves JSON-like objects as ``data.json``; loads them back as saved."""

    async def save(
        self, directory: cp.path.PathAwaitingCreation, checkpointable: Any
    ) -> Awaitable[None]:
        """Encodes now (a snapshot), writes in the background on the primary host."""
        text = _encode(checkpointable, directory.name)

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
            raw = cp.metadata_checksums.read_file(
                file, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES
            )
            return cp.safe_json.loads(raw, source=file)

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
