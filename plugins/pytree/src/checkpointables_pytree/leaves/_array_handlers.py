"""The leaf handlers of arrays: ``jax.Array`` (shard by shard) and ``np.ndarray`` (one shard)."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs
import checkpointables as cp
import jax
import numpy as np
from checkpointables.serialization import DeserializationParam, SerializationParam

from checkpointables_pytree import io, tree, zarr3
from checkpointables_pytree.leaves import _array_layouts, _pieces, _streamed_saves
from checkpointables_pytree.leaves._common import (
    ReadTarget,
    StoredLayout,
    ZarrLeafHandler,
    on_cpu,
    schedule_array,
    storage_dtype,
    storage_options,
    unsupported,
)
from checkpointables_pytree.leaves._groups import LeafGroup
from checkpointables_pytree.leaves._host_copies import host_copies
from checkpointables_pytree.leaves._metadata import ArrayMetadata, NumpyMetadata, StorageMetadata
from checkpointables_pytree.leaves._options import ArrayStorageOptions
from checkpointables_pytree.leaves._session import LoadSession, SaveSession

__all__ = ["ArrayLeafHandler", "NumpyLeafHandler"]


def _cast(array: np.ndarray, dtype: Any) -> np.ndarray:
    if dtype is None or array.dtype == dtype:
        return array
    return array.astype(dtype)


def _numpy_result(pieces: list[np.ndarray], dtype: Any = None) -> np.ndarray:
    """A writable NumPy array (reads may hand over read-only views of stored bytes)."""
    array = _cast(pieces[0], dtype)
    return array if array.flags.writeable else array.copy()


_AS_STORED = ReadTarget(_numpy_result, sink=_pieces.HostSink.maker(None))  # Never changed.


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


def _on_concrete_mesh(sharding: jax.sharding.Sharding, keystr: str) -> jax.sharding.Sharding:
    """``sharding``, or where it is a ``NamedSharding`` of an ``AbstractMesh`` (what
    ``jax.eval_shape`` gives for explicit mesh axes) the same on the mesh in force
    (``jax.set_mesh``), which must have its axes.

    Raises:
      cp.errors.InvalidArgumentError: no mesh of those axes is in force.
    """
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(
        mesh, jax.sharding.AbstractMesh
    ):
        return sharding
    get_mesh = getattr(jax.sharding, "get_mesh", None)  # JAX 0.7 on, as jax.set_mesh.
    current = get_mesh() if get_mesh is not None else None
    if current is None or current.empty or current.abstract_mesh != mesh:
        in_force = "none is" if current is None or current.empty else f"{current.abstract_mesh} is"
        raise cp.errors.InvalidArgumentError(
            f"The abstract leaf {keystr} has a sharding on an abstract mesh ({mesh}), with no "
            f"devices to load onto, and {in_force} in force. Load inside `with "
            f"jax.set_mesh(mesh):` with the mesh of those axes, or give the leaf "
            f"jax.NamedSharding(mesh, {sharding.spec})."
        )
    return jax.sharding.NamedSharding(current, sharding.spec, memory_kind=sharding.memory_kind)


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


def _misfit(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[str, str] | None:
    """Why a ``NamedSharding`` cannot split ``shape``, and a spec that can (``None`` for
    other shardings: JAX's message says why)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec, sizes = tuple(sharding.spec), dict(sharding.mesh.shape)
    why, fixed = [], list(spec)
    for dim, (size, axes) in enumerate(zip(shape, spec, strict=False)):
        names = axes if isinstance(axes, tuple) else (axes,)
        parts = math.prod(sizes.get(a, 1) for a in names if isinstance(a, str))
        if size % parts:
            by = f"mesh axis {axes!r}" if isinstance(axes, str) else f"mesh axes {axes!r}"
            why.append(f"dimension {dim} (size {size}) is split into {parts} parts by {by}")
            fixed[dim] = None
    return ("; ".join(why), repr(jax.sharding.PartitionSpec(*fixed))) if why else None


def _device_indices(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, keystr: str
) -> Mapping[Any, Any]:
    """Each addressable device's index of ``shape`` under ``sharding``, checked while the
    load plans (before any read).

    Raises:
      cp.errors.InvalidArgumentError: ``sharding`` cannot split ``shape`` (e.g. a mesh
        axis whose size does not divide the dimension it splits).
    """
    try:
        return sharding.addressable_devices_indices_map(shape)
    except ValueError as e:  # JAX's IndivisibleError (private: caught as its base).
        misfit = _misfit(shape, sharding)
        why, spec = misfit if misfit is not None else (str(e), "")
        instead = f"(e.g. {spec}, which leaves those dimensions whole) " if spec else ""
        raise cp.errors.InvalidArgumentError(
            f"The abstract leaf {keystr} asks for shape {shape} with sharding {sharding}, "
            f"which cannot split that shape: {why}. Give the leaf a sharding whose mesh axes "
            f"divide the dimensions they split {instead}or none (jax.ShapeDtypeStruct(shape, "
            f"dtype) loads onto one device), and reshard after loading."
        ) from e


def _sharded_read(
    shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding, keystr: str
) -> ReadTarget:
    """The regions a sharded target needs, and the conversion building the ``jax.Array``."""
    indices = _device_indices(shape, sharding, keystr)
    regions: list[tuple[slice, ...]] = []
    position: dict[tuple[tuple[int, int], ...], int] = {}
    for index in indices.values():
        assert index is not None  # Every device's index (JAX's own callbacks assert it).
        region = _normalize(tuple(index), shape)
        key = tuple((s.start, s.stop) for s in region)
        if key not in position:
            position[key] = len(regions)
            regions.append(region)

    def convert(pieces: list[np.ndarray]) -> jax.Array:
        pieces = [_cast(p, dtype) for p in pieces]

        def callback(index: tuple[slice, ...] | None) -> np.ndarray:
            assert index is not None  # JAX passes each device's index (and asserts it).
            region = _normalize(tuple(index), shape)
            return pieces[position[tuple((s.start, s.stop) for s in region)]]

        # A process holding no shard of the array has no piece to tell JAX its dtype (given
        # otherwise, JAX would warn of a 64-bit dtype it truncates, which the pieces have not).
        return jax.make_array_from_callback(
            shape, sharding, callback, dtype=None if pieces else dtype
        )

    return ReadTarget(convert, shape, regions, _pieces.DeviceSink.maker(shape, dtype, sharding))


def _host_shards(
    array: jax.Array, dtype: np.dtype, context: cp.Context, primary_lacks: bool
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], np.ndarray]]]:
    """The chunk shape of ``array``'s shards, and those this process writes, on host."""
    shape = tuple(int(s) for s in array.shape)
    if cp.multihost.process_count() == 1 and isinstance(
        array.sharding, jax.sharding.SingleDeviceSharding
    ):
        # One shard, the whole array: skip building Shard objects (a third of the
        # blocking phase of a save of many single-device arrays).
        (data,) = host_copies([array])
        return shape, [((0,) * len(shape), data if data.dtype == dtype else data.astype(dtype))]
    shards = io.shards_to_write(array, context, primary_lacks=primary_lacks)
    try:
        chunk_shape = tuple(int(s) for s in array.sharding.shard_shape(array.shape))
    except (ValueError, NotImplementedError):  # Uneven shards: the largest is the chunk.
        chunk_shape = tuple(
            max(int(s.data.shape[d]) for s in array.addressable_shards) for d in range(len(shape))
        )
    chunks = []
    # On an accelerator a fresh host copy; on CPU a view that holds the device buffer (it
    # outlives delete() and donation): an async save needs no copy.
    for shard, data in zip(shards, host_copies([s.data for s in shards]), strict=True):
        if data.dtype != dtype:
            data = data.astype(dtype)
        index = tuple(
            (s.start or 0) // c if c else 0
            for s, c in zip(_normalize(shard.index, shape), chunk_shape, strict=True)
        )
        chunks.append((index, data))
    return chunk_shape, chunks


_SHARDING = operator.attrgetter("sharding")
_IS_DELETED = operator.methodcaller("is_deleted")
_SINGLE = jax.sharding.SingleDeviceSharding


def _linked_flags(session: SaveSession, group: LeafGroup) -> list[bool]:
    """Whether the writer links each array of ``group`` from an earlier checkpoint."""
    names, linked = group.flat.structure.storage_names, session.writer.linked
    return [names[i] in linked for i in group.indices]


def _links_in_bulk(session: SaveSession, params: Sequence[SerializationParam[jax.Array]]) -> bool:
    """Whether the arrays the writer links (``reuse``) are scheduled in one pass with the
    others: a one-process save, without a memory budget, of a group with one storage
    option for all, whose linked arrays are single-device (each then stands in by
    ``_stand_in``: never copied to host)."""
    if session.context.memory_options.host_bytes is not None:
        return False
    if cp.multihost.process_count() != 1 or not _array_layouts.in_bulk(session, params):
        return False
    assert isinstance(params, LeafGroup)  # As in_bulk requires.
    flags = _linked_flags(session, params)
    return all(type(v.sharding) is _SINGLE for v, k in zip(params.values, flags, strict=True) if k)


def _stand_in(array: jax.Array) -> np.ndarray:
    """A linked array as the bulk path sees it: its shape and dtype, no data (a zero-strided
    view of one element; ``schedule_jax_group`` gives the writer no chunk of it)."""
    shape = array.shape
    return np.ndarray(shape, array.dtype, _zero(array.dtype), strides=(0,) * len(shape))


@functools.lru_cache(maxsize=64)
def _zero(dtype: np.dtype) -> np.ndarray:
    """One zero element of ``dtype``: what every stand-in of that dtype views."""
    zero = np.zeros((), dtype)
    zero.flags.writeable = False
    return zero


@attrs.frozen
class _Snapshot:
    """One array of a save as the blocking phase leaves it: checked, its shards on host."""

    storage: ArrayStorageOptions
    dtype: np.dtype
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], np.ndarray]]
    sharding: jax.sharding.Sharding


class ArrayLeafHandler(ZarrLeafHandler):
    """Saves ``jax.Array`` leaves shard by shard; loads them onto any mesh.

    Saving transfers each shard this process owns (``replica_id == 0``) to host
    in the blocking phase, so the caller may delete its arrays as soon as
    ``save_pytree_async`` returns. (On CPU the host view shares the
    device buffer and keeps it alive: no copy at all.) Loading reads only the
    regions the target sharding places on this process's devices.
    """

    loads_as = "a jax.Array"

    def _schedule_writes(
        self, session: SaveSession, params: Sequence[SerializationParam[jax.Array]]
    ) -> None:
        if session.writer.linked and not _links_in_bulk(session, params):
            # Arrays linked from an earlier checkpoint: recorded apart, with no host copy.
            params = self._record_reused(session, params)
        if session.context.memory_options.host_bytes is not None:
            self._schedule_streamed(session, params, session.context.memory_options.host_bytes)
            return
        # The caller waits for checks and host copies; the rest is done by session.plan().
        if cp.multihost.process_count() == 1 and not session.array_options.storage_options_creator:
            values = params.values if isinstance(params, LeafGroup) else [p.value for p in params]
            shardings = list(map(_SHARDING, values))
            hosted = self._snapshot_local(session, params, values, shardings)
            session.defer(functools.partial(self._record_all, session, params, shardings, hosted))
            return
        lacking = io.arrays_the_primary_lacks(
            {p.name: p.value for p in params},
            session.directory,
            session.context,
            asker=type(self).__qualname__,
        )
        snapshots = [self._snapshot(session, p, primary_lacks=p.name in lacking) for p in params]
        shardings = [s.sharding for s in snapshots]
        session.defer(functools.partial(self._record_all, session, params, shardings, snapshots))

    def _record_reused(
        self, session: SaveSession, params: Sequence[SerializationParam[jax.Array]]
    ) -> list[SerializationParam[jax.Array]]:
        """Records the arrays the writer links (``reuse``), without their data; returns
        the others."""
        kept = []
        storage = session.array_options.storage_options
        budget = session.context.memory_options.host_bytes
        for param in params:
            array = param.value
            if param.name not in session.writer.linked:
                kept.append(param)
                continue
            shape = tuple(int(s) for s in array.shape)
            # The chunks a save of this array writes, which reuse linked (no casts there).
            chunk_shape = io.chunk_shape_of(array)
            if budget is not None:
                most = io.piece_bytes(budget)
                chunk_shape = _streamed_saves.budget_chunk_shape(array, array.dtype, most)
            snapshot = _Snapshot(storage, array.dtype, shape, chunk_shape, [], array.sharding)
            self._record(session, param, snapshot, None)
        return kept

    def _schedule_streamed(
        self, session: SaveSession, params: Sequence[SerializationParam[jax.Array]], budget: int
    ) -> None:
        """Under a host-memory budget: arrays written in chunks of at most a piece of the
        budget, each read from the device when its turn comes (``_streamed_saves``)."""
        lacking: set[str] = set()
        if cp.multihost.process_count() > 1:
            lacking = set(
                io.arrays_the_primary_lacks(
                    {p.name: p.value for p in params},
                    session.directory,
                    session.context,
                    asker=type(self).__qualname__,
                )
            )
        for param in params:
            array = param.value
            if array.is_deleted():
                raise unsupported(
                    param.keypath, array, "the array was deleted (or donated) before the save"
                )
            storage = storage_options(session, param.keypath, array)
            dtype = storage_dtype(param.keypath, array, array.dtype, storage)
            plan = _streamed_saves.plan(
                array, dtype, session, io.piece_bytes(budget), primary_lacks=param.name in lacking
            )
            shape = tuple(int(s) for s in array.shape)
            if plan.views:  # On CPU devices: the writer writes straight from their memory.
                chunks = [(s.index, s.fetch()) for s in plan.sources]
                snapshot = _Snapshot(
                    storage, dtype, shape, plan.chunk_shape, chunks, array.sharding
                )
                self._record(session, param, snapshot, None)
                continue
            snapshot = _Snapshot(storage, dtype, shape, plan.chunk_shape, [], array.sharding)
            item = self._record(session, param, snapshot, None)
            session.writer.add_streamed(io.Streamed(item, plan.sources))

    def _schedule_array(
        self,
        session: SaveSession,
        param: SerializationParam[jax.Array],
        *,
        primary_lacks: bool,
        storage: ArrayStorageOptions | None = None,
        ext_metadata: dict[str, Any] | None = None,
    ) -> None:
        """Schedules one array's shards; ``storage`` overrides the save's storage options.

        ``ext_metadata`` goes where Orbax keeps it (``array_metadatas/``) and
        into the leaf's own ``_METADATA`` fields.
        """
        snapshot = self._snapshot(session, param, primary_lacks=primary_lacks, storage=storage)
        self._record(session, param, snapshot, ext_metadata)

    @staticmethod
    def _snapshot(
        session: SaveSession,
        param: SerializationParam[jax.Array],
        *,
        primary_lacks: bool,
        storage: ArrayStorageOptions | None = None,
    ) -> _Snapshot:
        """Checks one array and copies the shards this process writes to host."""
        array = param.value
        if array.is_deleted():
            raise unsupported(
                param.keypath, array, "the array was deleted (or donated) before the save"
            )
        if storage is None:
            storage = storage_options(session, param.keypath, array)
        dtype = storage_dtype(param.keypath, array, array.dtype, storage)
        shape = tuple(int(s) for s in array.shape)
        chunks: list[tuple[tuple[int, ...], np.ndarray]]
        if math.prod(shape) == 0:
            chunk_shape, chunks = zarr3.default_chunk_shape(shape), []
        else:
            chunk_shape, chunks = _host_shards(array, dtype, session.context, primary_lacks)
        return _Snapshot(storage, dtype, shape, chunk_shape, chunks, array.sharding)

    def _snapshot_local(
        self,
        session: SaveSession,
        params: Sequence[SerializationParam[jax.Array]],
        values: list[jax.Array],
        shardings: list[jax.sharding.Sharding],
    ) -> list[np.ndarray | _Snapshot]:
        """``_snapshot`` of each array of a one-process save with one storage option for all.

        Single-device arrays (most leaves of most trees) are put on host in one pass
        and checked once per dtype; the rest waits for ``_record_all``.
        """
        linked = [False] * len(values)  # Linked arrays stay in a group (``_links_in_bulk``).
        if session.writer.linked and isinstance(params, LeafGroup):
            linked = _linked_flags(session, params)
        all_single = set(map(type, shardings)) == {_SINGLE} and not any(map(_IS_DELETED, values))
        if all_single and not any(linked):
            hosted: list[np.ndarray | _Snapshot] = list(host_copies(values))
        else:  # Linked arrays (single-device: ``_links_in_bulk``) are not copied to host.
            single = [
                i
                for i, (v, s, k) in enumerate(zip(values, shardings, linked, strict=True))
                if not k and type(s) is _SINGLE and not v.is_deleted()
            ]
            copies = dict(zip(single, host_copies([values[i] for i in single]), strict=True))
            hosted = [
                _stand_in(v)
                if k
                else copies[i]
                if i in copies
                else self._snapshot(session, params[i], primary_lacks=False)
                for i, (v, k) in enumerate(zip(values, linked, strict=True))
            ]
        storage = session.array_options.storage_options
        for dtype in {h.dtype for h in hosted if type(h) is np.ndarray}:
            if storage.dtype is None and zarr3.zarr_dtype_name(dtype) is not None:
                continue
            # A cast, or an error naming the first such leaf.
            i = next(i for i, h in enumerate(hosted) if type(h) is np.ndarray and h.dtype == dtype)
            storage_dtype(params[i].keypath, values[i], dtype, storage)
        return hosted

    def _record_all(
        self,
        session: SaveSession,
        params: Sequence[SerializationParam[jax.Array]],
        shardings: Sequence[jax.sharding.Sharding],
        hosted: Sequence[np.ndarray | _Snapshot],
    ) -> None:
        """Records the snapshots (``_snapshot_local`` leaves host arrays to finish here)."""
        if _array_layouts.in_bulk(session, params) and all(type(h) is np.ndarray for h in hosted):
            _array_layouts.schedule_jax_group(session, params, shardings, hosted)  # type: ignore[arg-type]
            return
        storage = session.array_options.storage_options
        dtypes: dict[np.dtype, np.dtype] = {}
        for param, sharding, item in zip(params, shardings, hosted, strict=True):
            if type(item) is np.ndarray:
                dtype = dtypes.get(item.dtype)
                if dtype is None:
                    dtype = storage_dtype(param.keypath, item, item.dtype, storage)
                    dtypes[item.dtype] = dtype
                shape = item.shape
                data = item if item.dtype == dtype else item.astype(dtype)
                if 0 in shape or param.name in session.writer.linked:  # Linked: no data.
                    chunk_shape, chunks = zarr3.default_chunk_shape(shape), []
                else:
                    chunk_shape, chunks = shape, [((0,) * len(shape), data)]
                item = _Snapshot(storage, dtype, shape, chunk_shape, chunks, sharding)
            self._record(session, param, cast(_Snapshot, item), None)  # Host arrays made one.

    @staticmethod
    def _record(
        session: SaveSession,
        param: SerializationParam[jax.Array],
        snapshot: _Snapshot,
        ext_metadata: dict[str, Any] | None,
    ) -> zarr3.ArrayWrite:
        """Schedules the write of one snapshotted array and records its metadata."""
        chunk_shape = snapshot.chunk_shape
        item = schedule_array(
            session,
            param,
            shape=snapshot.shape,
            dtype=snapshot.dtype,
            chunk_shape=chunk_shape,
            chunks=snapshot.chunks,
            storage=snapshot.storage,
            extra=ext_metadata,
            held_by_every_process=False,  # Each process writes the shards it owns.
            # Host copies (from accelerators, or cast); on CPU devices views of their buffers.
            staged=snapshot.dtype != param.value.dtype or not on_cpu(param.value),
        )
        name = param.name
        session.write_shapes[name] = chunk_shape
        record = tree.describe(snapshot.sharding)
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
        return item

    def _schedule_reads(
        self, session: LoadSession, params: Sequence[DeserializationParam[Any]]
    ) -> list[io.ArrayRead]:
        reads = super()._schedule_reads(session, params)
        # An abstract leaf without a sharding loads onto the default device: what the user
        # asked for, unless the array was saved sharded over more devices than exist here
        # (e.g. pytree_metadata's leaves, whose saved sharding could not be rebuilt).
        unplaced = [
            read
            for read, param in zip(reads, params, strict=True)
            if param.value is not None
            and not isinstance(param.value, type)
            and _target_of(param.value)[2] is None
        ]
        if unplaced:
            session.note_unplaced([r.name for r in unplaced], [r.label for r in unplaced])
        return reads

    def _read_target(self, entry: tree.Entry, abstract: Any, stored: Any) -> ReadTarget:
        shape, dtype, sharding = _target_of(abstract)
        if sharding is not None and shape is not None:
            keystr = entry.keystr
            return _sharded_read(shape, dtype, _on_concrete_mesh(sharding, keystr), keystr)
        return ReadTarget(
            _OnDefaultDevice(dtype), shape, sink=_pieces.DeviceSink.maker(shape, dtype, None)
        )

    def _describe(
        self, session: LoadSession, entry: tree.Entry, layout: StoredLayout
    ) -> ArrayMetadata:
        """Shape, dtype and recorded sharding of a stored array."""
        return ArrayMetadata(
            layout.shape,
            layout.dtype,
            sharding_metadata=session.sharding_record(session.tree.storage_name(entry.names)),
            storage=StorageMetadata(layout.chunk_shape, entry.write_shape),
        )


class NumpyLeafHandler(ZarrLeafHandler):
    """Saves ``np.ndarray`` leaves as one-shard zarr3 arrays; loads NumPy arrays.

    An asynchronous save snapshots the arrays in its blocking phase (a
    synchronous one's caller cannot touch them until it returns: no copy).
    """

    loads_as = "an np.ndarray"

    def _schedule_writes(
        self, session: SaveSession, params: Sequence[SerializationParam[np.ndarray]]
    ) -> None:
        budget = session.context.memory_options.host_bytes
        if budget is None and _array_layouts.in_bulk(session, params):
            _array_layouts.schedule_numpy_group(session, params)  # type: ignore[arg-type]
            return
        for param in params:
            array = param.value
            storage = storage_options(session, param.keypath, array)
            dtype = _array_layouts.numpy_storage_dtype(param.keypath, array, array.dtype, storage)
            shape = array.shape  # A tuple of Python ints.
            chunk_shape = shape if 0 not in shape else zarr3.default_chunk_shape(shape)
            chunks: list[tuple[tuple[int, ...], np.ndarray]] = []
            if array.size and param.name in session.writer.linked:
                # Linked by reuse, in the chunks a write would make: no copy, no chunk.
                if budget is not None:  # Those of ``host_chunks``.
                    most = io.piece_bytes(budget)
                    chunk_shape = io.budget_chunk_shape(shape, shape, dtype.itemsize, most)
            elif array.size:
                data = array if session.caller_waits else np.array(array, copy=True)
                data = data if data.dtype == dtype else data.astype(dtype)
                chunks = [((0,) * len(shape), data)]
                if budget is not None:  # Chunks a budgeted load can read one at a time.
                    chunk_shape, chunks = _streamed_saves.host_chunks(data, io.piece_bytes(budget))
            schedule_array(
                session,
                param,
                shape=shape,
                dtype=dtype,
                chunk_shape=chunk_shape,
                chunks=chunks,
                storage=storage,
                staged=not session.caller_waits or dtype != array.dtype,  # A copy, or a cast.
            )

    def _read_target(self, entry: tree.Entry, abstract: Any, stored: Any) -> ReadTarget:
        if abstract is None:
            return _AS_STORED
        shape, dtype, _ = _target_of(abstract)
        return ReadTarget(
            functools.partial(_numpy_result, dtype=dtype), shape, sink=_pieces.HostSink.maker(dtype)
        )

    def _describe(
        self, session: LoadSession, entry: tree.Entry, layout: StoredLayout
    ) -> NumpyMetadata:
        """Shape and dtype of a stored array."""
        return NumpyMetadata(layout.shape, layout.dtype, StorageMetadata(layout.chunk_shape))
