"""``PyTreeHandler``: the checkpointable handler for pytrees of arrays, scalars and strings."""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import checkpointables as cp
import crc32c
import jax
from checkpointables import execution
from checkpointables.serialization import (
    DeserializationParam,
    LeafEntry,
    LeafHandlerRegistry,
    SerializationParam,
    StandardLeafHandlerRegistry,
)
from etils import epath

from checkpointables_pytree import (
    _errors,
    _keys,
    _multiprocess,
    _ocdbt,
    _read,
    _tree,
    _tree_metadata,
    _verify,
)
from checkpointables_pytree._session import (
    LoadSession,
    NamedDeserializationParam,
    NamedSerializationParam,
    PyTreeDeserializationContext,
    PyTreeSerializationContext,
    SaveSession,
)

__all__ = ["PyTreeHandler", "leaf_registry", "ORBAX_TYPESTR", "READABLE_TYPESTRS"]

# Checkpoints record Orbax's typestr for this handler, so Orbax loads them with its own.
ORBAX_TYPESTR = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
# What this handler also reads: what checkpoints recorded before, and Orbax V0's handlers.
READABLE_TYPESTRS = (
    "checkpointables_pytree._handler.PyTreeHandler",
    "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler",
)
_PLACEHOLDER_TYPE = "placeholder"  # Orbax's value_type for skipped leaves of partial saves.
_MAX_LISTED = 20


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


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    if len(items) > _MAX_LISTED:
        shown += f", ... ({len(items) - _MAX_LISTED} more)"
    return shown


class _EntryCache:
    """Leaf type -> registry entry, looked up once per type."""

    def __init__(self, registry: LeafHandlerRegistry) -> None:
        self._registry = registry
        self._by_type: dict[type, LeafEntry | None] = {}

    def __call__(self, value: Any) -> LeafEntry | None:
        t = type(value)
        try:
            return self._by_type[t]
        except KeyError:
            entry = self._by_type[t] = self._registry.entry_for_leaf(t)
            return entry


def _own_value_type(registry: LeafHandlerRegistry, entry: LeafEntry) -> str | None:
    """What to record besides ``entry.typestr`` when that typestr finds another leaf handler.

    A PRNG key's Orbax value type is ``jax.Array``, which the array handler
    also writes: the key handler's own typestr is recorded too, so loads find it.
    """
    found = registry.entry_for_typestr(entry.typestr)
    if found is None or found.handler_cls is entry.handler_cls:
        return None
    for candidate in (*entry.secondary_typestrs[1:], cp.handlers.typestr(entry.handler_cls)):
        found = registry.entry_for_typestr(candidate)
        if found is not None and found.handler_cls is entry.handler_cls:
            return candidate
    return None


def _saved_tree_metadata(
    groups: Mapping[type, list[tuple[SerializationParam[Any], LeafEntry, _tree.Leaf]]],
    flat: _tree.Flat,
    session: SaveSession,
    registry: LeafHandlerRegistry,
) -> _tree_metadata.TreeMetadata:
    """The ``_METADATA`` of a save: an entry per leaf (in ``groups``) and per empty node."""
    write_shapes, extras = session.write_shapes, session.extras
    entries: list[_tree_metadata.Entry] = []
    own_types: dict[int, str | None] = {}  # Per registration (by id), not per leaf.
    for items in groups.values():
        last_entry, own_type = None, None
        for param, entry, leaf in items:
            if entry is not last_entry:
                last_entry = entry
                if id(entry) not in own_types:
                    own_types[id(entry)] = _own_value_type(registry, entry)
                own_type = own_types[id(entry)]
            name = param.name
            extra = extras.get(name) or {}
            if own_type is not None:
                extra = {**extra, _tree_metadata.OWN_VALUE_TYPE: own_type}
            entries.append(
                _tree_metadata.Entry(
                    names=leaf.names,
                    key_types=leaf.key_types,
                    value_type=entry.typestr,
                    write_shape=write_shapes.get(name),
                    extra=extra,
                )
            )
    for path, kind in flat.empty:
        entries.append(
            _tree_metadata.Entry(
                names=_tree.key_names(path),
                key_types=tuple(_tree.key_type(k) for k in path),
                value_type=kind,
                skip_deserialize=True,
            )
        )
    entries.sort(key=lambda e: e.names)
    return _tree_metadata.TreeMetadata(
        entries=entries,
        tuple_paths=frozenset(_tree.key_names(p) for p in flat.tuples),
        own_value_types=any(t is not None for t in own_types.values()),
    )


def _describe_type(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _empty_value(value_type: str) -> Any:
    # An empty named tuple loads as {}, as non-empty ones load as dicts of their fields.
    return {"Dict": {}, "List": [], "Tuple": (), "None": None, "NamedTuple": {}}[value_type]


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


def _is_skip(abstract: Any) -> bool:
    return (
        abstract is None
        or abstract is cp.PLACEHOLDER
        or (type(abstract) in (dict, list, tuple) and not abstract)
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
        self._last_flat: tuple[Any, _tree.Flat] | None = None

    # -- Resolution ---------------------------------------------------------------------

    def _flatten(self, tree: Any) -> _tree.Flat:
        # Resolution calls is_handleable and then save on the same instance:
        # flatten the tree once for both.
        if self._last_flat is not None and self._last_flat[0] is tree:
            return self._last_flat[1]
        flat = _tree.flatten(tree)
        self._last_flat = (tree, flat)
        return flat

    def _unsupported(self, tree: Any) -> list[str]:
        lookup = _EntryCache(leaf_registry())
        return [
            f"{_tree.keystr(leaf.names, leaf.key_types)} ({_describe_type(leaf.value)})"
            for leaf in self._flatten(tree).leaves
            if lookup(leaf.value) is None
        ]

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
        if not bad:
            return None
        return (
            f"no leaf handler accepts the leaves {_listing(bad)}. Convert them to arrays, scalars "
            "or strings, or add a leaf handler for their type "
            "(cp.serialization.StandardLeafHandlerRegistry"
            f"().add(...) in cp.options.PyTreeOptions(leaf_handler_registry=...))"
        )

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """True for abstract pytrees: containers, or a single abstract leaf a handler accepts.

        Unsupported leaves inside a container are reported by ``load`` with their key paths.
        """
        if abstract_checkpointable is None:
            return None
        leaves, _ = _tree.flatten_abstract(abstract_checkpointable)
        if len(leaves) == 1 and leaves[0][0] == ():
            leaf = leaves[0][1]
            return _is_skip(leaf) or leaf_registry().is_abstract_handleable(leaf)
        return True

    @staticmethod
    def recognizes(directory: epath.Path) -> bool:
        """Whether ``directory`` holds a pytree (has ``_METADATA``); for untyped checkpoints."""
        return cp.storage.exists(epath.Path(directory) / _tree_metadata.METADATA_FILE)

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
        lookup = _EntryCache(registry)
        flat = self._flatten(checkpointable)
        self._last_flat = None
        groups: dict[type, list[tuple[SerializationParam[Any], LeafEntry, _tree.Leaf]]] = {}
        unsupported = []
        seen: dict[tuple[str, ...], tuple[Any, ...]] = {}
        for leaf in flat.leaves:
            entry = lookup(leaf.value)
            names = leaf.names
            if names in seen:
                raise cp.errors.InvalidArgumentError(
                    f"Two keys of one container have the same string form: "
                    f"{jax.tree_util.keystr(seen[names])} and "
                    f"{jax.tree_util.keystr(leaf.keypath)}. "
                    f"Rename one of them; checkpoints record keys as strings."
                )
            seen[names] = leaf.keypath
            if entry is None:
                unsupported.append(
                    f"{jax.tree_util.keystr(leaf.keypath) or '<root>'} "
                    f"({_describe_type(leaf.value)})"
                )
                continue
            param = NamedSerializationParam(
                keypath=leaf.keypath, value=leaf.value, storage_name=_tree.storage_name(names)
            )
            groups.setdefault(entry.handler_cls, []).append((param, entry, leaf))
        if unsupported:
            raise cp.errors.NoHandlerForObjectError(
                f"Cannot save the pytree to {directory.path}: no leaf handler accepts the leaves "
                f"{_listing(unsupported)}. Convert them to "
                "arrays, scalars or strings, or register a leaf "
                f"handler for their type. Nothing was written."
            )

        session = SaveSession.create(directory, context)
        serialization_context = PyTreeSerializationContext(parent_dir=directory, session=session)
        awaitables: list[Any] = []
        for handler_cls, items in groups.items():
            handler = _make_leaf_handler(handler_cls, context)
            try:
                awaitables.append(
                    await handler.serialize([p for p, _, _ in items], serialization_context)
                )
            except BaseException:
                _discard(awaitables)
                raise

        async def background() -> None:
            try:
                await write()
            except ValueError as e:  # TensorStore's errors: a full disk, ...
                translated = _errors.write_error(e, f"the pytree in {directory.path}")
                if translated is e:
                    raise
                raise translated from e

        async def write() -> None:
            session.plan()  # What the leaf handlers left for after the caller got control back.
            tree = _saved_tree_metadata(groups, flat, session, registry)
            # The tree's own files are written while the arrays are committed.
            arrays = asyncio.ensure_future(session.writer.run())
            others = asyncio.gather(*[a for a in awaitables if a is not None])
            try:
                path = await directory.await_creation()
                with execution.paused_gc():
                    session.write_files(path)
                    if cp.multihost.is_primary_host(context):
                        if session.strings:
                            tree.strings_crc32c = crc32c.crc32c(session.strings_text().encode())
                        _tree_metadata.write_tree_metadata(path, tree)
            finally:
                await asyncio.gather(arrays, others)
            if cp.multihost.process_count() > 1 and not session.writer.empty:
                # Durable before this process reports that it finished writing.
                await asyncio.to_thread(
                    _multiprocess.flush_database, _ocdbt.database_directory(path)
                )

        return _owning(background(), awaitables)

    async def finalize(self, directory: epath.Path) -> None:
        """Merges the processes' own databases into the root one (primary host, before the commit).

        Called once every process finished writing; a single-process save has
        nothing to merge.
        """
        if cp.multihost.process_count() > 1:
            context = cp.context.get_context()
            with _errors.object_store_failures(directory, "Merging the databases of"):
                await asyncio.to_thread(_multiprocess.merge_process_databases, directory, context)

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
        # TensorStore reads the database's manifest and root while _METADATA is parsed.
        opened = _read.OpenedDatabase.start(directory)
        tree = _tree_metadata.read_tree_metadata(directory)
        _keys.mark_orbax_keys(tree, directory)
        session = LoadSession(directory, tree, context, opened)
        if abstract_checkpointable is None:
            plan = _Plan.without_abstract(tree, registry)
        else:
            plan = _Plan.with_abstract(
                tree,
                abstract_checkpointable,
                registry,
                partial=context.pytree_options.partial_load,
                where=directory,
            )
        deserialization_context = PyTreeDeserializationContext(
            parent_dir=directory,
            ocdbt_checkpoint=tree.use_ocdbt,
            zarr3_checkpoint=tree.use_zarr3,
            session=session,
        )
        pending: list[tuple[list[int], Any]] = []
        for handler_cls, items in plan.groups.items():
            handler = _make_leaf_handler(handler_cls, context)
            try:
                awaitable = await handler.deserialize(
                    [p for _, p in items], deserialization_context
                )
            except BaseException:
                _discard([a for _, a in pending])
                raise
            pending.append(([slot for slot, _ in items], awaitable))

        async def background() -> Any:
            try:
                await session.reader.run()
            except BaseException:
                _discard([a for _, a in pending])
                raise
            results = await asyncio.gather(*[a for _, a in pending])
            with execution.paused_gc():
                for (slots, _), values in zip(pending, results, strict=True):
                    for slot, value in zip(slots, values, strict=True):
                        plan.values[slot] = value
                return plan.build(tree, directory)

        return _owning(background(), [a for _, a in pending])

    async def metadata(self, directory: epath.Path) -> Any:
        """The abstract tree of what is stored (no array data is read)."""
        with execution.paused_gc():
            return await self._metadata(directory)

    async def _metadata(self, directory: epath.Path) -> Any:
        context = cp.context.get_context()
        registry = leaf_registry(context)
        tree = _tree_metadata.read_tree_metadata(directory)
        _keys.mark_orbax_keys(tree, directory)
        session = LoadSession(directory, tree, context)
        plan = _Plan.without_abstract(tree, registry)
        deserialization_context = PyTreeDeserializationContext(
            parent_dir=directory,
            ocdbt_checkpoint=tree.use_ocdbt,
            zarr3_checkpoint=tree.use_zarr3,
            session=session,
        )
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
        return await _verify.verify_pytree(directory, leaf_registry())

    async def merge_partial(self, sources: Sequence[epath.Path], target: epath.Path) -> None:
        """Builds the pytree at ``target`` from partial saves' pytree directories (oldest first).

        Used by ``cp.partial.finalize``. The ``sources`` must sit inside
        ``target`` and stay there: no array data is copied, the merged database
        refers to theirs. Later sources replace earlier ones' keys.
        """
        from checkpointables_pytree import _partial  # Only partial saves need it.

        _partial.merge_partial_saves(sources, target)


class _Plan:
    """Which leaf handler reads which leaf, and how the result tree is built."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.groups: dict[type, list[tuple[int, DeserializationParam[Any]]]] = {}
        self.slots: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        self.treedef: Any = None

    def _add(self, handler_cls: type, param: DeserializationParam[Any]) -> None:
        self.groups.setdefault(handler_cls, []).append((len(self.values) - 1, param))

    @classmethod
    def without_abstract(
        cls, tree: _tree_metadata.TreeMetadata, registry: LeafHandlerRegistry
    ) -> _Plan:
        plan = cls()
        unknown: dict[str, list[str]] = {}
        slots, values, groups = plan.slots, plan.values, plan.groups
        # Per value type: the list of its handler's group (looked up once per type).
        group_of: dict[str, list[tuple[int, DeserializationParam[Any]]] | None] = {}
        jax_keypath = _tree.jax_keypath
        own_value_type = _tree_metadata.OWN_VALUE_TYPE
        own_value_types = tree.own_value_types
        for entry in tree.entries:
            names, value_type = entry.names, entry.value_type
            slots.append((names, entry.key_types))
            if entry.skip_deserialize and value_type in _tree.EMPTY_TYPES:
                values.append(_empty_value(value_type))
                continue
            if value_type == _PLACEHOLDER_TYPE:
                values.append(cp.PLACEHOLDER)
                continue
            values.append(None)
            if own_value_types:
                value_type = entry.extra.get(own_value_type) or value_type
            try:
                group = group_of[value_type]
            except KeyError:
                # A leaf's own value type unknown here falls back to its Orbax value type.
                leaf_entry = registry.entry_for_typestr(value_type) or registry.entry_for_typestr(
                    entry.value_type
                )
                group = group_of[value_type] = (
                    None if leaf_entry is None else groups.setdefault(leaf_entry.handler_cls, [])
                )
            if group is None:
                unknown.setdefault(value_type, []).append(entry.keystr)
                continue
            group.append(
                (
                    len(values) - 1,
                    NamedDeserializationParam(
                        keypath=jax_keypath(names, entry.key_types), value=None, names=names
                    ),
                )
            )
        if unknown:
            described = "; ".join(f"{t!r} for {_listing(paths)}" for t, paths in unknown.items())
            raise cp.errors.MissingHandlerError(
                "No leaf handler registered here reads the "
                f"value types {described}. They were saved by "
                "custom leaf handlers: pass a registry "
                "holding them, e.g. cp.Context(pytree_options="
                "cp.options.PyTreeOptions(leaf_handler_registry=registry)), "
                "or skip those leaves with "
                f"cp.PLACEHOLDER in an abstract tree."
            )
        return plan

    @classmethod
    def with_abstract(
        cls,
        tree: _tree_metadata.TreeMetadata,
        abstract: Any,
        registry: LeafHandlerRegistry,
        *,
        partial: bool,
        where: epath.Path,
    ) -> _Plan:
        plan = cls()
        leaves, plan.treedef = _tree.flatten_abstract(abstract)
        stored = {e.names: e for e in tree.entries}
        inner: set[tuple[str, ...]] = set()
        for names in stored:
            inner.update(names[:i] for i in range(len(names)))
        used: set[tuple[str, ...]] = set()
        skipped: set[tuple[str, ...]] = set()
        extra, unsupported, shape_of_tree = [], [], []
        for keypath, leaf in leaves:
            names = _tree.key_names(keypath)
            plan.values.append(leaf)
            shown = jax.tree_util.keystr(keypath) or "<root>"
            if _is_skip(leaf):
                if names in stored or names in inner:
                    skipped.add(names)
                else:
                    extra.append(shown)
                continue
            entry = stored.get(names)
            if entry is None or entry.is_empty_node:
                if names in inner:
                    shape_of_tree.append(
                        f"{shown} (a leaf in the abstract tree, a subtree in the checkpoint)"
                    )
                elif entry is not None:
                    shape_of_tree.append(f"{shown} (an empty {entry.value_type} in the checkpoint)")
                else:
                    extra.append(shown)
                continue
            leaf_entry = registry.entry_for_abstract(leaf)
            if leaf_entry is None:
                unsupported.append(f"{shown} ({_describe_type(leaf)})")
                continue
            used.add(names)
            plan._add(
                leaf_entry.handler_cls,
                NamedDeserializationParam(keypath=tuple(keypath), value=leaf, names=names),
            )
        missing = []
        for entry in tree.entries:
            names = entry.names
            if names in used or any(names[:i] in skipped for i in range(len(names) + 1)):
                continue
            # An empty node (optax.EmptyState(), an empty dataclass) has no leaf in the
            # abstract tree's flattening: look for it there.
            if entry.is_empty_node and _tree.has_empty_node(abstract, names):
                continue
            missing.append(entry.keystr)
        if unsupported:
            raise cp.errors.TreeMismatchError(
                f"No leaf handler accepts these abstract leaves: {_listing(unsupported)}. Use "
                "jax.ShapeDtypeStruct, np.empty(...), a "
                "scalar, a str, None or cp.PLACEHOLDER, or a "
                f"registered custom abstract type."
            )
        if extra or shape_of_tree or (missing and not partial):
            lines = [f"The abstract tree does not match the pytree stored in {where}:"]
            if extra:
                lines.append(
                    "  in the abstract tree but not in the "
                    f"checkpoint ({len(extra)}): {_listing(extra)}"
                )
            if shape_of_tree:
                lines.append(
                    f"  different structure ({len(shape_of_tree)}): {_listing(shape_of_tree)}"
                )
            if missing and not partial:
                lines.append(
                    "  in the checkpoint but not in the abstract "
                    f"tree ({len(missing)}): {_listing(missing)}"
                )
            lines.append(
                "Fix the abstract tree (cp.pytree_metadata(path).metadata "
                "shows what is stored); to load "
                "only part of the tree pass partial_load=True, "
                "or put cp.PLACEHOLDER where a leaf should "
                "be skipped."
            )
            raise cp.errors.TreeMismatchError("\n".join(lines))
        return plan

    def build(self, tree: _tree_metadata.TreeMetadata, where: epath.Path) -> Any:
        """The result tree: the abstract tree's structure, or the recorded one."""
        if self.treedef is not None:
            return jax.tree_util.tree_unflatten(self.treedef, self.values)
        if not self.slots:
            return {}
        items = [
            (names, types, value)
            for (names, types), value in zip(self.slots, self.values, strict=True)
        ]
        return _tree.unflatten(
            items,
            tree.tuple_paths,
            on_conflict=lambda message: cp.errors.MetadataError(
                f"{where / _tree_metadata.METADATA_FILE} is malformed: {message}."
            ),
        )
