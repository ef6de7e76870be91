"""What a save decides before writing: which leaf handler takes each leaf, and the ``_METADATA``."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
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

__all__ = ["EntryCache", "LeafGroup", "Groups", "group_leaves", "saved_tree_metadata"]


class EntryCache:
    """Leaf type -> registry entry, looked up once per type."""

    def __init__(self, registry: LeafHandlerRegistry) -> None:
        self._registry = registry
        self._by_type: dict[type, LeafEntry | None] = {}

    def __call__(self, leaf_type: type) -> LeafEntry | None:
        try:
            return self._by_type[leaf_type]
        except KeyError:
            entry = self._by_type[leaf_type] = self._registry.entry_for_leaf(leaf_type)
            return entry


class LeafGroup(Sequence[SerializationParam[Any]]):
    """The leaves of a save one leaf handler takes: its ``params``, made when first read.

    The standard handlers read ``values`` in the blocking phase and the params in
    the background one: an async save's caller waits for no per-leaf object.
    """

    def __init__(self, flat: _tree.Flat, indices: Sequence[int], entries: dict[type, Any]) -> None:
        self.flat = flat
        self.indices = indices
        self.entries = entries  # Leaf type -> registry entry.

    @functools.cached_property
    def values(self) -> list[Any]:
        """The leaves' values."""
        values = self.flat.values
        return values if len(self.indices) == len(values) else [values[i] for i in self.indices]

    @functools.cached_property
    def params(self) -> list[NamedSerializationParam]:
        """The leaves as ``SerializationParam``\\ s (with their storage names)."""
        s = self.flat.structure
        names = s.storage_names
        return [
            NamedSerializationParam(keypath=s.keypaths[i], value=v, storage_name=names[i])
            for i, v in zip(self.indices, self.values, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: Any) -> Any:
        return self.params[index]

    def __iter__(self) -> Iterator[SerializationParam[Any]]:
        return iter(self.params)


# Leaf handler class -> its leaves.
Groups = dict[type, LeafGroup]


def group_leaves(flat: _tree.Flat, lookup: EntryCache, where: Any) -> Groups:
    """The leaves of ``flat`` grouped by leaf handler (one lookup per leaf type).

    Raises (naming ``where``):
      cp.errors.InvalidArgumentError: two keys of one container have the same string form.
      cp.errors.NoHandlerForObjectError: some leaves have no leaf handler.
    """
    same = flat.structure.same_names
    if same is not None:
        raise cp.errors.InvalidArgumentError(
            f"Two keys of one container have the same string form: "
            f"{jax.tree_util.keystr(same[0])} and {jax.tree_util.keystr(same[1])}. "
            f"Rename one of them; checkpoints record keys as strings."
        )
    types = list(map(type, flat.values))
    entries = {t: lookup(t) for t in dict.fromkeys(types)}  # In the order of the leaves.
    if None in entries.values():
        unsupported = [
            f"{jax.tree_util.keystr(leaf.keypath) or '<root>'} ({describe_type(leaf.value)})"
            for leaf in flat.leaves
            if entries[type(leaf.value)] is None
        ]
        raise cp.errors.NoHandlerForObjectError(
            f"Cannot save the pytree to {where}: no leaf handler accepts the leaves "
            f"{listing(unsupported)}. Convert them to "
            "arrays, scalars or strings, or register a leaf "
            f"handler for their type. Nothing was written."
        )
    by_class: dict[type, list[type]] = {}
    for t, entry in entries.items():
        by_class.setdefault(entry.handler_cls, []).append(t)  # type: ignore[union-attr]
    if len(by_class) == 1:  # Usually: every leaf a jax.Array.
        return {cls: LeafGroup(flat, range(len(types)), entries) for cls in by_class}
    indices: dict[type, list[int]] = {cls: [] for cls in by_class}
    for i, t in enumerate(types):
        indices[entries[t].handler_cls].append(i)  # type: ignore[union-attr]
    return {cls: LeafGroup(flat, indices[cls], entries) for cls in by_class}


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
    structure = flat.structure
    names, key_types, storage_names = structure.names, structure.key_types, structure.storage_names
    entries: list[_tree_metadata.Entry] = []
    own_types: dict[int, str | None] = {}  # Per registration (by id), not per leaf.
    for group in groups.values():
        for entry in group.entries.values():
            if id(entry) not in own_types:
                own_types[id(entry)] = _own_value_type(registry, entry)
        for i, value in zip(group.indices, group.values, strict=True):
            entry = group.entries[type(value)]
            own_type = own_types[id(entry)]
            name = storage_names[i]
            extra = extras.get(name) or {}
            if own_type is not None:
                extra = {**extra, _tree_metadata.OWN_VALUE_TYPE: own_type}
            entries.append(
                _tree_metadata.Entry(
                    names=names[i],
                    key_types=key_types[i],
                    value_type=entry.typestr,
                    write_shape=write_shapes.get(name),
                    extra=extra,
                )
            )
    for path, kind in structure.empty:
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
        tuple_paths=frozenset(_tree.key_names(p) for p in structure.tuples),
        own_value_types=any(t is not None for t in own_types.values()),
    )
