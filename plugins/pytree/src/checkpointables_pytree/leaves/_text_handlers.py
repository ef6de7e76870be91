"""The leaf handlers of ``str`` (in ``_strings.json``, as Orbax) and ``bytes`` (uint8 arrays)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Sequence
from typing import Any

import checkpointables as cp
import numpy as np
from checkpointables.serialization import (
    DeserializationContext,
    DeserializationParam,
    SerializationContext,
    SerializationParam,
)

from checkpointables_pytree import storage, tree, zarr3
from checkpointables_pytree.leaves._common import (
    STRING,
    ReadTarget,
    StandardLeafHandler,
    StoredLayout,
    ZarrLeafHandler,
    check_stored_type,
    finish_save,
    load_session,
    save_session,
    schedule_array,
)
from checkpointables_pytree.leaves._metadata import BytesMetadata
from checkpointables_pytree.leaves._options import ArrayStorageOptions
from checkpointables_pytree.leaves._session import LoadSession, SaveSession

__all__ = ["StringLeafHandler", "BytesLeafHandler"]


class StringLeafHandler(StandardLeafHandler):
    """Saves ``str`` leaves in the pytree's ``_strings.json`` (as Orbax does)."""

    async def serialize(
        self, params: Sequence[SerializationParam[str]], serialization_context: SerializationContext
    ) -> Awaitable[None]:
        """Records the strings; they are written with the tree's other files."""
        session, private = save_session(self, serialization_context)
        for param in params:
            session.strings[param.name] = str(param.value)
        return finish_save(session, private)

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[Any]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[str]]:
        """Returns the awaitable that reads the strings."""
        session, _ = load_session(self, deserialization_context)
        for param in params:
            check_stored_type(session.entry(param.keypath), frozenset({STRING}), "a str")

        async def read() -> list[str]:
            strings = session.strings()
            result = []
            for param in params:
                name = session.storage_name(param.keypath)
                if name not in strings:
                    raise storage.integrity_error(
                        session.entry(param.keypath).keystr,
                        f"it is missing from {session.directory / '_strings.json'}",
                    )
                value = strings[name]
                if not isinstance(value, str):  # Orbax's files carry no checksum.
                    raise cp.errors.MetadataError(
                        f"{session.directory / '_strings.json'} holds {_shown(value)} for the "
                        f"string leaf {session.entry(param.keypath).keystr}, not a string: the "
                        f"checkpoint is damaged. Restore it from a copy or load an older one."
                    )
                result.append(value)
            return result

        return read()

    async def metadata(
        self,
        params: Sequence[DeserializationParam[None]],
        deserialization_context: DeserializationContext,
    ) -> Sequence[str]:
        """``""`` for each string leaf (an abstract ``str``)."""
        return ["" for _ in params]


def _shown(value: Any) -> str:
    """A stored value for a message: its type, and its text if short."""
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else type(value).__name__


def _to_bytes(pieces: list[np.ndarray]) -> bytes:
    return pieces[0].tobytes()


def _check_bytes_layout(entry: tree.Entry, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Raises unless a leaf ``_METADATA`` calls bytes is stored as bytes are: 1-D uint8 (its
    length is the shape; the reads check the data holds that many)."""
    if len(shape) != 1 or dtype != np.uint8:
        raise cp.errors.MetadataError(
            f"{entry.keystr}: _METADATA records bytes, but the array stored is {shape} "
            f"{dtype}, not the 1-D uint8 array bytes are stored as: the metadata is damaged. "
            "Restore the checkpoint from a copy, or load the leaf with an array abstract leaf."
        )


def _checked_bytes(entry: tree.Entry) -> Any:
    def convert(pieces: list[np.ndarray]) -> bytes:
        _check_bytes_layout(entry, pieces[0].shape, pieces[0].dtype)
        return pieces[0].tobytes()

    return convert


class BytesLeafHandler(ZarrLeafHandler):
    """Saves ``bytes`` leaves as 1-d uint8 zarr3 arrays; loads ``bytes``.

    ``metadata`` gives a ``BytesMetadata`` for each: ``b""`` (an abstract
    ``bytes``) that knows the stored length.
    """

    loads_as = "bytes"

    def _schedule_writes(
        self, session: SaveSession, params: Sequence[SerializationParam[bytes]]
    ) -> None:
        for param in params:
            data = np.frombuffer(bytes(param.value), dtype=np.uint8)
            shape = (int(data.size),)
            schedule_array(
                session,
                param,
                shape=shape,
                dtype=np.dtype(np.uint8),
                chunk_shape=zarr3.default_chunk_shape(shape),
                chunks=[((0,), data)] if data.size else [],
                storage=ArrayStorageOptions(),
            )

    def _read_target(self, entry: tree.Entry, abstract: Any, stored: Any) -> ReadTarget:
        if abstract is not None:  # Asked for by the caller: any array's bytes.
            return ReadTarget(_to_bytes)
        if stored is None:  # The layout is not recorded: checked once read.
            return ReadTarget(_checked_bytes(entry))
        _check_bytes_layout(entry, stored.shape, stored.dtype)  # Before anything is read.
        return ReadTarget(_to_bytes)

    def _describe(self, session: LoadSession, entry: tree.Entry, layout: StoredLayout) -> Any:
        return BytesMetadata(math.prod(layout.shape))
