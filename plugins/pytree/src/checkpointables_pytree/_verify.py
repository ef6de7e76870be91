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
import math
from collections.abc import Iterator, Sequence
from typing import Any

import checkpointables as cp
import numpy as np
import tensorstore as ts
from checkpointables.serialization import DeserializationParam, LeafHandlerRegistry
from etils import epath

from checkpointables_pytree import io, leaves, ocdbt, storage, zarr3
from checkpointables_pytree import tree as tree_room
from checkpointables_pytree._load_plan import LoadPlan, check_array_count
from checkpointables_pytree.io import ArrayRead
from checkpointables_pytree.leaves import ARRAY_VALUE_TYPES, SCALAR, STRING, LoadSession

__all__ = ["verify_pytree", "unchecked_note"]

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
            problems.append(_problem(entry, _read_error("its zarr.json", e)))
            continue
        expected = zarr3.zarr_json(stored.shape, stored.dtype, stored.chunk_shape)
        # Parsed, so that a fill value of 0.0 equals 0 (TensorStore's for int4; ours was 0.0).
        if value != expected and _parsed(value) != _parsed(expected):
            problems.append(_zarr_json_problem(session, entry, value))
    return problems


def _zarr_json_problem(session: LoadSession, entry: tree_room.Entry, value: bytes) -> str:
    """Why ``value``, the array's ``zarr.json``, is not the one its record makes: it
    contradicts ``_METADATA`` (a load refuses it), or is otherwise missing or damaged."""
    name = session.tree.storage_name(entry.names)
    stored = session.stored_array(entry)
    assert stored is not None
    document = _parsed(value)
    try:
        shape, dtype, chunks = zarr3.zarr_shape_dtype(document if type(document) is dict else {})
    except cp.errors.MetadataError:
        problem = None
    else:
        recorded = (stored.shape, stored.dtype)
        problem = zarr3.record_contradiction(shape, dtype, chunks, recorded=recorded)
    if problem is not None:
        return str(zarr3.contradiction_error(entry.keystr, session.directory, name, problem))
    return (
        f"{entry.keystr}: its zarr.json is missing or damaged (other tools cannot read the array)"
    )


def _parsed(text: bytes) -> Any:
    """``text`` as JSON; ``None`` where it is none (no ``zarr.json`` of ours is)."""
    try:
        return cp.safe_json.loads(text, source="zarr.json")
    except cp.errors.MetadataError:
        return None


async def _check_batch(
    session: LoadSession, entries: Sequence[tree_room.Entry], held: Held = None
) -> list[str]:
    problems = await _check_zarr_metadata(session, entries)
    return problems + await _check_chunks(session, entries, held)


# A process-local tree's chunks: the keys its database holds, and the notes on the arrays
# it holds only some of (``None``: any other tree, which must hold every chunk).
Held = tuple[frozenset[str], list[str]] | None


async def _held_chunks(session: LoadSession) -> Held:
    """The chunk keys a process-local tree's database holds (it holds one process's shards
    of the global arrays: the others' are absent by design, not lost)."""
    if session.tree.process_local is None or not session.tree.use_ocdbt:
        return None
    kvstore = await ocdbt.open_kvstore(session.directory, ocdbt.make_context())
    keys = await kvstore.list()
    return frozenset(k.decode("utf-8", "replace") for k in keys), []


def _held_regions(session: LoadSession, entry: tree_room.Entry, held: Held) -> list[Any] | None:
    """The regions of ``entry``'s chunks that ``held`` says are stored (``None``: all of
    them are, or the tree must hold all), noting an array held only in part."""
    stored = session.stored_array(entry)
    if held is None or stored is None:
        return None
    name = session.tree.storage_name(entry.names)
    indices = stored.chunk_indices
    present = [i for i in indices if zarr3.chunk_key(name, i) in held[0]]
    if len(present) == len(indices):
        return None
    held[1].append(f"{entry.keystr} ({len(present)} of {len(indices)} chunks)")
    return [
        tuple(
            slice(i * c, min((i + 1) * c, s))
            for i, c, s in zip(index, stored.chunk_shape, stored.shape, strict=True)
        )
        for index in present
    ]


def process_local_note(tree: tree_room.TreeMetadata, partial: Sequence[str]) -> str:
    """The report's note on a process-local tree's arrays that hold only some chunks."""
    index, count = tree.process_local or (0, 0)
    return (
        f"saved process-locally by process {index} of {count} (primary_host=None): "
        f"{len(partial)} global array(s) hold only that process's shards, and only the "
        f"chunks held were checked: {', '.join(partial[:10])}{' ...' if len(partial) > 10 else ''}"
    )


def _check_loadable(
    directory: epath.Path, tree: tree_room.TreeMetadata, registry: LeafHandlerRegistry
) -> list[str]:
    """What a load without an abstract tree refuses before reading any array."""
    try:
        check_array_count(tree, directory)
        plan = LoadPlan.without_abstract(tree, registry, directory)
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


async def _check_chunks(
    session: LoadSession, entries: Sequence[tree_room.Entry], held: Held = None
) -> list[str]:
    reader = io.Reader(session.directory, fast_path=session.context.array_options.ocdbt_fast_path)
    reads = []
    for entry in entries:
        regions = _held_regions(session, entry, held)
        if regions == []:
            continue  # A process-local tree holding no shard of this array.
        read = ArrayRead(
            label=entry,
            name=session.tree.storage_name(entry.names),
            stored=session.stored_array(entry),
            convert=lambda pieces: None,
            regions=regions,
        )
        reads.append(read)
    reader.add_all(reads)
    try:
        await reader.run()
    except cp.errors.CheckpointError as e:
        if len(entries) == 1:
            return [_problem(entries[0], e)]
        # Check each array alone, to name every damaged one.
        problems = []
        for entry in entries:
            problems += await _check_chunks(session, [entry], _quiet(held))
        return problems
    return []


async def _check_with_driver(
    session: LoadSession, entry: tree_room.Entry, unchecked: list[str], held: Held = None
) -> list[str]:
    """Reads every chunk of ``entry``'s array through the driver (of a process-local tree:
    every chunk it holds); adds its name to ``unchecked`` if its chunks carry no checksum
    of their data."""
    name = session.tree.storage_name(entry.names)
    spec = io.Reader(
        session.directory, ocdbt=session.tree.use_ocdbt, zarr3=session.tree.use_zarr3
    ).array_spec(name)
    spec["fill_missing_data_reads"] = False
    try:
        store = await ts.open(spec, context=ocdbt.make_context(), open=True)
        problem = await _driver_layout_problem(session, entry, name, store, held is not None)
        if problem is not None:
            return [problem]
        if not _chunks_checksummed(store):
            unchecked.append(name)
        regions = _chunk_regions(store) if held is None else _held_driver_regions(store, name, held)
        for region in regions:
            await (store[region].read() if region else store.read())
    except Exception as e:
        return [_problem(entry, _read_error(f"array {name!r}", e))]
    return []


def _held_driver_regions(
    store: Any, name: str, held: tuple[frozenset[str], list[str]]
) -> list[tuple[slice, ...]]:
    """The regions of the array's stored chunks (shards) that a process-local tree's
    database holds (``held``), noting an array held only in part."""
    shape, chunk = tuple(int(s) for s in store.shape), _write_chunk(store)
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk, strict=True))
    prefix = zarr3.chunk_key(name, ()) + "/"
    indices = []
    for key in held[0]:
        parts = key[len(prefix) :].split("/") if key.startswith(prefix) else []
        index = tuple(int(p) for p in parts if p.isdigit())
        if len(index) == len(grid) == len(parts) and all(map(int.__lt__, index, grid)):
            indices.append(index)
    if len(indices) < math.prod(grid):
        held[1].append(f"{name!r} ({len(indices)} of {math.prod(grid)} chunks)")
    return [
        tuple(
            slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunk, shape, strict=True)
        )
        for index in sorted(indices)
    ]


def _quiet(held: Held) -> Held:
    """``held``, noting nothing more (the arrays checked again were noted once)."""
    return None if held is None else (held[0], [])


def _read_error(what: str, error: BaseException) -> Exception:
    """``storage_error``'s, naming the error's type where it says nothing (a MemoryError)."""
    if not str(error):
        return cp.errors.CheckpointError(f"Reading {what} failed: {type(error).__name__}")
    return storage.storage_error(what, error)


def _write_chunk(store: Any) -> tuple[int, ...]:
    """The shape of the array's stored chunks (its shards, if sharded)."""
    shape = tuple(int(s) for s in store.shape)
    chunk = store.chunk_layout.write_chunk.shape or store.chunk_layout.read_chunk.shape
    return tuple(int(c) if c else max(1, s) for c, s in zip(chunk or shape, shape, strict=True))


def _chunk_regions(store: Any) -> Iterator[tuple[slice, ...]]:
    """The region of each stored chunk, one at a time (``_driver_layout_problem`` has
    bounded their number by the chunks stored)."""
    shape = tuple(int(s) for s in store.shape)
    chunk = _write_chunk(store)
    for index in np.ndindex(*(-(-s // c) for s, c in zip(shape, chunk, strict=True))):
        yield tuple(
            slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunk, shape, strict=True)
        )


async def _driver_layout_problem(
    session: LoadSession, entry: tree_room.Entry, name: str, store: Any, process_local: bool
) -> str | None:
    """Why the array's ``zarr.json`` cannot be read as it says: it disagrees with
    ``_METADATA``, claims chunks larger than memory, or more chunks than are stored (a
    damaged or hostile shape, which no read should walk; a process-local tree holds only
    some, and only those are read)."""
    shape = tuple(int(s) for s in store.shape)
    dtype = store.dtype.numpy_dtype
    stored = session.stored_array(entry)
    chunk = _write_chunk(store)
    recorded = (stored.shape, stored.dtype) if stored is not None else None
    problem = zarr3.record_contradiction(
        shape, dtype, chunk, recorded=recorded, write_shape=entry.write_shape
    )
    if problem is not None:
        return str(zarr3.contradiction_error(entry.keystr, session.directory, name, problem))
    chunk_bytes = math.prod(chunk) * dtype.itemsize
    memory = io.physical_memory_bytes()
    if memory and chunk_bytes > memory:
        return (
            f"{entry.keystr}: its zarr.json claims chunks of {chunk_bytes:,} bytes, more "
            "than this machine's memory"
        )
    count = math.prod(-(-s // c) for s, c in zip(shape, chunk, strict=True))
    if count <= 1 or process_local:
        return None
    keys = await store.kvstore.list()
    held = sum(1 for k in keys if not _is_metadata_key(k))
    if count <= held:
        return None
    return (
        f"{entry.keystr} (array {name!r}): its zarr.json claims shape {shape} of {dtype} "
        f"({math.prod(shape) * dtype.itemsize:,} bytes) in {count:,} chunks of {chunk}, but "
        f"the checkpoint stores {held:,} chunk(s) of it: its zarr.json is damaged (a load "
        "cannot read it either); restore the checkpoint from a copy"
    )


def _is_metadata_key(key: bytes) -> bool:
    """Whether ``key`` (relative to an array) is one of its metadata files, not a chunk."""
    last = key.rsplit(b"/", 1)[-1]
    return last == b"zarr.json" or last.startswith(b".")


def _chunks_checksummed(store: Any) -> bool:
    """Whether every chunk of the array carries a checksum of its data: zarr3's ``crc32c``
    codec over each chunk (inside a shard, over each inner chunk). Orbax writes its shards
    with ``crc32c`` over the shard index only, and zarr2 arrays have no checksum."""
    codec = store.codec.to_json() if store.codec is not None else {}
    codecs = codec.get("codecs") or []
    for _ in range(8):  # Shards of shards: the innermost codecs encode the data.
        sharding = [c for c in codecs if c.get("name") == "sharding_indexed"]
        if not sharding:
            break
        codecs = (sharding[0].get("configuration") or {}).get("codecs") or []
    return any(c.get("name") == "crc32c" for c in codecs)


async def _check_typed_leaves(
    directory: epath.Path, tree: tree_room.TreeMetadata, registry: LeafHandlerRegistry
) -> list[str]:
    """Loads every leaf of a ``_TYPED_HANDLERS`` handler as a load without an abstract tree
    does (in batches of about ``BATCH_BYTES``), and drops the values."""
    plan = LoadPlan.without_abstract(tree, registry, directory)
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


async def verify_pytree(
    directory: epath.Path, registry: LeafHandlerRegistry, notes: list[str] | None = None
) -> list[str]:
    """Every problem found in the pytree at ``directory`` (empty if all checksums match).

    Leaves of custom leaf handlers (in ``registry``) are not checked: their
    handlers own their files. ``notes``, if given, receives what the report should
    say that is not a failure: arrays whose chunks carry no checksum of their data
    (Orbax's), whose values could not be checked.
    """
    try:
        tree = tree_room.read_tree_metadata(directory)
        leaves.mark_orbax_keys(tree, directory)  # As a load does.
    except cp.errors.CheckpointError as e:
        return [str(e)]
    if tree.use_ocdbt:  # Every b-tree node against the save's list (a forged node).
        try:  # Before anything reads the manifest and the root, which are read whole.
            await asyncio.to_thread(ocdbt.check_manifest, directory)
        except cp.errors.CheckpointError as e:
            return [str(e)]
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
    unchecked: list[str] = []
    held = await _held_chunks(session)
    problems += await _check_arrays(session, unchecked, held)
    problems += _check_strings(session)
    if unchecked and notes is not None:
        notes.append(unchecked_note(unchecked))
    if held is not None and held[1] and notes is not None:
        notes.append(process_local_note(tree, held[1]))
    return problems


def unchecked_note(names: Sequence[str]) -> str:
    """The report's note on the arrays ``names``, whose chunks carry no checksum."""
    shown = ", ".join(repr(n) for n in names[:10]) + (" ..." if len(names) > 10 else "")
    return (
        f"{len(names)} array(s) carry no checksum of their chunk data (Orbax writes none: "
        f"a zarr3 shard's CRC-32C covers only its index), so their values were read but not "
        f"checked: a flipped bit there loads a wrong value ({shown})"
    )


async def _check_arrays(session: LoadSession, unchecked: list[str], held: Held = None) -> list[str]:
    """Reads every chunk of every array: plain shards in batches, others by the driver."""
    tree = session.tree
    problems: list[str] = []
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
                problems += await _check_batch(session, batch, held)
                cp.progress.advance(batch_bytes)
                batch, batch_bytes = [], 0
        else:
            problems += await _check_with_driver(session, entry, unchecked, held)
            cp.progress.advance(stored.nbytes if stored is not None else 0)
    if batch:
        problems += await _check_batch(session, batch, held)
        cp.progress.advance(batch_bytes)
    return problems


def _check_strings(session: LoadSession) -> list[str]:
    """Every string leaf is in ``_strings.json``."""
    strings = [e for e in session.tree.entries if e.value_type == STRING]
    if not strings:
        return []
    try:
        stored_strings = session.strings()
    except cp.errors.CheckpointError as e:
        return [str(e)]
    return [
        f"{entry.keystr}: missing from {session.directory / '_strings.json'}"
        for entry in strings
        if session.tree.storage_name(entry.names) not in stored_strings
    ]
