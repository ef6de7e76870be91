"""``checkpointables verify`` for pytrees: read every chunk, check every checksum.

Small arrays are checked in batches of keys (checksums computed here). A large
array is checked twice: whole, against the checksums ``_METADATA`` recorded
for its chunks (what a load checks), then shard by shard through the zarr3
driver, which checks each chunk's CRC-32C (what every zarr3 reader checks).
At most one batch or one large array is in memory at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import checkpointables as cp
import tensorstore as ts
from checkpointables.serialization import LeafHandlerRegistry
from etils import epath

from checkpointables_pytree import _database, _errors, _tree_metadata, _zarr3
from checkpointables_pytree._leaf_handlers import ARRAY_VALUE_TYPES, STRING
from checkpointables_pytree._session import LoadSession

__all__ = ["verify_pytree"]


def _problem(entry: _tree_metadata.Entry, error: BaseException) -> str:
    return f"{entry.keystr}: {error}"


async def _check_zarr_metadata(
    session: LoadSession, entries: Sequence[_tree_metadata.Entry]
) -> list[str]:
    """Compares each batched array's ``zarr.json`` with the one this library writes for it."""
    kvstore = await ts.KvStore.open(
        _database.kvstore_spec(session.directory), context=_database.make_context()
    )
    names = [session.tree.storage_name(e.names) for e in entries]
    futures = [kvstore.read(f"{n}/zarr.json") for n in names]
    problems = []
    for entry, future in zip(entries, futures, strict=True):
        stored = session.stored_array(entry)
        assert stored is not None
        try:
            value = (await future).value
        except Exception as e:
            problems.append(_problem(entry, _errors.storage_error("its zarr.json", e)))
            continue
        if value != _zarr3.zarr_json(stored.shape, stored.dtype, stored.chunk_shape):
            problems.append(
                f"{entry.keystr}: its zarr.json is missing or "
                "damaged (other tools cannot read the array)"
            )
    return problems


async def _check_batch(session: LoadSession, entries: Sequence[_tree_metadata.Entry]) -> list[str]:
    problems = await _check_zarr_metadata(session, entries)
    return problems + await _check_chunks(session, entries)


async def _check_chunks(session: LoadSession, entries: Sequence[_tree_metadata.Entry]) -> list[str]:
    reader = _database.ArrayReader(session.directory)
    for entry in entries:
        reader.add(
            _database.ArrayRead(
                label=entry,
                name=session.tree.storage_name(entry.names),
                stored=session.stored_array(entry),
                convert=lambda pieces: None,
            )
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


async def _check_with_driver(session: LoadSession, entry: _tree_metadata.Entry) -> list[str]:
    name = session.tree.storage_name(entry.names)
    spec = _database.ArrayReader(
        session.directory, ocdbt=session.tree.use_ocdbt, zarr3=session.tree.use_zarr3
    ).array_spec(name)
    spec["fill_missing_data_reads"] = False
    try:
        store = await ts.open(spec, context=_database.make_context(), open=True)
        shape = tuple(int(s) for s in store.shape)
        chunk = store.chunk_layout.write_chunk.shape or store.chunk_layout.read_chunk.shape
        chunk = tuple(
            int(c) if c else max(1, s) for c, s in zip(chunk or shape, shape, strict=True)
        )
        for index in itertools.product(
            *(range(-(-s // c)) for s, c in zip(shape, chunk, strict=True))
        ):
            region = tuple(
                slice(i * c, min((i + 1) * c, s))
                for i, c, s in zip(index, chunk, shape, strict=True)
            )
            await (store[region].read() if region else store.read())
    except Exception as e:
        return [_problem(entry, _errors.storage_error(f"array {name!r}", e))]
    return []


async def verify_pytree(directory: epath.Path, registry: LeafHandlerRegistry) -> list[str]:
    """Every problem found in the pytree at ``directory`` (empty if all checksums match).

    Leaves of custom leaf handlers (in ``registry``) are not checked: their
    handlers own their files.
    """
    try:
        tree = _tree_metadata.read_tree_metadata(directory)
    except cp.errors.CheckpointError as e:
        return [str(e)]
    session = LoadSession(directory, tree, cp.context.get_context())
    problems: list[str] = []
    batch: list[_tree_metadata.Entry] = []
    batch_bytes = 0
    for entry in tree.entries:
        if entry.value_type not in ARRAY_VALUE_TYPES:
            continue
        stored = session.stored_array(entry)
        if stored is not None and stored.direct and stored.nbytes <= _database.SMALL_ARRAY_BYTES:
            batch.append(entry)
            batch_bytes += stored.nbytes
            if batch_bytes >= _database.SMALL_BATCH_BYTES:
                problems += await _check_batch(session, batch)
                cp.progress.advance(batch_bytes)
                batch, batch_bytes = [], 0
        else:
            recorded = stored is not None and stored.checksums is not None
            found = await _check_chunks(session, [entry]) if recorded else []
            problems += found or await _check_with_driver(session, entry)
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
