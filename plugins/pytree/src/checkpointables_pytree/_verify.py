"""``checkpointables verify`` for pytrees: everything a load checks, and every chunk.

First what a load without an abstract tree would refuse: ``_METADATA`` that
does not parse or does not match its recorded checksum, leaves whose value
type no registered leaf handler reads, a structure that cannot be rebuilt,
recorded layouts that are malformed, a damaged ``_sharding``. Then the array
store is compared with ``_METADATA``: every array's ``zarr.json`` must agree
with the recorded shape and dtype, and the database must hold no array that
``_METADATA`` does not list (an entry lost from an unchecksummed ``_METADATA``
would silently drop a leaf).

Every b-tree node of the database is compared with the CRC-32C the save
recorded in ``_btree_checksums`` (when it did): a node rebuilt with a valid
CRC-32C of its own is found there. Then every chunk is read and checked
against zarr3's CRC-32C (what every zarr3 reader checks): arrays stored as
plain shards by the reader of loads, in batches of about ``BATCH_BYTES``, and
any other array shard by shard through the zarr3 driver. At most one batch
or one shard of a large array is in memory at a time.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
from collections.abc import Sequence
from typing import Any

import checkpointables as cp
import tensorstore as ts
from checkpointables.serialization import DeserializationParam, LeafHandlerRegistry
from etils import epath

from checkpointables_pytree import io, leaves, ocdbt, storage, zarr3
from checkpointables_pytree import tree as tree_room
from checkpointables_pytree._load_plan import LoadPlan, check_array_count
from checkpointables_pytree.io import ArrayRead
from checkpointables_pytree.leaves import ARRAY_VALUE_TYPES, SCALAR, STRING, LoadSession

__all__ = ["verify_pytree"]

# Arrays read and checked at once.
BATCH_BYTES = 32 << 20
# The leaf handlers whose loads turn a stored array into something else, trusting
# _METADATA to say how (a scalar's type, bytes, a key's implementation): verify runs
# their loads as a load would, so that it fails wherever the load fails. (Strings are
# checked below as their handler reads them.)
_TYPED_HANDLERS = (leaves.ScalarLeafHandler, leaves.BytesLeafHandler, leaves.PRNGKeyLeafHandler)


def _problem(entry: tree_room.Entry, error: BaseException) -> str:
    """``error`` as a problem of ``entry``: named once (most errors name their leaf)."""
    text = str(error)
    return text if text.startswith(entry.keystr) else f"{entry.keystr}: {text}"


async def _check_zarr_metadata(
    session: LoadSession, entries: Sequence[tree_room.Entry]
) -> list[str]:
    """Compares each batched array's ``zarr.json`` with the one this library writes for it."""
    kvstore = await ocdbt.open_kvstore(session.directory, ocdbt.make_context())
    names = [session.tree.storage_name(e.names) for e in entries]
    futures = [kvstore.read(zarr3.array_prefix(n) + "zarr.json") for n in names]
    problems = []
    for entry, future in zip(entries, futures, strict=True):
        stored = session.stored_array(entry)
        assert stored is not None
        try:
            value = (await future).value
        except Exception as e:
            problems.append(_problem(entry, storage.storage_error("its zarr.json", e)))
            continue
        if value != zarr3.zarr_json(stored.shape, stored.dtype, stored.chunk_shape):
            problems.append(
                f"{entry.keystr}: its zarr.json is missing or "
                "damaged (other tools cannot read the array)"
            )
    return problems


async def _check_batch(session: LoadSession, entries: Sequence[tree_room.Entry]) -> list[str]:
    problems = await _check_zarr_metadata(session, entries)
    return problems + await _check_chunks(session, entries)


def _check_loadable(
    directory: epath.Path, tree: tree_room.TreeMetadata, registry: LeafHandlerRegistry
) -> list[str]:
    """What a load without an abstract tree refuses before reading any array."""
    try:
        check_array_count(tree, directory)
        plan = LoadPlan.without_abstract(tree, registry)
        plan.build(tree, directory)
        tree_room.read_sharding_file(directory)
    except cp.errors.CheckpointError as e:
        return [str(e)]
    return []


def _check_layouts(session: LoadSession) -> list[str]:
    """Recorded layouts that are malformed, and scalars that do not hold one value."""
    problems = []
    for entry in session.tree.entries:
        if entry.value_type not in ARRAY_VALUE_TYPES:
            continue
        try:
            stored = session.stored_array(entry)
        except cp.errors.CheckpointError as e:
            problems.append(str(e))
            continue
        if entry.value_type == SCALAR and stored is not None and math.prod(stored.shape) != 1:
            problems.append(f"{entry.keystr}: a scalar stored with shape {stored.shape}")
    return problems


async def _check_array_set(session: LoadSession) -> list[str]:
    """Arrays the database holds that ``_METADATA`` does not list (a lost entry)."""
    if not session.tree.use_ocdbt:
        return []
    try:
        kvstore = await ocdbt.open_kvstore(session.directory, ocdbt.make_context())
        keys = await kvstore.list()
    except Exception as e:
        return [str(storage.storage_error(f"the database of {session.directory}", e))]
    suffix = b"/zarr.json" if session.tree.use_zarr3 else b"/.zarray"
    stored = {k[: -len(suffix)].decode(errors="replace") for k in keys if k.endswith(suffix)}
    listed = {session.tree.storage_name(e.names) for e in session.tree.entries}
    unlisted = sorted(stored - listed)
    if not unlisted:
        return []
    shown = ", ".join(repr(n) for n in unlisted[:10]) + (" ..." if len(unlisted) > 10 else "")
    return [
        f"{session.directory / tree_room.METADATA_FILE} does not list {len(unlisted)} "
        f"array(s) the database holds ({shown}): a load would leave them out. The metadata "
        f"lost entries; restore the checkpoint from a copy."
    ]


async def _check_chunks(session: LoadSession, entries: Sequence[tree_room.Entry]) -> list[str]:
    reader = io.Reader(session.directory, fast_path=session.context.array_options.ocdbt_fast_path)
    reader.add_all(
        [
            ArrayRead(
                label=entry,
                name=session.tree.storage_name(entry.names),
                stored=session.stored_array(entry),
                convert=lambda pieces: None,
            )
            for entry in entries
        ]
    )
    try:
        await reader.run()
    except cp.errors.CheckpointError as e:
        if len(entries) == 1:
            return [_problem(entries[0], e)]
        # Check each array alone, to name every damaged one.
        problems = []
        for entry in entries:
            problems += await _check_chunks(session, [entry])
        return problems
    return []


async def _check_with_driver(session: LoadSession, entry: tree_room.Entry) -> list[str]:
    name = session.tree.storage_name(entry.names)
    spec = io.Reader(
        session.directory, ocdbt=session.tree.use_ocdbt, zarr3=session.tree.use_zarr3
    ).array_spec(name)
    spec["fill_missing_data_reads"] = False
    try:
        store = await ts.open(spec, context=ocdbt.make_context(), open=True)
        shape = tuple(int(s) for s in store.shape)
        stored = session.stored_array(entry)
        if stored is not None and (shape, store.dtype.numpy_dtype) != (stored.shape, stored.dtype):
            return [f"{entry.keystr}: its zarr.json disagrees with _METADATA on shape or dtype"]
        chunk = store.chunk_layout.write_chunk.shape or store.chunk_layout.read_chunk.shape
        chunk = tuple(
            int(c) if c else max(1, s) for c, s in zip(chunk or shape, shape, strict=True)
        )
        chunk_bytes = math.prod(chunk) * store.dtype.numpy_dtype.itemsize
        memory = io.physical_memory_bytes()
        if memory and chunk_bytes > memory:
            return [
                f"{entry.keystr}: its zarr.json claims chunks of {chunk_bytes:,} bytes, more "
                "than this machine's memory"
            ]
        for index in itertools.product(
            *(range(-(-s // c)) for s, c in zip(shape, chunk, strict=True))
        ):
            region = tuple(
                slice(i * c, min((i + 1) * c, s))
                for i, c, s in zip(index, chunk, shape, strict=True)
            )
            await (store[region].read() if region else store.read())
    except Exception as e:
        return [_problem(entry, storage.storage_error(f"array {name!r}", e))]
    return []


async def _check_typed_leaves(
    directory: epath.Path, tree: tree_room.TreeMetadata, registry: LeafHandlerRegistry
) -> list[str]:
    """Loads every leaf of a ``_TYPED_HANDLERS`` handler as a load without an abstract tree
    does (in batches of about ``BATCH_BYTES``), and drops the values."""
    plan = LoadPlan.without_abstract(tree, registry)
    context = cp.context.get_context()
    sizes = LoadSession(directory, tree, context)
    problems = []
    for handler_cls, _, params in plan.batches():
        if handler_cls not in _TYPED_HANDLERS:
            continue
        batch: list[DeserializationParam[Any]] = []
        batch_bytes = 0
        for param in [*params, None]:
            if param is not None:
                stored = sizes.stored_array(sizes.entry(param.keypath))
                batch.append(param)
                batch_bytes += stored.nbytes if stored is not None else 0
            if batch and (param is None or batch_bytes >= BATCH_BYTES):
                problems += await _load_leaves(directory, tree, handler_cls, batch)
                batch, batch_bytes = [], 0
    return problems


async def _load_leaves(
    directory: epath.Path,
    tree: tree_room.TreeMetadata,
    handler_cls: type,
    params: Sequence[DeserializationParam[Any]],
) -> list[str]:
    """The problem a load of these leaves by ``handler_cls`` meets (each leaf's, if several)."""
    context = cp.context.get_context()
    session = LoadSession(directory, tree, context)
    loading = leaves.PyTreeDeserializationContext(
        parent_dir=directory,
        ocdbt_checkpoint=tree.use_ocdbt,
        zarr3_checkpoint=tree.use_zarr3,
        session=session,
    )
    try:
        awaitable = await handler_cls(context=context).deserialize(list(params), loading)
        try:
            await session.reader.run()
        except BaseException:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            raise
        await awaitable
    except Exception as e:  # Whatever the load would raise; a builtin error is a problem too.
        if len(params) > 1:
            problems = []
            for param in params:
                problems += await _load_leaves(directory, tree, handler_cls, [param])
            return problems
        where = session.entry(params[0].keypath).keystr
        text = str(e) if isinstance(e, cp.errors.CheckpointError) else f"{type(e).__name__}: {e}"
        return [text if text.startswith(where) else f"{where}: {text}"]
    return []


async def verify_pytree(directory: epath.Path, registry: LeafHandlerRegistry) -> list[str]:
    """Every problem found in the pytree at ``directory`` (empty if all checksums match).

    Leaves of custom leaf handlers (in ``registry``) are not checked: their
    handlers own their files.
    """
    try:
        tree = tree_room.read_tree_metadata(directory)
        leaves.mark_orbax_keys(tree, directory)  # As a load does.
    except cp.errors.CheckpointError as e:
        return [str(e)]
    if tree.use_ocdbt:  # Every b-tree node against the save's list (a forged node).
        problems = await asyncio.to_thread(ocdbt.node_checksum_problems, directory)
        if problems:
            return problems  # Reading values through a changed b-tree proves nothing.
    session = LoadSession(directory, tree, cp.context.get_context())
    problems = _check_loadable(directory, tree, registry) + _check_layouts(session)
    if problems:
        return problems  # Reading chunks by a layout that cannot be trusted proves nothing.
    problems += await _check_array_set(session)
    try:
        problems += leaves.key_impl_problems(tree, directory)
    except cp.errors.CheckpointError as e:
        problems.append(str(e))
    problems += await _check_typed_leaves(directory, tree, registry)
    batch: list[tree_room.Entry] = []
    batch_bytes = 0
    for entry in tree.entries:
        if entry.value_type not in ARRAY_VALUE_TYPES:
            continue
        stored = session.stored_array(entry)
        if stored is not None and stored.direct and tree.use_ocdbt:
            batch.append(entry)
            batch_bytes += stored.nbytes
            if batch_bytes >= BATCH_BYTES:
                problems += await _check_batch(session, batch)
                cp.progress.advance(batch_bytes)
                batch, batch_bytes = [], 0
        else:
            problems += await _check_with_driver(session, entry)
            cp.progress.advance(stored.nbytes if stored is not None else 0)
    if batch:
        problems += await _check_batch(session, batch)
        cp.progress.advance(batch_bytes)
    strings = [e for e in tree.entries if e.value_type == STRING]
    if strings:
        try:
            stored_strings = session.strings()
        except cp.errors.CheckpointError as e:
            problems.append(str(e))
        else:
            for entry in strings:
                if tree.storage_name(entry.names) not in stored_strings:
                    problems.append(f"{entry.keystr}: missing from {directory / '_strings.json'}")
    return problems
