"""``PyTreeHandler``: the checkpointable handler for pytrees of arrays, scalars and strings.

A save flattens the tree, groups the leaves by leaf handler (``_save_plan``)
and lets each handler schedule its writes on a shared ``SaveSession``; the
returned awaitable writes the arrays and the tree's own files together. A
load matches the tree (``_load_plan``), lets each leaf handler schedule its
reads on a shared ``LoadSession``, and the awaitable reads them all at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import checkpointables as cp
import crc32c
import jax
from checkpointables import execution
from checkpointables.serialization import LeafHandlerRegistry, StandardLeafHandlerRegistry
from etils import epath

from checkpointables_pytree import _verify, io, ocdbt, reuse, storage
from checkpointables_pytree import leaves as leaves_room
from checkpointables_pytree import tree as tree_room
from checkpointables_pytree._load_plan import LoadPlan, check_array_count, is_skip
from checkpointables_pytree._save_plan import (
    EntryCache,
    group_leaves,
    no_leaf_handler_advice,
    saved_tree_metadata,
    unsupported_leaves,
    warn_if_leafless,
)
from checkpointables_pytree.leaves import (
    LoadSession,
    PyTreeDeserializationContext,
    PyTreeSerializationContext,
    SaveSession,
)

__all__ = ["PyTreeHandler", "leaf_registry", "ORBAX_TYPESTR", "READABLE_TYPESTRS"]

logger = logging.getLogger("checkpointables.pytree")

# Checkpoints record Orbax's typestr for this handler, so Orbax loads them with its own.
ORBAX_TYPESTR = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
# What this handler also reads: what checkpoints recorded before, and Orbax V0's handlers.
READABLE_TYPESTRS = (
    "checkpointables_pytree._handler.PyTreeHandler",
    "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler",
)


def leaf_registry(context: cp.Context | None = None) -> LeafHandlerRegistry:
    """The leaf handler registry in force: the context's, or every plugin's."""
    context = cp.context.get_context(context)
    registry = context.pytree_options.leaf_handler_registry
    if registry is None:
        return StandardLeafHandlerRegistry()
    if not isinstance(registry, LeafHandlerRegistry):
        raise cp.errors.InvalidArgumentTypeError(
            "PyTreeOptions.leaf_handler_registry must be "
            "a cp.serialization.LeafHandlerRegistry, got "
            f"{type(registry).__name__}."
        )
    return registry


def _make_leaf_handler(handler_cls: type, context: cp.Context) -> Any:
    try:
        return handler_cls(context=context)
    except TypeError as e:
        raise cp.errors.PluginError(
            f"Leaf handler {handler_cls.__module__}.{handler_cls.__qualname__} cannot be built as "
            f"handler_cls(context=...): {e}. Leaf handlers "
            "must accept a `context` keyword argument."
        ) from e


def _discard(awaitables: Sequence[Any]) -> None:
    """Closes the background coroutines of a save or load that failed in its blocking phase."""
    for awaitable in awaitables:
        if inspect.iscoroutine(awaitable):
            awaitable.close()


def _owning(background: Any, awaitables: Sequence[Any]) -> Any:
    """``background``, which closes ``awaitables`` when it is dropped: if another handler's
    failure means it never runs, its leaf handlers' coroutines must not warn "never awaited"."""
    weakref.finalize(background, _discard_unstarted, list(awaitables))
    return background


def _discard_unstarted(awaitables: Sequence[Any]) -> None:
    _discard(
        [
            a
            for a in awaitables
            if inspect.iscoroutine(a) and inspect.getcoroutinestate(a) == inspect.CORO_CREATED
        ]
    )


async def _write(
    directory: cp.path.PathAwaitingCreation,
    session: SaveSession,
    metadata: Callable[[], tree_room.TreeMetadata],
    awaitables: Sequence[Any],
    reused: reuse.ReusePlan | None = None,
    staging: cp.staging.SaveStaging | None = None,
) -> None:
    """The background of a save: the arrays, the leaf handlers' awaitables and the tree's files.

    ``metadata`` makes the tree's ``_METADATA`` once the leaf handlers' deferred
    work (``session.plan()``) is done: neither is needed before the caller gets
    control back. Both allocate per leaf, with the collector paused. The most host
    memory the writes held at once is reported to ``staging``.
    """
    try:
        with execution.paused_gc():
            session.plan()
            tree = metadata()
        await _write_all(directory, session, tree, awaitables, reused)
        if staging is not None:
            staging.report(session.writer.staging.peak)
    except ValueError as e:  # TensorStore's errors: a full disk, ...
        translated = storage.write_error(e, f"the pytree in {directory.path}")
        if translated is e:
            raise
        raise translated from e


async def _write_all(
    directory: cp.path.PathAwaitingCreation,
    session: SaveSession,
    tree: tree_room.TreeMetadata,
    awaitables: Sequence[Any],
    reused: reuse.ReusePlan | None = None,
) -> None:
    # The tree's own files are written while the arrays are committed.
    arrays = asyncio.ensure_future(session.writer.run())
    others = asyncio.gather(*[a for a in awaitables if a is not None])
    try:
        path = await directory.await_creation()
        with execution.paused_gc():
            session.write_files(path)
            if session.primary:
                if session.strings:
                    tree.strings_crc32c = crc32c.crc32c(session.strings_text().encode())
                tree_room.write_tree_metadata(path, tree)
    finally:
        await asyncio.gather(arrays, others)
    if reused is not None:  # What a later incremental save compares (its data files written).
        await asyncio.to_thread(reused.write, path)
    if cp.multihost.process_count() == 1 and session.primary and not session.writer.empty:
        # The database is final (the writers' merged): its nodes' checksums, before the commit.
        await asyncio.to_thread(ocdbt.record_node_checksums, path)
    if cp.multihost.process_count() > 1 and not session.writer.empty:
        # Durable before this process reports that it finished writing.
        await asyncio.to_thread(io.flush_database, ocdbt.database_directory(path))
    if session.primary:
        _check_metadata_written(path)


def _check_metadata_written(path: epath.Path) -> None:
    """Raises unless the tree's ``_METADATA`` is still where this save wrote it (one stat,
    on a local disk only): no set of files without it reaches the commit, which would
    make a step that looks finished and cannot be loaded."""
    if not ocdbt.is_local(path):  # No directory to vanish; a request would cost time.
        return
    metadata = os.path.join(path, tree_room.METADATA_FILE)
    if not os.path.lexists(metadata):
        raise cp.errors.StorageError(
            f"{metadata}, written by this save, is gone: {path} was deleted or changed while "
            f"the save wrote it. This save is not committed; save again, and let no one "
            f"delete the checkpoint's directory while it is written."
        )


def _read_tree_metadata(directory: epath.Path) -> tree_room.TreeMetadata:
    """``_METADATA``, with the PRNG keys of a tree Orbax wrote marked as ours are."""
    tree = tree_room.read_tree_metadata(directory)
    leaves_room.mark_orbax_keys(tree, directory)
    return tree


def _deserialization_context(session: LoadSession) -> PyTreeDeserializationContext:
    return PyTreeDeserializationContext(
        parent_dir=session.directory,
        ocdbt_checkpoint=session.tree.use_ocdbt,
        zarr3_checkpoint=session.tree.use_zarr3,
        session=session,
    )


class PyTreeHandler:
    """Saves and loads pytrees of ``jax.Array``, ``np.ndarray``, scalars, strings and bytes.

    Leaves are handed in batches to the ``LeafHandler``\\ s of the registry in
    force (``cp.options.PyTreeOptions.leaf_handler_registry``, default: every
    plugin's). The directory layout is Orbax's: ``_METADATA``, an OCDBT
    database of zarr3 arrays (every chunk with a CRC-32C), ``_sharding``,
    ``_strings.json`` and ``array_metadatas/``.
    """

    def __init__(self) -> None:
        self._last_flat: tuple[Any, tree_room.Flat] | None = None
        self._last_abstract: tuple[Any, Any] | None = None

    # -- Resolution ---------------------------------------------------------------------

    def _flatten(self, tree: Any) -> tree_room.Flat:
        # Resolution calls is_handleable and then save on the same instance:
        # flatten the tree once for both.
        if self._last_flat is not None and self._last_flat[0] is tree:
            return self._last_flat[1]
        flat = tree_room.flatten(tree)
        self._last_flat = (tree, flat)
        return flat

    def _unsupported(self, tree: Any) -> list[tree_room.Leaf]:
        return unsupported_leaves(self._flatten(tree), EntryCache(leaf_registry()))

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for a pytree (or a single leaf) whose every leaf has a leaf handler."""
        if checkpointable is None or isinstance(checkpointable, type):
            return False
        return not self._unsupported(checkpointable)

    def unhandleable_reason(self, checkpointable: Any) -> str | None:
        """Why ``is_handleable`` is false, naming the unsupported leaves' key paths."""
        if checkpointable is None:
            return "it is None"
        bad = self._unsupported(checkpointable)
        return no_leaf_handler_advice(bad) if bad else None

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """True for abstract pytrees: containers, or a single abstract leaf a handler accepts.

        Unsupported leaves inside a container are reported by ``load`` with their key paths.
        """
        if abstract_checkpointable is None:
            return None
        leaves, _ = self._flatten_abstract(abstract_checkpointable)
        if len(leaves) == 1 and leaves[0][0] == ():
            leaf = leaves[0][1]
            return is_skip(leaf) or leaf_registry().is_abstract_handleable(leaf)
        return True

    def _flatten_abstract(self, abstract: Any) -> Any:
        # Resolution calls is_abstract_handleable and then load on the same instance.
        if self._last_abstract is None or self._last_abstract[0] is not abstract:
            self._last_abstract = (abstract, tree_room.flatten_abstract(abstract))
        return self._last_abstract[1]

    @staticmethod
    def recognizes(directory: epath.Path) -> bool:
        """Whether ``directory`` holds a pytree (has ``_METADATA``); for untyped checkpoints."""
        return cp.storage.exists(epath.Path(directory) / tree_room.METADATA_FILE)

    # -- Saving -------------------------------------------------------------------------------

    async def save(
        self, directory: cp.path.PathAwaitingCreation, checkpointable: Any
    ) -> Awaitable[None]:
        """Copies device data to host now; returns the awaitable that writes everything.

        Raises (before anything is written):
          cp.errors.NoHandlerForObjectError: some leaves have no leaf handler
            (the message lists their key paths), or cannot be stored.
          ValueError: two keys of one container have the same string form.
        """
        with execution.paused_gc():
            return await self._save(directory, checkpointable)

    async def _save(
        self, directory: cp.path.PathAwaitingCreation, checkpointable: Any
    ) -> Awaitable[None]:
        context = cp.context.get_context()
        registry = leaf_registry(context)
        flat = self._flatten(checkpointable)
        self._last_flat = None
        groups = group_leaves(flat, EntryCache(registry), directory.path)
        warn_if_leafless(checkpointable, flat, directory.path)
        session = SaveSession.create(directory, context, flat.structure.derived)
        serialization_context = PyTreeSerializationContext(parent_dir=directory, session=session)
        reused = None
        if (wanted := cp.reuse.current()) is not None:
            reused = await reuse.plan_reuse(directory.path, flat, context, wanted, session.writer)
        awaitables: list[Any] = []
        for handler_cls, group in groups.items():
            handler = _make_leaf_handler(handler_cls, context)
            try:
                awaitables.append(await handler.serialize(group, serialization_context))
            except BaseException:
                _discard(awaitables)
                raise
        # The _METADATA is made in the background, after what the leaf handlers deferred.
        made = functools.partial(saved_tree_metadata, groups, flat, session, registry)
        metadata = _recording_origin(made, context)
        staging = cp.staging.current()  # Where the background reports what it staged.
        background = _write(directory, session, metadata, awaitables, reused, staging)
        return _owning(background, awaitables)

    def reuse_report(self, directory: epath.Path) -> dict[str, str | None]:
        """Per array an incremental save tracked: the checkpoint its data was linked from,
        or ``None`` if the save wrote it (``cp.protocols.ReportsReuse``)."""
        return reuse.reuse_report(epath.Path(directory))

    async def finalize(self, directory: epath.Path) -> None:
        """Merges the processes' own databases into the root one (primary host, before the commit).

        Called once every process finished writing; a single-process save has
        nothing to merge.
        """
        if cp.multihost.process_count() > 1:
            context = cp.context.get_context()
            with storage.object_store_failures(directory, "Merging the databases of"):
                await asyncio.to_thread(io.merge_process_databases, directory, context)
                await asyncio.to_thread(ocdbt.record_node_checksums, directory)

    # -- Loading --------------------------------------------------------------------------------

    async def load(
        self, directory: epath.Path, abstract_checkpointable: Any = None
    ) -> Awaitable[Any]:
        """Reads the metadata and plans the reads now; returns the awaitable that reads.

        Raises (before reading any array):
          cp.errors.MetadataError: ``_METADATA`` is missing or malformed.
          cp.errors.TreeMismatchError: the abstract tree does not match (the
            message lists the key paths).
          cp.errors.MissingHandlerError: a leaf needs a leaf handler not in the registry.
        """
        with execution.paused_gc():
            return await self._load(directory, abstract_checkpointable)

    async def _load(
        self, directory: epath.Path, abstract_checkpointable: Any = None
    ) -> Awaitable[Any]:
        context = cp.context.get_context()
        registry = leaf_registry(context)
        opened, index, checking = _open_database(directory, context)
        with _settled_on_failure(index, checking):
            tree = _read_tree_metadata(directory)
            check_array_count(tree, directory)  # Before planning what the metadata claims.
            session = LoadSession(directory, tree, context, opened, index)
            if abstract_checkpointable is None:
                plan = LoadPlan.without_abstract(tree, registry, directory)
            else:
                flat = self._flatten_abstract(abstract_checkpointable)
                self._last_abstract = None
                plan = LoadPlan.with_abstract(
                    tree,
                    abstract_checkpointable,
                    registry,
                    partial=context.pytree_options.partial_load,
                    where=directory,
                    flat=flat,
                )
            deserialization_context = _deserialization_context(session)
            # Before the leaf handlers read anything of the database (a zarr.json, a value).
            with storage.object_store_failures(directory, "Reading the b-tree of"):
                await ocdbt.wait_for_node_check(checking)
        pending: list[tuple[list[int], Any]] = []
        for handler_cls, slots, params in plan.batches():
            handler = _make_leaf_handler(handler_cls, context)
            try:
                # A copy: the params are the plan template's.
                awaitable = await handler.deserialize(list(params), deserialization_context)
            except BaseException as e:
                _discard([a for _, a in pending])
                _name_directory(directory, e)
                raise
            pending.append((slots, awaitable))
        _warn_unplaced(session)

        async def background() -> Any:
            try:
                await session.reader.run()
            except BaseException as e:
                _discard([a for _, a in pending])
                _explain_failed_read(tree, directory, e)
                raise
            try:
                results = await asyncio.gather(*[a for _, a in pending])
            except cp.errors.IntegrityError as e:
                _explain_failed_read(tree, directory, e)
                raise
            with execution.paused_gc():
                put = plan.values.__setitem__
                for (slots, _), values in zip(pending, results, strict=True):
                    list(itertools.starmap(put, zip(slots, values, strict=True)))  # In C.
                return plan.build(tree, directory)

        return _owning(background(), [a for _, a in pending])

    async def metadata(self, directory: epath.Path) -> Any:
        """The abstract tree of what is stored (no array data is read)."""
        with execution.paused_gc():
            return await self._metadata(directory)

    async def _metadata(self, directory: epath.Path) -> Any:
        context = cp.context.get_context()
        registry = leaf_registry(context)
        tree = _read_tree_metadata(directory)
        session = LoadSession(directory, tree, context)
        plan = LoadPlan.without_abstract(tree, registry, directory)
        deserialization_context = _deserialization_context(session)
        for handler_cls, items in plan.groups.items():
            handler = _make_leaf_handler(handler_cls, context)
            values = await handler.metadata([p for _, p in items], deserialization_context)
            for (slot, _), value in zip(items, values, strict=True):
                plan.values[slot] = value
        return plan.build(tree, directory)

    async def verify(self, directory: epath.Path) -> list[str]:
        """Reads every chunk of every array and checks its checksum; returns the problems found.

        Arrays are checked one batch at a time, so memory stays bounded.
        """
        notes: list[str] = []
        problems = await _verify.verify_pytree(directory, leaf_registry(), notes=notes)
        return problems + [cp.protocols.VerifyNote(note) for note in notes]

    async def merge_partial(self, sources: Sequence[epath.Path], target: epath.Path) -> None:
        """Builds the pytree at ``target`` from partial saves' pytree directories (oldest first).

        Used by ``cp.partial.finalize``. The ``sources`` must sit inside
        ``target`` and stay there: no array data is copied, the merged database
        refers to theirs. Later sources replace earlier ones' keys.
        """
        from checkpointables_pytree import _partial

        _partial.merge_partial_saves(sources, target)

    async def combine_shards(self, sources: Sequence[epath.Path], target: epath.Path) -> None:
        """Builds the pytree at ``target`` whose arrays hold every shard stored in any of
        ``sources`` (process-local saves of one pytree, from the local tier's copies).

        Used by the training Checkpointer's local tier (``cp.protocols.CombinesShards``).
        The ``sources`` must sit inside ``target`` and stay there: no array data is
        copied, the combined database refers to theirs.
        """
        from checkpointables_pytree import _combine

        _combine.combine_shards(sources, target)


def _recording_origin(
    metadata: Callable[[], tree_room.TreeMetadata], context: cp.Context
) -> Callable[[], tree_room.TreeMetadata]:
    """``metadata``, recording in ``_METADATA`` that a process-local save of a job of several
    processes (``primary_host=None``) holds only this process's shards of global arrays:
    a load or ``verify`` elsewhere must not call the others' absent chunks damage."""
    if cp.multihost.process_count() == 1 or cp.multihost.is_coordinated(context):
        return metadata
    origin = {
        "process_index": cp.multihost.process_index(),
        "process_count": cp.multihost.process_count(),
    }

    def recorded() -> tree_room.TreeMetadata:
        tree = metadata()
        return dataclasses.replace(tree, extra={**tree.extra, tree_room.PROCESS_LOCAL: origin})

    return recorded


def _explain_process_local(
    tree: tree_room.TreeMetadata, directory: epath.Path, error: BaseException
) -> None:
    """Raises, for a chunk missing from a process-local tree (as such trees are: it holds
    one process's shards), the error that says so, from ``error``; returns otherwise."""
    # A checksum that does not match is damage, process-local or not: only a missing chunk.
    if tree.process_local is None or not isinstance(error, storage.MissingChunkError):
        return
    leaf, _, detail = str(error).partition(" failed its integrity check: ")
    raise cp.errors.InvalidArgumentError(
        f"{leaf} is not whole in {directory} ({detail.split('. ', 1)[0]}): "
        f"{tree.process_local_hint()}."
    ) from error


def _explain_failed_read(
    tree: tree_room.TreeMetadata, directory: epath.Path, error: BaseException
) -> None:
    """Raises the error that explains a chunk missing from a process-local tree; else names
    ``directory`` in ``error`` where it is an ``IntegrityError`` (the caller re-raises it)."""
    _explain_process_local(tree, directory, error)
    _name_directory(directory, error)


def _name_directory(directory: epath.Path, error: BaseException) -> None:
    """Names ``directory`` in a load's ``IntegrityError`` that does not name it already (a
    damaged chunk's names only the leaf), in place: with many steps open, the message must
    say which checkpoint is damaged."""
    if isinstance(error, cp.errors.IntegrityError) and str(directory) not in str(error):
        error.args = (f"{directory}: {error}",)


_UNPLACED_SHOWN = 5


def _warn_unplaced(session: LoadSession) -> None:
    """Warns once per load about arrays saved over more devices than this process has that
    the abstract tree gives no sharding (each loads whole onto the default device)."""
    unplaced = session.unplaced
    if not unplaced:
        return
    shown = ", ".join(unplaced[:_UNPLACED_SHOWN])
    hidden = len(unplaced) - _UNPLACED_SHOWN
    more = f", ... ({hidden} more)" if hidden > 0 else ""
    logger.warning(
        "%d array(s) of %s were saved sharded over more devices than this process has (%d), "
        "and the abstract tree gives them no sharding (%s%s): each is loaded whole onto the "
        "default device. Give those abstract leaves the shardings you want now, e.g. "
        "jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, spec)) (see "
        "docs/multi-host.md, 'Restoring, on any topology').",
        len(unplaced),
        session.directory,
        jax.device_count(),
        shown,
        more,
    )


def _open_database(
    directory: epath.Path, context: cp.Context
) -> tuple[ocdbt.OpenedDatabase | None, ocdbt.DatabaseIndex | None, Any]:
    """A load's database (TensorStore reads its manifest and root while ``_METADATA`` is
    parsed), its index, and the check of its b-tree against the save's record (a forged
    node can point a key at any bytes), for ``ocdbt.wait_for_node_check``.

    The index checks, and then reads no node again: on its thread, or here for a local
    database of a few values (TensorStore reads them; the index's thread would read its
    root for nothing, a fifth of a tiny load).
    """
    opened, index, many = None, None, False
    if context.array_options.ocdbt_fast_path:
        many = _many_leaves(directory)
        opened = ocdbt.OpenedDatabase.start(directory, many_values=many)
        index = opened.index if opened is not None else ocdbt.DatabaseIndex(directory)
    here = opened is not None and not many
    return opened, index, ocdbt.start_node_check(directory, index, here=here)


@contextlib.contextmanager
def _settled_on_failure(
    index: ocdbt.DatabaseIndex | None, checking: concurrent.futures.Future[Any]
) -> Iterator[None]:
    """On failure, waits for the reads ``_open_database`` started before raising: a load
    that raises (a malformed ``_METADATA``, a tree mismatch) leaves nothing of its own
    running, reading the directory or its server after the caller has moved on."""
    try:
        yield
    except BaseException:
        concurrent.futures.wait([checking])
        if index is not None:
            index.settle()
        raise


def _many_leaves(directory: epath.Path) -> bool:
    """Whether the ``_METADATA`` in ``directory`` records many leaves (by its size)."""
    try:
        size = os.stat(os.path.join(directory, tree_room.METADATA_FILE)).st_size
    except OSError:
        return False  # No _METADATA: reading it reports that.
    return size > ocdbt.PREFETCH_METADATA_BYTES
