"""What a save decides before writing: which leaf handler takes each leaf, and the ``_METADATA``."""

from __future__ import annotations

from typing import Any

import checkpointables as cp
import jax
from checkpointables.serialization import (
    LeafEntry,
    LeafHandlerRegistry,
    SerializationParam,
)

from checkpointables_pytree import _tree, _tree_metadata
from checkpointables_pytree._errors import describe_type, listing
from checkpointables_pytree._session import NamedSerializationParam, SaveSession

__all__ = ["EntryCache", "Groups", "group_leaves", "saved_tree_metadata"]

# Per leaf handler class: its leaves, as (param, registry entry, flattened leaf).
Groups = dict[type, list[tuple[SerializationParam[Any], LeafEntry, _tree.Leaf]]]


class EntryCache:
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


def group_leaves(flat: _tree.Flat, lookup: EntryCache, where: Any) -> Groups:
    """The leaves of ``flat`` grouped by leaf handler, each with its storage name.

    Raises (naming ``where``):
      cp.errors.InvalidArgumentError: two keys of one container have the same string form.
      cp.errors.NoHandlerForObjectError: some leaves have no leaf handler.
    """
    groups: Groups = {}
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
                f"{jax.tree_util.keystr(leaf.keypath) or '<root>'} ({describe_type(leaf.value)})"
            )
            continue
        param = NamedSerializationParam(
            keypath=leaf.keypath, value=leaf.value, storage_name=_tree.storage_name(names)
        )
        groups.setdefault(entry.handler_cls, []).append((param, entry, leaf))
    if unsupported:
        raise cp.errors.NoHandlerForObjectError(
            f"Cannot save the pytree to {where}: no leaf handler accepts the leaves "
            f"{listing(unsupported)}. Convert them to "
            "arrays, scalars or strings, or register a leaf "
            f"handler for their type. Nothing was written."
        )
    return groups


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


def saved_tree_metadata(
    groups: Groups,
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
