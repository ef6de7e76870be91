"""The zarr3 layouts of a save's array leaves, planned once per tree structure.

A training loop saves trees of one structure, with the same shapes and
dtypes, again and again. What an array's write and its ``_METADATA`` record
depend on besides its data (its ``ZarrLayout``; the record of its shape,
dtype and chunking) is made by the first save of a structure and kept with
it (``_tree.Structure.derived``); later saves check the leaves' shapes and
dtypes against the plan's (a comparison of two lists) and reuse it, or make
a new one when they changed.

Arrays of one layout share one record (a dict ``_save_plan`` encodes once
per save): never change a record or a layout once made.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from checkpointables_pytree import tree, zarr3
from checkpointables_pytree.leaves._common import LeafLabel, on_cpu, storage_dtype, unsupported
from checkpointables_pytree.leaves._groups import LeafGroup
from checkpointables_pytree.leaves._options import ArrayStorageOptions
from checkpointables_pytree.leaves._session import SaveSession
from checkpointables_pytree.zarr3 import ArrayWrite

__all__ = [
    "ArrayLayouts",
    "array_layouts",
    "schedule_group",
    "numpy_storage_dtype",
    "schedule_numpy_group",
    "in_bulk",
    "schedule_jax_group",
]

# The index of the only chunk of an array of each rank (shared, not made per array).
_ORIGINS = tuple((0,) * n for n in range(65))


class ArrayLayouts:
    """The layouts and records of the arrays of one leaf group, for given shapes and dtypes."""

    __slots__ = (
        "compression",
        "dtypes",
        "indices",
        "layouts",
        "records",
        "shapes",
        "texts",
        "write_shapes",
    )

    def __init__(
        self,
        indices: Sequence[int],
        shapes: list[tuple[int, ...]],
        dtypes: list[np.dtype],
        compression: bool,
        names: Sequence[str],
        write_shapes: bool,
    ) -> None:
        self.indices = indices
        self.shapes = shapes
        self.dtypes = dtypes
        self.compression = compression
        # Whether the arrays' _METADATA entries record their write shape (the chunk shape).
        self.write_shapes = write_shapes
        self.layouts: list[zarr3.ZarrLayout] = []
        self.records: list[dict[str, Any]] = []
        # What _save_plan renders of the records, per value type: made once, like the rest.
        self.texts: dict[Any, list[str]] = {}
        shared: dict[tuple[Any, ...], dict[str, Any]] = {}
        for i, shape, dtype in zip(indices, shapes, dtypes, strict=True):
            chunk_shape = shape if 0 not in shape else zarr3.default_chunk_shape(shape)
            layout = zarr3.ZarrLayout(names[i], shape, dtype, chunk_shape)
            key = (layout.shape, dtype, layout.chunk_shape)
            record = shared.get(key)
            if record is None:
                # One inner chunk per shard: uncompressed, the writer reads it without the driver.
                record = shared[key] = {**layout.summary(), "one_chunk_shards": not compression}
            self.layouts.append(layout)
            self.records.append(record)

    def fits(
        self,
        indices: Sequence[int],
        shapes: list[tuple[int, ...]],
        dtypes: list[np.dtype],
        compression: bool,
    ) -> bool:
        """Whether this plan holds for arrays of these leaves, shapes and dtypes."""
        return (
            compression == self.compression
            and shapes == self.shapes
            and dtypes == self.dtypes
            and (indices is self.indices or indices == self.indices)
        )


def array_layouts(
    kind: str,
    group: LeafGroup,
    shapes: list[tuple[int, ...]],
    dtypes: list[np.dtype],
    compression: bool,
    *,
    write_shapes: bool = False,
) -> ArrayLayouts:
    """The layouts of ``group``'s arrays (of these shapes and stored dtypes), made or reused.

    ``kind`` tells apart the groups of one structure (one plan is kept for each).
    """
    structure = group.flat.structure
    key = ("array_layouts", kind)
    plan = structure.derived.get(key)
    if plan is None or not plan.fits(group.indices, shapes, dtypes, compression):
        names = structure.storage_names
        plan = ArrayLayouts(group.indices, shapes, dtypes, compression, names, write_shapes)
        structure.derived[key] = plan  # Replaced whole: a save in another thread sees either.
    return plan  # type: ignore[no-any-return]


def schedule_group(
    session: SaveSession,
    group: LeafGroup,
    plan: ArrayLayouts,
    data: Sequence[np.ndarray | None],
    staged: bool,
) -> None:
    """Schedules the write of each array of ``group`` (one chunk: ``data``, ``None`` for none).

    Their ``_METADATA`` records are the plan's: ``group.layouts``. ``staged``: ``data``
    are host copies the save made (counted in the writer's ``staging``).
    """
    if staged:
        session.writer.staging.hold(sum(a.nbytes for a in data if a is not None))
    keypaths = group.flat.structure.keypaths
    primary, compression = session.primary, session.compression
    add = session.writer.add
    # Plain loop: a comprehension costs a frame per array.
    for i, layout, array in zip(plan.indices, plan.layouts, data):  # noqa: B905 (one per leaf)
        chunks = [] if array is None else [(_ORIGINS[array.ndim], array)]
        add(
            ArrayWrite(
                LeafLabel(keypaths[i]),
                layout,
                chunks,
                compression=compression,
                write_metadata=primary,
            )
        )
    group.layouts = plan


def in_bulk(session: SaveSession, params: Any) -> bool:
    """Whether a leaf handler schedules ``params`` as a group: one storage option for all
    (no per-leaf ``storage_options_creator``), one chunk per array."""
    options = session.array_options
    return (
        isinstance(params, LeafGroup)
        and options.storage_options_creator is None
        and not options.storage_options.chunk_byte_size
    )


def numpy_storage_dtype(
    keypath: Sequence[Any], array: Any, dtype: np.dtype, storage: ArrayStorageOptions
) -> np.dtype:
    """The dtype a NumPy array of ``dtype`` is stored in; an error naming ``keypath`` if none."""
    if dtype.kind in "OUS":
        raise unsupported(
            keypath,
            array,
            f"arrays of dtype {dtype} cannot be stored in zarr3; "
            f"convert them to numbers (or strings to str leaves)",
        )
    if dtype.byteorder not in "=|":
        dtype = dtype.newbyteorder("=")
    return storage_dtype(keypath, array, dtype, storage)


def schedule_numpy_group(session: SaveSession, group: LeafGroup) -> None:
    """Schedules the NumPy arrays of ``group``: checked once per dtype, laid out once per
    structure (see ``array_layouts``). An asynchronous save copies them (a synchronous
    one's caller cannot touch them until it returns)."""
    values = group.values
    dtypes, cast = _stored_dtypes(session, group, values, numpy_storage_dtype)
    shapes = list(map(_SHAPE, values))
    plan = array_layouts("numpy", group, shapes, dtypes, session.compression)
    data: list[np.ndarray | None]
    copy = not session.caller_waits
    if not session.primary:  # Every process holds the arrays: the primary writes them.
        data = [None] * len(values)
    else:
        data = [None if 0 in shape else v for v, shape in zip(values, shapes, strict=True)]
        if cast or copy:
            data = [
                None
                if v is None
                else np.array(v, dtype=d)
                if copy
                else (v if v.dtype == d else v.astype(d))
                for v, d in zip(data, dtypes, strict=True)
            ]
    schedule_group(session, group, plan, data, staged=session.primary and (cast or copy))


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def _stored_dtypes(
    session: SaveSession,
    group: LeafGroup,
    arrays: Sequence[Any],
    check: Callable[[Sequence[Any], Any, np.dtype, ArrayStorageOptions], np.dtype],
) -> tuple[list[np.dtype], bool]:
    """The dtype each of ``arrays`` is stored in (``check`` runs once per dtype; its errors
    name the first leaf of that dtype), and whether any differs from the array's own."""
    keypaths = group.flat.structure.keypaths
    storage = session.array_options.storage_options
    dtypes = list(map(_DTYPE, arrays))
    stored = {}
    for dtype in dict.fromkeys(dtypes):  # In the leaves' order: errors name the first.
        first = dtypes.index(dtype)
        stored[dtype] = check(keypaths[group.indices[first]], arrays[first], dtype, storage)
    if all(s == d for d, s in stored.items()):
        return dtypes, False
    return [stored[d] for d in dtypes], True


def schedule_jax_group(
    session: SaveSession,
    group: LeafGroup,
    shardings: Sequence[jax.sharding.Sharding],
    hosted: Sequence[np.ndarray],
) -> None:
    """Schedules the arrays of ``group`` (single-device ``jax.Array`` leaves of a one-process
    save, on host: ``hosted``) and records their shardings (see ``schedule_group``)."""
    dtypes, cast = _stored_dtypes(session, group, hosted, storage_dtype)
    shapes = list(map(_SHAPE, hosted))
    plan = array_layouts("jax", group, shapes, dtypes, session.compression, write_shapes=True)
    data: list[np.ndarray | None] = [
        None if 0 in shape else h for h, shape in zip(hosted, shapes, strict=True)
    ]
    if linked := session.writer.linked:  # Stand-ins for data the writer links (``reuse``).
        layouts = plan.layouts
        data = [None if layouts[n].name in linked else h for n, h in enumerate(data)]
    if cast:
        data = [None if h is None else h.astype(d) for h, d in zip(data, dtypes, strict=True)]
    # On CPU devices the hosted arrays are views of the devices' buffers: not staged.
    staged = cast or (bool(group.values) and not on_cpu(group.values[0]))
    schedule_group(session, group, plan, data, staged)
    described: dict[int, dict[str, Any] | None] = {}  # Per sharding (arrays share them).
    records, metadatas = session.shardings, session.array_metadatas
    for layout, record, sharding in zip(plan.layouts, plan.records, shardings, strict=True):
        description = described.get(id(sharding), _UNSEEN)
        if description is _UNSEEN:
            description = described[id(sharding)] = tree.describe(sharding)
        if description is not None:
            records[layout.name] = description  # type: ignore[assignment]
        chunk_shape = record["chunk_shape"]  # A list: shared, only encoded.
        metadatas.append(
            {
                "param_name": layout.name,
                "write_shape": chunk_shape,
                "chunk_shape": chunk_shape,
                "ext_metadata": None,
            }
        )


_UNSEEN: Any = object()
