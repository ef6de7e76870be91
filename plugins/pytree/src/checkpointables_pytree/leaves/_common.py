"""What the standard leaf handlers share: sessions, storage options, and the zarr3 leaf's life.

Arrays, scalars and bytes are zarr3 arrays in the pytree's OCDBT database;
``ZarrLeafHandler`` holds what their handlers do alike (schedule the writes,
schedule the reads, describe what is stored), so each kind's handler says
only what is its own: how a value becomes chunks, how read chunks become a
value, and what ``cp.pytree_metadata`` shows for it.

Any array-like stored leaf loads into any array-like abstract leaf: a stored
``np.ndarray`` loads as a ``jax.Array`` given a ``jax.ShapeDtypeStruct``, a
stored ``jax.Array`` as NumPy given ``np.empty(...)``, a stored int as a float
given ``0.0``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import checkpointables as cp
import numpy as np
from checkpointables.serialization import (
    DeserializationContext,
    DeserializationParam,
    SerializationContext,
    SerializationParam,
)

from checkpointables_pytree import tree as tree_room
from checkpointables_pytree import zarr3
from checkpointables_pytree.io import ArrayRead
from checkpointables_pytree.leaves._options import ArrayStorageOptions, check_shard_axes
from checkpointables_pytree.leaves._session import LoadSession, SaveSession
from checkpointables_pytree.zarr3 import ArrayWrite, zarr_shape_dtype

__all__ = [
    "on_cpu",
    "JAX_ARRAY",
    "NUMPY_ARRAY",
    "SCALAR",
    "STRING",
    "BYTES",
    "ARRAY_VALUE_TYPES",
    "StandardLeafHandler",
    "ZarrLeafHandler",
    "ReadTarget",
    "StoredLayout",
]

# value_type strings in _METADATA (the first four are Orbax's).
JAX_ARRAY, NUMPY_ARRAY, SCALAR, STRING, BYTES = (
    "jax.Array",
    "np.ndarray",
    "scalar",
    "string",
    "bytes",
)
# Stored as zarr arrays, so loadable into any array-like abstract leaf.
ARRAY_VALUE_TYPES = frozenset({JAX_ARRAY, NUMPY_ARRAY, SCALAR, BYTES})


def _what(keypath: Sequence[Any]) -> str:
    names = tree_room.key_names(keypath)
    return f"leaf {tree_room.keystr(names, [tree_room.key_type(k) for k in keypath])}"


class LeafLabel:
    """Names a leaf in errors; the key path is formatted only if an error needs it."""

    __slots__ = ("keypath",)

    def __init__(self, keypath: Sequence[Any]) -> None:
        self.keypath = keypath

    def __str__(self) -> str:
        return _what(self.keypath)


def unsupported(keypath: Sequence[Any], value: Any, why: str) -> cp.errors.NoHandlerForObjectError:
    """The error for a leaf its handler cannot save, and ``why``."""
    return cp.errors.NoHandlerForObjectError(
        f"Cannot save {_what(keypath)} of type "
        f"{type(value).__module__}.{type(value).__qualname__}: {why}"
    )


def check_stored_type(entry: tree_room.Entry, allowed: frozenset[str], wanted: str) -> None:
    """Raises unless the leaf was saved as one of ``allowed`` (so it can load as ``wanted``)."""
    if entry.value_type not in allowed:
        raise cp.errors.TreeMismatchError(
            f"{entry.keystr} was saved as {entry.value_type!r}; it cannot be loaded as {wanted}. "
            "Use an abstract leaf of the saved kind (see "
            "cp.pytree_metadata), or cp.PLACEHOLDER to skip it."
        )


# -- Sessions ---------------------------------------------------------------------------
# PyTreeHandler hands its session to the leaf handlers; one called directly makes its own
# and runs it inside the awaitable it returns.


def save_session(
    handler: StandardLeafHandler, ctx: SerializationContext
) -> tuple[SaveSession, bool]:
    """The save's session, and whether it is this handler's own (``True``: it must run it)."""
    session = getattr(ctx, "session", None)
    if session is not None:
        return session, False
    return SaveSession.create(ctx.parent_dir, cp.context.get_context(handler._context)), True


def load_session(
    handler: StandardLeafHandler, ctx: DeserializationContext
) -> tuple[LoadSession, bool]:
    """The load's session, and whether it is this handler's own (``True``: it must run it)."""
    session = getattr(ctx, "session", None)
    if session is not None:
        return session, False
    tree = tree_room.read_tree_metadata(ctx.parent_dir)
    return LoadSession(ctx.parent_dir, tree, cp.context.get_context(handler._context)), True


async def finish_save(session: SaveSession, private: bool) -> None:
    """The awaitable a leaf handler's ``serialize`` returns: runs a private session."""
    if private:
        await session.run(write_files=True)


async def finish_load(session: LoadSession, private: bool, reads: list[ArrayRead]) -> list[Any]:
    """The awaitable a leaf handler's ``deserialize`` returns: the values its reads made."""
    if private:
        await session.reader.run()
    return [r.result for r in reads]


# -- Storage ------------------------------------------------------------------------------


def storage_options(
    session: SaveSession, keypath: Sequence[Any], value: Any
) -> ArrayStorageOptions:
    """The storage options of one leaf, from the save's array options."""
    options = session.array_options
    creator = options.storage_options_creator
    if creator is not None:
        chosen = creator(tuple(keypath), value)
        if chosen is not None:
            if not isinstance(chosen, ArrayStorageOptions):
                raise cp.errors.InvalidArgumentTypeError(
                    "storage_options_creator returned "
                    f"{type(chosen).__name__} for {_what(keypath)}; "
                    f"it must return cp.options.ArrayStorageOptions or None."
                )
            return chosen
    return options.storage_options


def storage_dtype(
    keypath: Sequence[Any], value: Any, dtype: Any, storage: ArrayStorageOptions
) -> np.dtype:
    """The dtype a leaf is stored in: the storage options', else its own (if zarr3 has it)."""
    try:
        target = np.dtype(storage.dtype) if storage.dtype is not None else np.dtype(dtype)
    except TypeError:
        raise unsupported(
            keypath,
            value,
            f"its dtype {dtype} has no NumPy equivalent; register a leaf handler for it",
        ) from None
    if zarr3.zarr_dtype_name(target) is None:
        raise unsupported(
            keypath,
            value,
            f"TensorStore's zarr3 driver has no {target} data type; convert the array to "
            f"one it has (e.g. uint8, or int4 for 4-bit values), or register a leaf handler "
            f"for it",
        )
    return target


def on_cpu(array: Any) -> bool:
    """Whether the ``jax.Array`` ``array`` is on CPU devices (its host form is a view of their
    buffers, not a copy). Read from its sharding: valid after the array was deleted."""
    return bool(next(iter(array.sharding.device_set)).platform == "cpu")


def schedule_array(
    session: SaveSession,
    param: SerializationParam[Any],
    *,
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunk_shape: tuple[int, ...],
    chunks: list[tuple[tuple[int, ...], np.ndarray]],
    storage: ArrayStorageOptions,
    extra: dict[str, Any] | None = None,
    held_by_every_process: bool = True,
    staged: bool = True,
) -> ArrayWrite:
    """Schedules one array's chunks and records its metadata in the session; returns its write.

    In a multi-process save, a value every process holds (``held_by_every_process``)
    and every array's ``zarr.json`` are written by the primary host alone. ``staged``:
    the chunks are host memory the save made (copies, casts), counted in the writer's
    ``staging`` until the writes end; ``False``: the caller's or a CPU device's memory.
    """
    check_shard_axes(storage, chunk_shape, dtype.itemsize, LeafLabel(param.keypath))
    primary = session.primary
    if held_by_every_process and not primary:
        chunks = []
    if staged and chunks:
        session.writer.staging.hold(sum(data.nbytes for _, data in chunks))
    compression = session.compression
    inner = zarr3.inner_chunk_shape(
        chunk_shape, dtype.itemsize, storage.chunk_byte_size, storage.shard_axes
    )
    layout, recorded = zarr3.planned_layout(param.name, shape, dtype, chunk_shape)
    recorded["one_chunk_shards"] = inner is None and not compression
    if extra:
        recorded.update(extra)
    item = ArrayWrite(
        LeafLabel(param.keypath),
        layout,
        chunks,
        inner_chunk_shape=inner,
        compression=compression,
        write_metadata=primary,
    )
    session.writer.add(item)
    session.extras[param.name] = recorded
    return item


# -- The handlers' common part ----------------------------------------------------------------


@attrs.define  # Not frozen: one is made per leaf of a load, and frozen ones cost twice as much.
class ReadTarget:
    """What a load wants of a stored array: the conversion of its read regions into the leaf.

    ``shape`` is the shape asked for (``None``: as stored), ``regions`` the
    parts of it to read (``None``: all of it).
    """

    convert: Callable[[list[np.ndarray]], Any]
    shape: tuple[int, ...] | None = None
    regions: list[tuple[slice, ...]] | None = None
    sink: Any = None  # Under a host-memory budget: takes the array piece by piece.


@attrs.frozen
class StoredLayout:
    """A stored array's shape, dtype and chunk shape (``None``: not recorded)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...] | None


async def stored_layouts(
    session: LoadSession, params: Sequence[DeserializationParam[Any]]
) -> list[StoredLayout]:
    """The layouts of stored arrays (recorded in ``_METADATA``, or read from zarr metadata)."""
    found: list[StoredLayout | None] = []
    unknown: list[str] = []
    for param in params:
        stored = session.stored_array(session.entry(param.keypath))
        if stored is not None:
            found.append(StoredLayout(stored.shape, stored.dtype, stored.chunk_shape))
        else:
            found.append(None)
            unknown.append(session.storage_name(param.keypath))
    if unknown:
        documents = await session.zarr_metadata(unknown)
        for i, param in enumerate(params):
            if found[i] is None:
                name = session.storage_name(param.keypath)
                where = f"{session.directory}: {_what(param.keypath)}: the zarr.json of {name!r}"
                layout = StoredLayout(*zarr_shape_dtype(documents[name], where=where))
                _check_write_shape(session, param, name, layout)
                found[i] = layout
    return found  # type: ignore[return-value]


def _check_write_shape(
    session: LoadSession, param: DeserializationParam[Any], name: str, layout: StoredLayout
) -> None:
    """Refuses a ``zarr.json`` that contradicts the ``write_shape`` Orbax recorded."""
    entry = session.entry(param.keypath)
    problem = zarr3.record_contradiction(
        layout.shape, layout.dtype, layout.chunk_shape, write_shape=entry.write_shape
    )
    if problem is not None:
        raise zarr3.contradiction_error(entry.keystr, session.directory, name, problem)


class StandardLeafHandler:
    """Shared constructor: leaf handlers are built with ``context=`` (a ``cp.Context``)."""

    def __init__(self, context: cp.Context | None = None) -> None:
        self._context = context


class ZarrLeafHandler(StandardLeafHandler):
    """A leaf handler storing each leaf as a zarr3 array of the pytree's database.

    Subclasses say how values become chunks (``_schedule_writes``), how read
    chunks become a value (``_read_target``) and what is stored (``_describe``).
    """

    # How errors name what the handler loads ("a jax.Array").
    loads_as = "an array"

    async def serialize(
        self, params: Sequence[SerializationParam[Any]], serialization_context: SerializationContext
    ) -> Awaitable[None]:
        """Takes what the writes need from the leaves now; returns the awaitable that writes."""
        session, private = save_session(self, serialization_context)
        self._schedule_writes(session, params)
        return finish_save(session, private)

    def _schedule_writes(
        self, session: SaveSession, params: Sequence[SerializationParam[Any]]
    ) -> None:
        raise NotImplementedError

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[Any]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[Any]]:
        """Schedules the reads; returns the awaitable that yields the leaves."""
        session, private = load_session(self, deserialization_context)
        reads = self._schedule_reads(session, params)
        return finish_load(session, private, reads)

    def _schedule_reads(
        self, session: LoadSession, params: Sequence[DeserializationParam[Any]]
    ) -> list[ArrayRead]:
        """An ``ArrayRead`` per leaf, added to the session's reader (a load of many small
        arrays makes thousands: what is the same for all is looked up once)."""
        leaf, read_target = session.leaf, self._read_target
        allow_resize, types = session.allow_resize, ARRAY_VALUE_TYPES
        reads = []
        for param in params:
            entry, name, stored, keys = leaf(param.keypath, getattr(param, "names", None))
            if entry.value_type not in types:
                check_stored_type(entry, types, self.loads_as)
            target = read_target(entry, param.value, stored)
            read = ArrayRead(
                entry,
                name,
                stored,
                target.convert,
                target.shape,
                target.regions,
                allow_resize,
                target.sink,
            )
            read.keys = keys
            reads.append(read)
        session.reader.add_all(reads)
        return reads

    def _schedule_read(self, session: LoadSession, param: DeserializationParam[Any]) -> ArrayRead:
        """The ``ArrayRead`` of one leaf, added to the session's reader."""
        return self._schedule_reads(session, [param])[0]

    def _read_target(self, entry: tree_room.Entry, abstract: Any, stored: Any) -> ReadTarget:
        raise NotImplementedError

    async def metadata(
        self,
        params: Sequence[DeserializationParam[None]],
        deserialization_context: DeserializationContext,
    ) -> Sequence[Any]:
        """What each stored leaf is (its abstract leaf); reads no array data."""
        session, _ = load_session(self, deserialization_context)
        layouts = await stored_layouts(session, params)
        return [
            self._describe(session, session.entry(p.keypath), layout)
            for p, layout in zip(params, layouts, strict=True)
        ]

    def _describe(self, session: LoadSession, entry: tree_room.Entry, layout: StoredLayout) -> Any:
        raise NotImplementedError
