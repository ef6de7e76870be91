"""What a save decides before writing: which leaf handler takes each leaf, and the ``_METADATA``."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, cast

import attrs
import checkpointables as cp
from checkpointables.serialization import (
    LeafEntry,
    LeafHandlerRegistry,
)
from etils import epath

from checkpointables_pytree import _leaf_distributions, tree
from checkpointables_pytree.leaves import ArrayRecords, LeafGroup, SaveSession
from checkpointables_pytree.storage import describe_type, listing
from checkpointables_pytree.tree import OWN_VALUE_TYPE

logger = logging.getLogger("checkpointables.pytree")

__all__ = [
    "EntryCache",
    "Groups",
    "group_leaves",
    "no_leaf_handler_advice",
    "unsupported_leaves",
    "warn_if_leafless",
    "saved_tree_metadata",
]


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


# Leaf handler class -> its leaves.
Groups = dict[type, LeafGroup]


def group_leaves(flat: tree.Flat, lookup: EntryCache, where: Any) -> Groups:
    """The leaves of ``flat`` grouped by leaf handler (one lookup per leaf type).

    Raises (naming ``where``):
      cp.errors.InvalidArgumentError: two keys of one container have the same string form.
      cp.errors.NoHandlerForObjectError: some leaves have no leaf handler.
    """
    same = flat.structure.same_names
    if same is not None:
        raise cp.errors.InvalidArgumentError(
            f"Two keys of one container have the same string form: "
            f"{tree.keypath_str(same[0])} and {tree.keypath_str(same[1])}. "
            f"Rename one of them; checkpoints record keys as strings."
        )
    types = list(map(type, flat.values))
    entries = {t: lookup(t) for t in dict.fromkeys(types)}  # In the order of the leaves.
    if None in entries.values():
        raise cp.errors.NoHandlerForObjectError(
            f"Cannot save the pytree to {where}: "
            f"{no_leaf_handler_advice(unsupported_leaves(flat, lookup))}. Nothing was written."
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


def unsupported_leaves(flat: tree.Flat, lookup: EntryCache) -> list[tree.Leaf]:
    """The leaves of ``flat`` no leaf handler accepts (one lookup per leaf type)."""
    if all(lookup(t) for t in set(map(type, flat.values))):
        return []
    return [leaf for leaf in flat.leaves if lookup(type(leaf.value)) is None]


def no_leaf_handler_advice(bad: list[tree.Leaf]) -> str:
    """Why a pytree holding the leaves ``bad`` cannot be saved, naming them, and what to do:
    convert them, add a leaf handler, or, for objects a checkpointable handler saves (a
    Grain iterator), save them beside the pytree."""
    shown = [f"{tree.keypath_str(leaf.keypath)} ({describe_type(leaf.value)})" for leaf in bad]
    return (
        f"no leaf handler accepts the leaves {listing(shown)}. Convert them to arrays, "
        "scalars or strings, or add a leaf handler for their type "
        "(cp.serialization.StandardLeafHandlerRegistry().add(...) in "
        f"cp.options.PyTreeOptions(leaf_handler_registry=...)){_beside_advice(bad)}"
    )


# Leaves whose checkpointable handler is looked for: each costs an is_handleable per handler.
_MAX_BESIDE = 5


def _beside_advice(bad: list[tree.Leaf]) -> str:
    """For leaves that a registered checkpointable handler saves, though not inside a
    pytree: the handler, and the ``save_checkpointables`` call that saves them beside the
    pytree, or ``""``. (A leaf's own pytree handler never accepts it: the leaf has no leaf
    handler, so it needs no excluding.)"""
    registrations = cp.handlers.registered_handlers()
    found: list[tuple[tree.Leaf, cp.plugins.HandlerRegistration]] = []
    for leaf in bad[:_MAX_BESIDE]:
        if not leaf.keypath:
            continue  # The whole tree: the caller's resolution names the handler that saves it.
        savers = cp.handlers.handlers_accepting(registrations, leaf.value, first=True)
        if savers:
            found.append((leaf, savers[0]))
    if not found:
        return ""
    items, keys = [], {"pytree"}
    for leaf, saver in found:
        key = _checkpointable_name(leaf, saver, keys)
        keys.add(key)
        items.append(f"{key!r}: <the object at {tree.keypath_str(leaf.keypath)}>")
    without = ", ".join(tree.keypath_str(leaf.keypath) for leaf, _ in found)
    if len(found) == 1:
        leaf, saver = found[0]
        what = (
            f"{tree.keypath_str(leaf.keypath)} is an object that {_handler_text(saver)} "
            f"saves, though not inside a pytree: save it"
        )
    else:
        which = "; ".join(
            f"{tree.keypath_str(leaf.keypath)} by {_handler_text(saver)}" for leaf, saver in found
        )
        what = (
            f"Some are objects that checkpointable handlers save, though not inside a pytree "
            f"({which}): save each"
        )
    return (
        f". {what} as a checkpointable of its own, beside the pytree: "
        f"cp.save_checkpointables(path, {{'pytree': <the tree without {without}>, "
        f"{', '.join(items)}}})"
    )


def _handler_text(saver: cp.plugins.HandlerRegistration) -> str:
    """``the 'grain' handler (checkpointables_grain.GrainIteratorHandler, plugin 'grain')``."""
    cls = f"{saver.handler_cls.__module__}.{saver.handler_cls.__qualname__}"
    origin = f"plugin {saver.plugin!r}" if saver.distribution else "registered by you"
    return f"the {saver.name!r} handler ({cls}, {origin})"


def _checkpointable_name(leaf: tree.Leaf, saver: Any, taken: set[str]) -> str:
    """A checkpointable name for ``leaf`` saved beside the pytree: the name its handler is
    registered for, else its last key, else its key path joined by dots, else the handler's
    name (the first of these that is a valid name, not ``taken``)."""
    for name in (saver.checkpointable_name, leaf.names[-1], ".".join(leaf.names), saver.name):
        if name is None or name in taken:
            continue
        try:
            return cp.layout.validate_checkpointable_name(name)
        except cp.errors.InvalidArgumentError:
            continue
    return f"{saver.name}_{len(taken)}"


_warned_leafless: set[tuple[str, str]] = set()  # (where, name) warned about in this process.
_warned_lock = threading.Lock()


def warn_if_leafless(pytree: Any, flat: tree.Flat, directory: Any) -> None:
    """Logs a warning if ``pytree`` (saved to ``directory``, a checkpointable's directory,
    maybe in its save's temporary directory) has no leaves but nodes a load without an
    abstract tree cannot rebuild (an ``nnx.GraphDef``, an ``optax.EmptyState``): only its
    structure is saved, which loads as empty containers, so the save probably missed its
    data. Explicitly empty dicts, lists and tuples (``{}``, ``{"a": []}``) round-trip
    exactly and are not warned about. Once per checkpoint's parent directory and name, so
    that a Checkpointer's steps warn once."""
    if flat.values:
        return
    import jax

    plain = (dict, list, tuple)
    nodes, _ = jax.tree_util.tree_flatten_with_path(
        pytree, is_leaf=lambda x: x is not None and type(x) not in plain
    )
    if not nodes:
        return
    path = epath.Path(directory)
    checkpoint = path.parent
    parsed = cp.layout.parse_temporary_name(checkpoint.name)
    if parsed is not None:
        checkpoint = checkpoint.parent / parsed[0]
    with _warned_lock:
        key = (os.fspath(checkpoint.parent), path.name)
        if key in _warned_leafless:
            return
        _warned_leafless.add(key)
    shown = listing([f"{tree.keypath_str(k)} ({describe_type(node)})" for k, node in nodes])
    logger.warning(
        "The pytree %r saved to %s has no leaves (no arrays, scalars or strings): nothing but "
        "its structure was saved, and without an abstract tree it loads as empty containers. "
        "Its nodes other than dicts, lists and tuples (%s) hold no data to save. If the data "
        "lives elsewhere (Flax NNX: the State of nnx.split(model), not its GraphDef), save that.",
        path.name,
        checkpoint,
        shown,
    )


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


@attrs.frozen
class _Template:
    """A structure's ``_METADATA`` entries without the leaves' value metadata, in file order."""

    heads: list[str]  # Per entry, sorted by key names: its text up to its value metadata.
    places: list[int]  # Per leaf (jax.tree_util order): its entry's place in the file.
    tails: list[str | None]  # Per place: the rest of an empty node's text (None: a leaf's).
    tuple_paths: frozenset[tuple[str, ...]]
    int_keys: frozenset[tuple[str, ...]]


def _template(structure: tree.Structure) -> _Template:
    """The ``_METADATA`` template of ``structure``, made by its first save."""
    template = structure.derived.get("metadata_template")
    if template is not None:
        return template  # type: ignore[no-any-return]
    records = list(zip(structure.names, structure.key_types, strict=True))
    kinds: list[str | None] = [None] * len(records)
    for path, kind in structure.empty:
        records.append((tree.key_names(path), tuple(tree.key_type(k) for k in path)))
        kinds.append(kind)
    order = sorted(range(len(records)), key=lambda k: records[k][0])
    places = [0] * len(order)
    for place, k in enumerate(order):
        places[k] = place
    encode = tree.compact_encoder()
    key_texts: dict[tuple[str, int], str] = {}
    heads = [tree.entry_head(*records[k], key_texts) for k in order]
    heads[1:] = ["," + head for head in heads[1:]]
    template = structure.derived["metadata_template"] = _Template(
        heads=heads,
        places=places[: len(structure.names)],
        tails=[
            None
            if kinds[k] is None
            else tree.entry_tail(cast(str, kinds[k]), True, None, None, encode)
            for k in order
        ],
        tuple_paths=frozenset(tree.key_names(p) for p in structure.tuples),
        int_keys=structure.int_keys,
    )
    return template


def saved_tree_metadata(
    groups: Groups,
    flat: tree.Flat,
    session: SaveSession,
    registry: LeafHandlerRegistry,
) -> tree.TreeMetadata:
    """The ``_METADATA`` of a save: an entry per leaf (in ``groups``) and per empty node.

    Its text is the structure's template (``_template``) filled in with each
    leaf's value metadata, encoded once per distinct record (arrays of one
    layout share theirs, see ``_array_layouts``).
    """
    template = _template(flat.structure)
    tails = list(template.tails)
    places, names = template.places, flat.structure.storage_names
    write_shapes, extras = session.write_shapes, session.extras
    encode = tree.compact_encoder()
    # Per (registration, record, write shape): the text. Records are alive (in the session)
    # while this runs, so their ids name them.
    texts: dict[tuple[int, int, Any], str] = {}
    own_types: dict[int, str | None] = {}  # Per registration (by id), not per leaf.
    for group in groups.values():
        for entry in group.entries.values():
            if id(entry) not in own_types:
                own_types[id(entry)] = _own_value_type(registry, entry)
        if group.layouts is not None:
            for i, laid in zip(group.indices, _group_texts(group, own_types, encode), strict=True):
                tails[places[i]] = laid
            continue
        for i, value in zip(group.indices, group.values, strict=True):
            entry = group.entries[type(value)]
            name = names[i]
            extra = extras.get(name)
            write_shape = write_shapes.get(name)
            key = (id(entry), id(extra), write_shape)
            text = texts.get(key)
            if text is None:
                own_type = own_types[id(entry)]
                if own_type is not None:
                    extra = {**(extra or {}), tree.OWN_VALUE_TYPE: own_type}
                text = texts[key] = tree.entry_tail(
                    entry.typestr, False, write_shape, extra, encode
                )
            tails[places[i]] = text
    pieces = itertools.chain.from_iterable(zip(template.heads, tails, strict=True))
    # Which distributions' leaf handlers wrote the custom leaves: a load without them says
    # what to install.
    distributions = _leaf_distributions.of_handlers(
        (own_types[id(entry)] or entry.typestr, entry.handler_cls)
        for group in groups.values()
        for entry in group.entries.values()
    )
    return tree.TreeMetadata(
        entries=[],
        extra={_leaf_distributions.FIELD: distributions} if distributions else {},
        tuple_paths=template.tuple_paths,
        int_keys=template.int_keys,
        own_value_types=any(t is not None for t in own_types.values()),
        entries_text="".join(pieces),  # type: ignore[arg-type]  # Every tail is set.
    )


def _group_texts(
    group: LeafGroup, own_types: dict[int, str | None], encode: Callable[[Any], str]
) -> list[str]:
    """The value metadata text of each leaf of a group scheduled at once (``group.layouts``)."""
    plan = group.layouts
    assert plan is not None
    entries = group.entries
    leaf_types = set(map(type, group.values))
    if len({id(entries[t]) for t in leaf_types}) == 1:  # Usually: one type of leaf.
        entry = entries[leaf_types.pop()]
        return _planned_texts(plan, entry.typestr, own_types[id(entry)], encode)
    texts = []
    for j, value in enumerate(group.values):
        entry = entries[type(value)]
        texts.append(_planned_texts(plan, entry.typestr, own_types[id(entry)], encode)[j])
    return texts


def _planned_texts(
    plan: ArrayRecords, value_type: str, own_type: str | None, encode: Callable[[Any], str]
) -> list[str]:
    """The value metadata of the arrays of ``plan`` as ``_METADATA`` text, made once per plan."""
    key = (value_type, own_type)
    texts = plan.texts.get(key)
    if texts is None:
        by_record: dict[int, str] = {}
        texts = []
        for layout, record in zip(plan.layouts, plan.records, strict=True):
            text = by_record.get(id(record))
            if text is None:
                extra = record if own_type is None else {**record, OWN_VALUE_TYPE: own_type}
                write_shape = layout.chunk_shape if plan.write_shapes else None
                text = by_record[id(record)] = tree.entry_tail(
                    value_type, False, write_shape, extra, encode
                )
            texts.append(text)
        plan.texts[key] = texts
    return texts
