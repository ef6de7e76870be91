"""The standard leaf handlers: ``jax.Array``, ``np.ndarray``, scalars, strings and bytes.

Arrays and scalars are zarr3 arrays in the pytree's OCDBT database; strings
live in ``_strings.json``. Their ``value_type``\\ s are Orbax's (``jax.Array``,
``np.ndarray``, ``scalar``, ``string``) plus ``bytes``, which Orbax cannot save.

Any array-like stored leaf loads into any array-like abstract leaf: a stored
``np.ndarray`` loads as a ``jax.Array`` given a ``jax.ShapeDtypeStruct``, a
stored ``jax.Array`` as NumPy given ``np.empty(...)``, a stored int as a float
given ``0.0``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax
import numpy as np
from checkpointables.serialization import (
    DeserializationContext,
    DeserializationParam,
    SerializationContext,
    SerializationParam,
)

from checkpointables_pytree import (
    _errors,
    _multiprocess,
    _sharding,
    _tree,
    _tree_metadata,
    _zarr3,
)
from checkpointables_pytree._array_reads import ArrayRead
from checkpointables_pytree._leaf_metadata import ArrayMetadata, NumpyMetadata, StorageMetadata
from checkpointables_pytree._session import LoadSession, SaveSession, zarr_shape_dtype
from checkpointables_pytree._write import ArrayWrite

__all__ = [
    "ArrayLeafHandler",
    "NumpyLeafHandler",
    "ScalarLeafHandler",
    "StringLeafHandler",
    "BytesLeafHandler",
    "JAX_ARRAY",
    "NUMPY_ARRAY",
    "SCALAR",
    "STRING",
    "BYTES",
    "ARRAY_VALUE_TYPES",
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
_PYTHON_SCALARS: dict[str, type] = {"int": int, "float": float, "bool": bool, "complex": complex}


def _what(keypath: Sequence[Any]) -> str:
    return f"leaf {_tree.keystr(_tree.key_names(keypath), [_tree.key_type(k) for k in keypath])}"


class _LeafLabel:
    """Names a leaf in errors; the key path is formatted only if an error needs it."""

    __slots__ = ("keypath",)

    def __init__(self, keypath: Sequence[Any]) -> None:
        self.keypath = keypath

    def __str__(self) -> str:
        return _what(self.keypath)


def _unsupported(keypath: Sequence[Any], value: Any, why: str) -> cp.errors.NoHandlerForObjectError:
    return cp.errors.NoHandlerForObjectError(
        f"Cannot save {_what(keypath)} of type "
        f"{type(value).__module__}.{type(value).__qualname__}: {why}"
    )


def _context(own: cp.Context | None) -> cp.Context:
    return own if own is not None else cp.context.get_context()


# -- Sessions ---------------------------------------------------------------------------


def _save_session(handler: Any, ctx: SerializationContext) -> tuple[SaveSession, bool]:
    session = getattr(ctx, "session", None)
    if session is not None:
        return session, False
    return SaveSession.create(ctx.parent_dir, _context(handler._context)), True


def _load_session(handler: Any, ctx: DeserializationContext) -> tuple[LoadSession, bool]:
    session = getattr(ctx, "session", None)
    if session is not None:
        return session, False
    tree = _tree_metadata.read_tree_metadata(ctx.parent_dir)
    return LoadSession(ctx.parent_dir, tree, _context(handler._context)), True


async def _finish_save(session: SaveSession, private: bool) -> None:
    if private:
        await session.run(write_files=True)


def _check_stored_type(entry: _tree_metadata.Entry, allowed: frozenset[str], wanted: str) -> None:
    if entry.value_type not in allowed:
        raise cp.errors.TreeMismatchError(
            f"{entry.keystr} was saved as {entry.value_type!r}; it cannot be loaded as {wanted}. "
            "Use an abstract leaf of the saved kind (see "
            "cp.pytree_metadata), or cp.PLACEHOLDER to skip it."
        )


# -- Array options ------------------------------------------------------------------------


def _storage_options(
    options: cp.options.ArrayOptions, keypath: Sequence[Any], value: Any
) -> cp.options.ArrayStorageOptions:
    """The storage options of one leaf, from the save's array options."""
    creator = options.storage_options_creator
    if creator is not None:
        chosen = creator(tuple(keypath), value)
        if chosen is not None:
            if not isinstance(chosen, cp.options.ArrayStorageOptions):
                raise cp.errors.InvalidArgumentTypeError(
                    "storage_options_creator returned "
                    f"{type(chosen).__name__} for {_what(keypath)}; "
                    f"it must return cp.options.ArrayStorageOptions or None."
                )
            return chosen
    return options.storage_options


def choose_inner_chunk_shape(
    write_shape: Sequence[int], itemsize: int, target_bytes: int, shard_axes: Sequence[int] = ()
) -> tuple[int, ...]:
    """Splits ``write_shape`` into chunks of at most ``target_bytes`` that divide it evenly.

    Axes in ``shard_axes`` are split first, then the largest remaining ones;
    each split takes the next smaller divisor of that dimension.
    """
    shape = [int(s) for s in write_shape]
    chunk = list(shape)
    ndim = len(shape)
    preferred = [a % ndim for a in shard_axes] if ndim else []

    def smaller_divisor(axis: int) -> int | None:
        for d in range(chunk[axis] - 1, 0, -1):
            if shape[axis] % d == 0:
                return d
        return None

    while math.prod(chunk) * itemsize > target_bytes:
        axes = [a for a in preferred if chunk[a] > 1] or sorted(
            (a for a in range(ndim) if chunk[a] > 1), key=lambda a: -chunk[a]
        )
        for axis in axes:
            divisor = smaller_divisor(axis)
            if divisor is not None:
                chunk[axis] = divisor
                break
        else:
            break
    return tuple(chunk)


def _plan_array(
    session: SaveSession,
    param: SerializationParam[Any],
    *,
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunk_shape: tuple[int, ...],
    chunks: list[tuple[tuple[int, ...], np.ndarray]],
    storage: cp.options.ArrayStorageOptions,
    extra: dict[str, Any] | None = None,
    held_by_every_process: bool = True,
) -> None:
    """Schedules one array's chunks and records its metadata in the session.

    In a multi-process save, a value every process holds (``held_by_every_process``)
    and every array's ``zarr.json`` are written by the primary host alone.
    """
    primary = session.primary
    if held_by_every_process and not primary:
        chunks = []
    compression = session.compression
    inner: tuple[int, ...] | None = None
    if storage.chunk_byte_size:
        inner = choose_inner_chunk_shape(
            chunk_shape, dtype.itemsize, int(storage.chunk_byte_size), storage.shard_axes
        )
        if inner == chunk_shape:
            inner = None
    name = param.name
    layout, recorded = _zarr3.planned_layout(name, shape, dtype, chunk_shape)
    recorded["one_chunk_shards"] = inner is None and not compression
    session.writer.add(
        ArrayWrite(
            _LeafLabel(param.keypath),
            layout,
            chunks,
            inner_chunk_shape=inner,
            compression=compression,
            write_metadata=primary,
        )
    )
    if extra:
        recorded.update(extra)
    session.extras[name] = recorded


def _storage_dtype(
    keypath: Sequence[Any], value: Any, dtype: Any, storage: cp.options.ArrayStorageOptions
) -> np.dtype:
    try:
        target = np.dtype(storage.dtype) if storage.dtype is not None else np.dtype(dtype)
    except TypeError:
        raise _unsupported(
            keypath,
            value,
            f"its dtype {dtype} has no NumPy equivalent; register a leaf handler for it",
        ) from None
    if _zarr3.zarr_dtype_name(target) is None:
        raise _unsupported(
            keypath,
            value,
            f"TensorStore's zarr3 driver has no {target} data type; convert the array to "
            f"one it has (e.g. uint8, or int4 for 4-bit values), or register a leaf handler "
            f"for it",
        )
    return target


# -- Reading helpers ---------------------------------------------------------------------------


def _cast(array: np.ndarray, dtype: Any) -> np.ndarray:
    if dtype is None or array.dtype == dtype:
        return array
    return array.astype(dtype)


def _numpy_result(array: np.ndarray, dtype: Any) -> np.ndarray:
    """A writable NumPy array (reads may hand over read-only views of stored bytes)."""
    array = _cast(array, dtype)
    return array if array.flags.writeable else array.copy()


def _numpy_as_stored(pieces: list[np.ndarray]) -> np.ndarray:
    return _numpy_result(pieces[0], None)


def _numpy_converted(pieces: list[np.ndarray], dtype: Any) -> np.ndarray:
    return _numpy_result(pieces[0], dtype)


def _target_of(abstract: Any) -> tuple[tuple[int, ...] | None, Any, Any]:
    """``(shape, dtype, sharding)`` an abstract leaf asks for (``None``: as stored)."""
    if abstract is None or isinstance(abstract, type):
        return None, None, None
    shape = tuple(int(s) for s in abstract.shape)
    dtype = getattr(abstract, "dtype", None)
    sharding = getattr(abstract, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = None
    return shape, (np.dtype(dtype) if dtype is not None else None), sharding


def _normalize(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


@attrs.frozen
class _OnDefaultDevice:
    """Makes the whole array read a ``jax.Array`` on the default device (uncommitted).

    A ``_array_reads.BatchConvert``: one ``jax.device_put`` of many arrays costs
    a third of what as many calls cost.
    """

    dtype: Any

    def __call__(self, pieces: list[np.ndarray]) -> jax.Array:
        return jax.device_put(_cast(pieces[0], self.dtype))

    @staticmethod
    def convert_many(
        converts: Sequence[_OnDefaultDevice], pieces: Sequence[list[np.ndarray]]
    ) -> list[jax.Array]:
        return jax.device_put([_cast(p[0], c.dtype) for c, p in zip(converts, pieces, strict=True)])


def _sharded_read(
    shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding
) -> tuple[list[tuple[slice, ...]], Any]:
    """The regions a sharded target needs, and the conversion building the ``jax.Array``."""
    indices = sharding.addressable_devices_indices_map(shape)
    regions: list[tuple[slice, ...]] = []
    position: dict[tuple[tuple[int, int], ...], int] = {}
    for index in indices.values():
        region = _normalize(tuple(index), shape)
        key = tuple((s.start, s.stop) for s in region)
        if key not in position:
            position[key] = len(regions)
            regions.append(region)

    def convert(pieces: list[np.ndarray]) -> jax.Array:
        pieces = [_cast(p, dtype) for p in pieces]

        def callback(index: tuple[slice, ...]) -> np.ndarray:
            region = _normalize(tuple(index), shape)
            return pieces[position[tuple((s.start, s.stop) for s in region)]]

        return jax.make_array_from_callback(shape, sharding, callback)

    return regions, convert


# -- Handlers ---------------------------------------------------------------------------------


class _StandardHandler:
    """Shared constructor: leaf handlers are built with ``context=`` (a ``cp.Context``)."""

    def __init__(self, context: cp.Context | None = None) -> None:
        self._context = context


def _start_host_copies(arrays: Sequence[jax.Array]) -> None:
    """Starts the device-to-host copy of every array, before waiting for any.

    Nothing to start where JAX runs on the CPU: ``np.asarray`` of an array is
    then a view of its buffer.
    """
    if jax.default_backend() == "cpu":
        return
    for array in arrays:
        if not array.is_deleted():
            array.copy_to_host_async()


@attrs.frozen
class _Snapshot:
    """One array of a save as the blocking phase leaves it: checked, its shards on host."""

    storage: cp.options.ArrayStorageOptions
    dtype: np.dtype
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], np.ndarray]]
    sharding: jax.sharding.Sharding


class ArrayLeafHandler(_StandardHandler):
    """Saves ``jax.Array`` leaves shard by shard; loads them onto any mesh.

    Saving transfers each shard this process owns (``replica_id == 0``) to host
    in the blocking phase, so the caller may delete its arrays as soon as
    ``save_pytree_async`` returns. (On CPU the host view shares the
    device buffer and keeps it alive: no copy at all.) Loading reads only the
    regions the target sharding places on this process's devices.
    """

    async def serialize(
        self,
        params: Sequence[SerializationParam[jax.Array]],
        serialization_context: SerializationContext,
    ) -> Awaitable[None]:
        """Copies the shards to host; returns the awaitable that writes them."""
        session, private = _save_session(self, serialization_context)
        lacking = _multiprocess.arrays_the_primary_lacks(
            {p.name: p.value for p in params}, session.directory, session.context
        )
        # The caller waits for the checks and host copies only; the layouts and
        # metadata are recorded in the background phase.
        if cp.multihost.process_count() == 1 and not session.array_options.storage_options_creator:
            snapshots = self._snapshot_local(session, params)
        else:
            snapshots = [
                self._snapshot(session, p, primary_lacks=p.name in lacking) for p in params
            ]
        session.defer(functools.partial(self._record_all, session, params, snapshots))
        return _finish_save(session, private)

    def _plan(
        self,
        session: SaveSession,
        param: SerializationParam[jax.Array],
        *,
        primary_lacks: bool,
        storage: cp.options.ArrayStorageOptions | None = None,
        ext_metadata: dict[str, Any] | None = None,
    ) -> None:
        """Schedules one array's shards; ``storage`` overrides the save's storage options.

        ``ext_metadata`` goes where Orbax keeps it (``array_metadatas/``) and
        into the leaf's own ``_METADATA`` fields.
        """
        snapshot = self._snapshot(session, param, primary_lacks=primary_lacks, storage=storage)
        self._record(session, param, snapshot, ext_metadata)

    def _snapshot(
        self,
        session: SaveSession,
        param: SerializationParam[jax.Array],
        *,
        primary_lacks: bool,
        storage: cp.options.ArrayStorageOptions | None = None,
    ) -> _Snapshot:
        """Checks one array and copies the shards this process writes to host."""
        array = param.value
        if array.is_deleted():
            raise _unsupported(
                param.keypath, array, "the array was deleted (or donated) before the save"
            )
        if storage is None:
            storage = _storage_options(session.array_options, param.keypath, array)
        dtype = _storage_dtype(param.keypath, array, array.dtype, storage)
        shape = tuple(int(s) for s in array.shape)
        if math.prod(shape) == 0:
            chunk_shape, chunks = _zarr3.default_chunk_shape(shape), []
        else:
            chunk_shape, chunks = self._host_shards(array, dtype, session.context, primary_lacks)
        return _Snapshot(storage, dtype, shape, chunk_shape, chunks, array.sharding)

    def _snapshot_local(
        self, session: SaveSession, params: Sequence[SerializationParam[jax.Array]]
    ) -> list[_Snapshot]:
        """``_snapshot`` of each array of a one-process save with one storage option for all.

        Single-device arrays (most leaves of most trees) take a short path:
        their dtype is checked once per dtype, their one shard is the array.
        """
        storage = session.array_options.storage_options
        single = jax.sharding.SingleDeviceSharding
        _start_host_copies([p.value for p in params])
        dtypes: dict[Any, np.dtype] = {}
        snapshots = []
        for param in params:
            array = param.value
            shape, sharding = array.shape, array.sharding
            if type(sharding) is not single or 0 in shape or array.is_deleted():
                snapshots.append(self._snapshot(session, param, primary_lacks=False))
                continue
            dtype = dtypes.get(array.dtype)
            if dtype is None:
                dtype = _storage_dtype(param.keypath, array, array.dtype, storage)
                dtypes[array.dtype] = dtype
            data = np.asarray(array)
            if data.dtype != dtype:
                data = data.astype(dtype)
            chunks = [((0,) * len(shape), data)]
            snapshots.append(_Snapshot(storage, dtype, shape, shape, chunks, sharding))
        return snapshots

    def _record_all(
        self,
        session: SaveSession,
        params: Sequence[SerializationParam[jax.Array]],
        snapshots: Sequence[_Snapshot],
    ) -> None:
        for param, snapshot in zip(params, snapshots, strict=True):
            self._record(session, param, snapshot, None)

    @staticmethod
    def _record(
        session: SaveSession,
        param: SerializationParam[jax.Array],
        snapshot: _Snapshot,
        ext_metadata: dict[str, Any] | None,
    ) -> None:
        """Schedules the write of one snapshotted array and records its metadata."""
        chunk_shape = snapshot.chunk_shape
        _plan_array(
            session,
            param,
            shape=snapshot.shape,
            dtype=snapshot.dtype,
            chunk_shape=chunk_shape,
            chunks=snapshot.chunks,
            storage=snapshot.storage,
            extra=ext_metadata,
            held_by_every_process=False,  # Each process writes the shards it owns.
        )
        name = param.name
        session.write_shapes[name] = chunk_shape
        record = _sharding.describe(snapshot.sharding)
        if record is not None:
            session.shardings[name] = record
        session.array_metadatas.append(
            {
                "param_name": name,
                "write_shape": list(chunk_shape),
                "chunk_shape": list(chunk_shape),
                "ext_metadata": ext_metadata,
            }
        )

    @staticmethod
    def _host_shards(
        array: jax.Array, dtype: np.dtype, context: cp.Context, primary_lacks: bool
    ) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], np.ndarray]]]:
        shape = tuple(int(s) for s in array.shape)
        if cp.multihost.process_count() == 1 and isinstance(
            array.sharding, jax.sharding.SingleDeviceSharding
        ):
            # One shard, the whole array: skip building Shard objects (a third of the
            # blocking phase of a save of many single-device arrays).
            data = np.asarray(array)
            return shape, [((0,) * len(shape), data if data.dtype == dtype else data.astype(dtype))]
        shards = _multiprocess.shards_to_write(array, context, primary_lacks=primary_lacks)
        try:
            chunk_shape = tuple(int(s) for s in array.sharding.shard_shape(array.shape))
        except (ValueError, NotImplementedError):  # Uneven shards: the largest is the chunk.
            chunk_shape = tuple(
                max(int(s.data.shape[d]) for s in array.addressable_shards)
                for d in range(len(shape))
            )
        for shard in shards:  # Start every transfer before waiting for any.
            shard.data.copy_to_host_async()
        chunks = []
        for shard in shards:
            # On an accelerator this is a fresh host copy. On CPU it is a view that
            # holds the device buffer: jax.Arrays are immutable and the buffer
            # outlives delete() while the view exists, so even an asynchronous
            # save needs no copy.
            data = np.asarray(shard.data)
            if data.dtype != dtype:
                data = data.astype(dtype)
            index = tuple(
                (s.start or 0) // c if c else 0
                for s, c in zip(_normalize(shard.index, shape), chunk_shape, strict=True)
            )
            chunks.append((index, data))
        return chunk_shape, chunks

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[Any]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[jax.Array]]:
        """Schedules the reads; returns the awaitable that yields the arrays."""
        session, private = _load_session(self, deserialization_context)
        reads = [self._plan_read(session, p) for p in params]
        return _finish_load(session, private, reads)

    @staticmethod
    def _plan_read(session: LoadSession, param: DeserializationParam[Any]) -> ArrayRead:
        entry, name = session.info(param.keypath, getattr(param, "names", None))
        _check_stored_type(entry, ARRAY_VALUE_TYPES, "a jax.Array")
        shape, dtype, sharding = _target_of(param.value)
        regions = None
        if sharding is not None and shape is not None:
            regions, convert = _sharded_read(shape, dtype, sharding)
        else:
            convert = _OnDefaultDevice(dtype)
        read = ArrayRead(
            label=entry,
            name=name,
            stored=session.stored_array(entry),
            convert=convert,
            target_shape=shape,
            regions=regions,
            allow_resize=session.allow_resize,
        )
        session.reader.add(read)
        return read

    async def metadata(
        self,
        params: Sequence[DeserializationParam[None]],
        deserialization_context: DeserializationContext,
    ) -> Sequence[ArrayMetadata]:
        """Shape, dtype and recorded sharding of each stored array."""
        session, _ = _load_session(self, deserialization_context)
        layouts = await _layouts(session, params)
        result = []
        for param, (shape, dtype, chunk_shape) in zip(params, layouts, strict=True):
            entry = session.entry(param.keypath)
            name = session.storage_name(param.keypath)
            result.append(
                ArrayMetadata(
                    shape,
                    dtype,
                    sharding_metadata=session.sharding_record(name),
                    storage=StorageMetadata(chunk_shape, entry.write_shape),
                )
            )
        return result


async def _layouts(
    session: LoadSession, params: Sequence[DeserializationParam[Any]]
) -> list[tuple[tuple[int, ...], np.dtype, tuple[int, ...] | None]]:
    """Shape, dtype and chunk shape of stored arrays (recorded, or read from zarr metadata)."""
    found: list[Any] = []
    unknown: list[str] = []
    for param in params:
        entry = session.entry(param.keypath)
        stored = session.stored_array(entry)
        if stored is not None:
            found.append((stored.shape, stored.dtype, stored.chunk_shape))
        else:
            found.append(None)
            unknown.append(session.storage_name(param.keypath))
    if unknown:
        documents = await session.zarr_metadata(unknown)
        for i, param in enumerate(params):
            if found[i] is None:
                found[i] = zarr_shape_dtype(documents[session.storage_name(param.keypath)])
    return found


async def _finish_load(session: LoadSession, private: bool, reads: list[ArrayRead]) -> list[Any]:
    if private:
        await session.reader.run()
    return [r.result for r in reads]


class NumpyLeafHandler(_StandardHandler):
    """Saves ``np.ndarray`` leaves as one-shard zarr3 arrays; loads NumPy arrays."""

    async def serialize(
        self,
        params: Sequence[SerializationParam[np.ndarray]],
        serialization_context: SerializationContext,
    ) -> Awaitable[None]:
        """Snapshots the arrays (unless the caller waits); returns the awaitable writing them."""
        session, private = _save_session(self, serialization_context)
        for param in params:
            array = param.value
            storage = _storage_options(session.array_options, param.keypath, array)
            array_dtype = array.dtype
            if array_dtype.kind in "OUS":
                raise _unsupported(
                    param.keypath,
                    array,
                    f"arrays of dtype {array_dtype} cannot be stored in zarr3; "
                    f"convert them to numbers (or strings to str leaves)",
                )
            if array_dtype.byteorder not in "=|":
                array_dtype = array_dtype.newbyteorder("=")
            dtype = _storage_dtype(param.keypath, array, array_dtype, storage)
            shape = array.shape  # A tuple of Python ints.
            chunk_shape = shape if 0 not in shape else _zarr3.default_chunk_shape(shape)
            if array.size == 0:
                chunks = []
            else:
                # A synchronous save's caller cannot touch the array until the
                # save returns, so no copy is needed then.
                data = array if session.caller_waits else np.array(array, copy=True)
                if data.dtype != dtype:
                    data = data.astype(dtype)
                chunks = [((0,) * len(shape), data)]
            _plan_array(
                session,
                param,
                shape=shape,
                dtype=dtype,
                chunk_shape=chunk_shape,
                chunks=chunks,
                storage=storage,
            )
        return _finish_save(session, private)

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[Any]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[np.ndarray]]:
        """Schedules the reads; returns the awaitable that yields the arrays."""
        session, private = _load_session(self, deserialization_context)
        reads = []
        # Thousands of leaves: the per-leaf work is kept to the minimum.
        info, stored_array, add = session.info, session.stored_array, session.reader.add
        allow_resize = session.allow_resize
        for param in params:
            entry, name = info(param.keypath, getattr(param, "names", None))
            if entry.value_type not in ARRAY_VALUE_TYPES:
                _check_stored_type(entry, ARRAY_VALUE_TYPES, "an np.ndarray")
            if param.value is None:
                shape, convert = None, _numpy_as_stored
            else:
                shape, dtype, _ = _target_of(param.value)
                convert = functools.partial(_numpy_converted, dtype=dtype)
            read = ArrayRead(
                label=entry,
                name=name,
                stored=stored_array(entry),
                convert=convert,
                target_shape=shape,
                allow_resize=allow_resize,
            )
            add(read)
            reads.append(read)
        return _finish_load(session, private, reads)

    async def metadata(
        self,
        params: Sequence[DeserializationParam[None]],
        deserialization_context: DeserializationContext,
    ) -> Sequence[NumpyMetadata]:
        """Shape and dtype of each stored array."""
        session, _ = _load_session(self, deserialization_context)
        layouts = await _layouts(session, params)
        return [
            NumpyMetadata(shape, dtype, StorageMetadata(chunk)) for shape, dtype, chunk in layouts
        ]


def _scalar_type_name(value: Any) -> str:
    if isinstance(value, np.generic):
        return "np." + np.dtype(type(value)).name
    for name, t in _PYTHON_SCALARS.items():
        if type(value) is t:
            return name
    for name, t in (("bool", bool), ("int", int), ("float", float), ("complex", complex)):
        if isinstance(value, t):
            return name
    return type(value).__name__


def _scalar_type(name: str | None, dtype: np.dtype | None) -> Any:
    """The Python or NumPy scalar type recorded as ``name`` (or implied by ``dtype``)."""
    if name in _PYTHON_SCALARS:
        return _PYTHON_SCALARS[name]
    if name and name.startswith("np."):
        try:
            return np.dtype(name[3:]).type
        except TypeError:
            pass
    if dtype is None:
        return float
    # Orbax's scalars: Python int, float and bool are stored as int64, float64, bool.
    if dtype.kind == "b":
        return bool
    if dtype.kind in "iu":
        return int
    if dtype.kind == "c":
        return complex
    if dtype == np.float64:
        return float
    return dtype.type


def _to_scalar(array: np.ndarray, scalar_type: Any, entry: _tree_metadata.Entry) -> Any:
    if array.size != 1:
        raise cp.errors.TreeMismatchError(
            f"{entry.keystr} stores an array of shape "
            f"{array.shape}; it cannot be loaded as a scalar "
            f"{getattr(scalar_type, '__name__', scalar_type)}. Use an array abstract leaf instead."
        )
    value = (
        array.reshape(()).item()
        if scalar_type in (int, float, bool, complex)
        else array.reshape(())[()]
    )
    return scalar_type(value)


class ScalarLeafHandler(_StandardHandler):
    """Saves Python and NumPy scalars as 0-d zarr3 arrays, recording their exact type.

    ``int`` is stored as int64, ``float`` as float64, ``bool`` as bool and
    NumPy scalars in their own dtype; each loads back as its own type (or as
    the type of the abstract leaf: ``0.0`` loads a float).
    """

    async def serialize(
        self, params: Sequence[SerializationParam[Any]], serialization_context: SerializationContext
    ) -> Awaitable[None]:
        """Converts the scalars to 0-d arrays; returns the awaitable that writes them."""
        session, private = _save_session(self, serialization_context)
        for param in params:
            value = param.value
            try:
                array = np.asarray(value)
            except OverflowError:
                array = np.asarray(None)
            if isinstance(value, int) and array.dtype.kind not in "biu":
                raise _unsupported(
                    param.keypath, value, "the integer does not fit in 64 bits; store it as a str"
                )
            storage = _storage_options(session.array_options, param.keypath, value)
            dtype = _storage_dtype(param.keypath, value, array.dtype, storage)
            _plan_array(
                session,
                param,
                shape=(),
                dtype=dtype,
                chunk_shape=(),
                chunks=[((), array.astype(dtype, copy=False))],
                storage=cp.options.ArrayStorageOptions(),
                extra={"scalar_type": _scalar_type_name(value)},
            )
        return _finish_save(session, private)

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[Any]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[Any]]:
        """Schedules the reads; returns the awaitable that yields the scalars."""
        session, private = _load_session(self, deserialization_context)
        reads = []
        for param in params:
            entry, name = session.info(param.keypath, getattr(param, "names", None))
            _check_stored_type(entry, ARRAY_VALUE_TYPES, "a scalar")
            abstract = param.value
            if isinstance(abstract, type):
                scalar_type = abstract
            elif abstract is not None:
                scalar_type = type(abstract)
            else:
                stored = session.stored_array(entry)
                scalar_type = _scalar_type(
                    entry.extra.get("scalar_type"), stored.dtype if stored else None
                )
                if stored is None:
                    scalar_type = None  # Decided by the stored dtype, once read.
            read = ArrayRead(
                label=entry,
                name=name,
                stored=session.stored_array(entry),
                convert=lambda pieces, t=scalar_type, entry=entry: _to_scalar(
                    pieces[0], t if t is not None else _scalar_type(None, pieces[0].dtype), entry
                ),
            )
            session.reader.add(read)
            reads.append(read)
        return _finish_load(session, private, reads)

    async def metadata(
        self,
        params: Sequence[DeserializationParam[None]],
        deserialization_context: DeserializationContext,
    ) -> Sequence[Any]:
        """A zero of each stored scalar's type (``0``, ``0.0``, ``False``, ``np.float32(0)``...)."""
        session, _ = _load_session(self, deserialization_context)
        layouts = await _layouts(session, params)
        result = []
        for param, (_, dtype, _) in zip(params, layouts, strict=True):
            entry = session.entry(param.keypath)
            result.append(_scalar_type(entry.extra.get("scalar_type"), dtype)(0))
        return result


class StringLeafHandler(_StandardHandler):
    """Saves ``str`` leaves in the pytree's ``_strings.json`` (as Orbax does)."""

    async def serialize(
        self, params: Sequence[SerializationParam[str]], serialization_context: SerializationContext
    ) -> Awaitable[None]:
        """Records the strings; they are written with the tree's other files."""
        session, private = _save_session(self, serialization_context)
        for param in params:
            session.strings[param.name] = str(param.value)
        return _finish_save(session, private)

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[Any]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[str]]:
        """Returns the awaitable that reads the strings."""
        session, _ = _load_session(self, deserialization_context)
        for param in params:
            _check_stored_type(session.entry(param.keypath), frozenset({STRING}), "a str")

        async def read() -> list[str]:
            strings = session.strings()
            result = []
            for param in params:
                name = session.storage_name(param.keypath)
                if name not in strings:
                    raise _errors.integrity_error(
                        session.entry(param.keypath).keystr,
                        f"it is missing from {session.directory / '_strings.json'}",
                    )
                result.append(str(strings[name]))
            return result

        return read()

    async def metadata(
        self,
        params: Sequence[DeserializationParam[None]],
        deserialization_context: DeserializationContext,
    ) -> Sequence[str]:
        """``""`` for each string leaf (an abstract ``str``)."""
        return ["" for _ in params]


class BytesLeafHandler(_StandardHandler):
    """Saves ``bytes`` leaves as 1-d uint8 zarr3 arrays; loads ``bytes``."""

    async def serialize(
        self,
        params: Sequence[SerializationParam[bytes]],
        serialization_context: SerializationContext,
    ) -> Awaitable[None]:
        """Copies the bytes into arrays; returns the awaitable that writes them."""
        session, private = _save_session(self, serialization_context)
        for param in params:
            data = np.frombuffer(bytes(param.value), dtype=np.uint8)
            shape = (int(data.size),)
            _plan_array(
                session,
                param,
                shape=shape,
                dtype=np.dtype(np.uint8),
                chunk_shape=_zarr3.default_chunk_shape(shape),
                chunks=[((0,), data)] if data.size else [],
                storage=cp.options.ArrayStorageOptions(),
            )
        return _finish_save(session, private)

    async def deserialize(
        self,
        params: Sequence[DeserializationParam[Any]],
        deserialization_context: DeserializationContext,
    ) -> Awaitable[Sequence[bytes]]:
        """Schedules the reads; returns the awaitable that yields the bytes."""
        session, private = _load_session(self, deserialization_context)
        reads = []
        for param in params:
            entry = session.entry(param.keypath)
            _check_stored_type(entry, ARRAY_VALUE_TYPES, "bytes")
            read = ArrayRead(
                label=entry,
                name=session.storage_name(param.keypath),
                stored=session.stored_array(entry),
                convert=lambda pieces: pieces[0].tobytes(),
            )
            session.reader.add(read)
            reads.append(read)
        return _finish_load(session, private, reads)

    async def metadata(
        self,
        params: Sequence[DeserializationParam[None]],
        deserialization_context: DeserializationContext,
    ) -> Sequence[bytes]:
        """``b""`` for each bytes leaf (an abstract ``bytes``)."""
        return [b"" for _ in params]
