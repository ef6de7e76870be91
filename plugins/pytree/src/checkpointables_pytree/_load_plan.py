"""What a load decides before reading: which leaf handler reads which leaf, and the result's shape.

Without an abstract tree every recorded leaf is read as saved; with one, the
abstract tree is matched against ``_METADATA`` first and every mismatch is
reported at once, by key path, before any array is read.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import checkpointables as cp
import jax
import numpy as np
from checkpointables.serialization import DeserializationParam, LeafHandlerRegistry
from etils import epath

from checkpointables_pytree import _leaf_distributions, ocdbt
from checkpointables_pytree import tree as tree_room
from checkpointables_pytree.leaves import (
    ARRAY_VALUE_TYPES,
    PRNG_KEY,
    STRING,
    AbstractPRNGKey,
    NamedDeserializationParam,
)
from checkpointables_pytree.storage import describe_type, listing

__all__ = ["LoadPlan", "is_skip", "check_array_count", "MANY_ARRAYS"]

_PLACEHOLDER_TYPE = "placeholder"  # Orbax's value_type for skipped leaves of partial saves.


def _empty_value(value_type: str) -> Any:
    # An empty named tuple loads as {}, as non-empty ones load as dicts of their fields.
    return {"Dict": {}, "List": [], "Tuple": (), "None": None, "NamedTuple": {}}[value_type]


_VALUE_TYPES = "value types"  # tree.derived's key of the value types a tree records.
_RECIPE = "recipe"  # tree.derived's key of the slots it was made for and the Recipe.


def _value_types(tree: tree_room.TreeMetadata) -> tuple[str, ...]:
    """Every value type the entries record (their own ones too), in a fixed order."""
    types = {e.value_type for e in tree.entries}
    if tree.own_value_types:
        own = (e.extra.get(tree_room.OWN_VALUE_TYPE) for e in tree.entries)
        types.update(t for t in own if isinstance(t, str))
    return tuple(sorted(types))


def _handler_for(registry: LeafHandlerRegistry, value_type: str) -> type | None:
    leaf_entry = registry.entry_for_typestr(value_type)
    return None if leaf_entry is None else leaf_entry.handler_cls


# Trees of more arrays than this are compared with what their database holds before a
# load plans them (a forged _METADATA of 300,000 leaves took 11 s and 1.5 GB to refuse).
MANY_ARRAYS = 10_000


def check_array_count(tree: tree_room.TreeMetadata, directory: epath.Path) -> None:
    """Raises if ``_METADATA`` lists more arrays than the database holds keys (every array
    has at least its ``zarr.json``): work is bounded by what the files hold, not by what
    the metadata claims. Trees of up to ``MANY_ARRAYS`` arrays are not checked (their work
    is small).

    Raises:
      cp.errors.MetadataError: the tree lists more arrays than the database can hold.
    """
    if not tree.use_ocdbt or len(tree.entries) <= MANY_ARRAYS:
        return
    arrays = sum(1 for e in tree.entries if e.value_type in ARRAY_VALUE_TYPES)
    if arrays <= MANY_ARRAYS:
        return
    keys = ocdbt.stored_key_count(directory)
    if keys is not None and arrays > keys:
        raise cp.errors.MetadataError(
            f"{directory / tree_room.METADATA_FILE} lists {arrays:,} arrays, but the database "
            f"in {directory} holds {keys:,} keys, and each array has at least one: the metadata "
            "is damaged or forged. Restore the checkpoint from a copy."
        )


def is_skip(abstract: Any) -> bool:
    """Whether an abstract leaf asks to skip what is stored there (``None``, a placeholder)."""
    return (
        abstract is None
        or abstract is cp.PLACEHOLDER
        or (type(abstract) in (dict, list, tuple) and not abstract)
    )


@attrs.define
class _Mismatch:
    """How an abstract tree differs from the stored one (key paths, as errors show them)."""

    extra: list[str] = attrs.Factory(list)  # Abstract leaves with nothing stored.
    structure: list[str] = attrs.Factory(list)  # A leaf on one side, a subtree on the other.
    unsupported: list[str] = attrs.Factory(list)  # Abstract leaves no leaf handler accepts.
    # Abstract leaves whose leaf handler does not read what was saved there.
    other_type: list[str] = attrs.Factory(list)
    missing: list[str] = attrs.Factory(list)  # Stored leaves the abstract tree leaves out.

    def raise_if_any(self, *, partial: bool, where: epath.Path) -> None:
        """Raises ``TreeMismatchError`` listing every difference (``partial``: allow missing)."""
        if self.unsupported:
            raise cp.errors.TreeMismatchError(
                f"No leaf handler accepts these abstract leaves: {listing(self.unsupported)}. "
                "Use jax.ShapeDtypeStruct, np.empty(...), a "
                "scalar, a str, None or cp.PLACEHOLDER, or a "
                f"registered custom abstract type."
            )
        if self.other_type:
            raise cp.errors.TreeMismatchError(
                f"The abstract tree asks for other types than the pytree stored in {where} "
                f"holds: {listing(self.other_type)}. Give those leaves an abstract leaf of the "
                "saved type (cp.pytree_metadata(path).metadata shows them), or cp.PLACEHOLDER "
                "to skip them. (A leaf handler that reads leaves another one saved declares "
                "their value type in its registration's secondary_typestrs.)"
            )
        missing = [] if partial else self.missing
        if not (self.extra or self.structure or missing):
            return
        lines = [f"The abstract tree does not match the pytree stored in {where}:"]
        for items, what in (
            (self.extra, "in the abstract tree but not in the checkpoint"),
            (self.structure, "different structure"),
            (missing, "in the checkpoint but not in the abstract tree"),
        ):
            if items:
                lines.append(f"  {what} ({len(items)}): {listing(items)}")
        hint = "Fix the abstract tree (cp.pytree_metadata(path).metadata shows what is stored)"
        if missing:  # partial_load=True helps only with leaves the abstract tree leaves out.
            hint += "; to load only part of the tree pass partial_load=True"
        lines.append(f"{hint}, or put cp.PLACEHOLDER where a leaf should be skipped.")
        raise cp.errors.TreeMismatchError("\n".join(lines))


class Batch(NamedTuple):
    """The leaves one leaf handler reads: their slots in ``LoadPlan.values``, and params."""

    handler: type
    slots: list[int]
    params: list[DeserializationParam[Any]]


class LoadPlan:
    """Which leaf handler reads which leaf, and how the result tree is built.

    ``values`` holds one slot per leaf of the result, filled by the leaf
    handlers named in ``groups`` (``handler class -> [(slot, param)]``).
    """

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.groups: dict[type, list[tuple[int, DeserializationParam[Any]]]] = {}
        self.slots: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        self.treedef: Any = None
        self.empties: list[tuple[int, str]] = []  # Slots of empty containers, by value type.
        self._batches: list[Batch] | None = None

    def batches(self) -> list[Batch]:
        """``groups`` as each leaf handler's slots and params (made once per plan template)."""
        if self._batches is None:
            self._batches = [
                Batch(handler, [slot for slot, _ in items], [param for _, param in items])
                for handler, items in self.groups.items()
            ]
        return self._batches

    @classmethod
    def without_abstract(
        cls,
        tree: tree_room.TreeMetadata,
        registry: LeafHandlerRegistry,
        where: epath.Path | None = None,
    ) -> LoadPlan:
        """Every recorded leaf, read as saved (``where``: the pytree directory, for errors).

        The plan depends only on the ``_METADATA`` text and on which leaf handler
        reads each value type: it is made once per text and handler choice
        (``tree.derived``) and copied for each load.

        Raises:
          cp.errors.MissingHandlerError: a leaf's value type has no leaf handler here.
        """
        types = tree.derived.get(_VALUE_TYPES)
        if types is None:
            types = tree.derived[_VALUE_TYPES] = _value_types(tree)
        handlers = tuple((t, _handler_for(registry, t)) for t in types)
        template = tree.derived.get(handlers)
        if template is None:
            template = tree.derived[handlers] = cls._recorded(tree, dict(handlers), where)
        plan = cls()
        plan.values = list(template.values)
        for slot, value_type in template.empties:  # Fresh ones: the caller may change them.
            plan.values[slot] = _empty_value(value_type)
        plan.groups, plan.slots, plan._batches = template.groups, template.slots, template.batches()
        return plan

    @classmethod
    def _recorded(
        cls,
        tree: tree_room.TreeMetadata,
        handlers: dict[str, type | None],
        where: epath.Path | None = None,
    ) -> LoadPlan:
        """The plan of ``without_abstract``, with each value type's leaf handler."""
        plan = cls()
        unknown: dict[str, list[str]] = {}
        slots, values = plan.slots, plan.values
        jax_keypath, own_value_types = tree_room.jax_keypath, tree.own_value_types
        for entry in tree.entries:
            names, value_type = entry.names, entry.value_type
            slots.append((names, entry.key_types))
            if entry.skip_deserialize and value_type in tree_room.EMPTY_TYPES:
                plan.empties.append((len(values), value_type))
                values.append(None)
                continue
            if value_type == _PLACEHOLDER_TYPE:
                values.append(cp.PLACEHOLDER)
                continue
            values.append(None)
            own = entry.extra.get(tree_room.OWN_VALUE_TYPE) if own_value_types else None
            own = own if isinstance(own, str) else None
            # A leaf's own value type unknown here falls back to its Orbax value type.
            handler = (own and handlers.get(own)) or handlers.get(value_type)
            if handler is None:
                unknown.setdefault(own or value_type, []).append(_stored_keystr(tree, entry))
                continue
            keypath = jax_keypath(names, entry.key_types)
            param = NamedDeserializationParam(keypath=keypath, value=None, names=names)
            plan.groups.setdefault(handler, []).append((len(values) - 1, param))
        if unknown:
            raise cp.errors.MissingHandlerError(
                _leaf_distributions.missing_message(unknown, tree.extra, where)
            )
        return plan

    @classmethod
    def with_abstract(
        cls,
        tree: tree_room.TreeMetadata,
        abstract: Any,
        registry: LeafHandlerRegistry,
        *,
        partial: bool,
        where: epath.Path,
        flat: tuple[list[tuple[tuple[Any, ...], Any]], Any] | None = None,
    ) -> LoadPlan:
        """The leaves of ``abstract`` (``flat``: already flattened), matched against ``tree``.

        Raises:
          cp.errors.TreeMismatchError: the trees differ (``partial``: leaves the
            abstract tree leaves out are fine).
        """
        plan = cls()
        leaves, plan.treedef = flat if flat is not None else tree_room.flatten_abstract(abstract)
        stored, inner = _stored_and_inner(tree)
        mismatch = _Mismatch()
        used: set[tuple[str, ...]] = set()
        skipped: set[tuple[str, ...]] = set()
        handler_of, reads = _abstract_handlers(registry), _ReadsSaved(registry)
        for keypath, leaf in leaves:
            names = tree_room.key_names(keypath)
            plan.values.append(leaf)
            if is_skip(leaf):
                if names in stored or names in inner:
                    skipped.add(names)
                else:
                    mismatch.extra.append(_shown(keypath))
                continue
            entry = stored.get(names)
            if entry is None or entry.is_empty_node:
                _no_leaf_stored(_shown(keypath), entry, names in inner, mismatch)
                continue
            handler = handler_of(leaf)
            if handler is None:
                mismatch.unsupported.append(f"{_shown(keypath)} ({describe_type(leaf)})")
                continue
            if not reads(handler, entry, tree.own_value_types):
                mismatch.other_type.append(reads.describe(_shown(keypath), leaf, handler, entry))
                continue
            used.add(names)
            param = NamedDeserializationParam(keypath=tuple(keypath), value=leaf, names=names)
            plan.groups.setdefault(handler, []).append((len(plan.values) - 1, param))
        mismatch.missing = _left_out(tree, used, skipped)
        mismatch.raise_if_any(partial=partial, where=where)
        return plan

    def build(self, tree: tree_room.TreeMetadata, where: epath.Path) -> Any:
        """The result tree: the abstract tree's structure, or the recorded one."""
        if self.treedef is not None:
            return jax.tree_util.tree_unflatten(self.treedef, self.values)
        if not self.slots:
            return {}
        # The structure depends only on the _METADATA text: worked out once, then replayed.
        recipe = tree.derived.get(_RECIPE)
        if recipe is None or recipe[0] is not self.slots:
            made = tree_room.Recipe.of(
                self.slots,
                tree.tuple_paths,
                tree.int_keys,
                on_conflict=lambda message: cp.errors.MetadataError(
                    f"{where / tree_room.METADATA_FILE} is malformed: {message}."
                ),
            )
            recipe = tree.derived[_RECIPE] = (self.slots, made)
        return recipe[1].build(self.values)


def _shown(keypath: tuple[Any, ...]) -> str:
    """An abstract leaf's key path as errors show it (made only for the leaves an error
    names): as the stored side's, and as cp.pytree_metadata and inspect show them."""
    return tree_room.keypath_str(keypath)


def _stored_keystr(tree: tree_room.TreeMetadata, entry: tree_room.Entry) -> str:
    """A stored leaf's key path as errors show it: its int dict keys as ints (``[0]``)."""
    return tree_room.keystr(entry.names, entry.key_types, tree.int_keys)


def _stored_and_inner(
    tree: tree_room.TreeMetadata,
) -> tuple[dict[tuple[str, ...], tree_room.Entry], frozenset[tuple[str, ...]]]:
    """The entries by key names, and every proper prefix of them (made once per text)."""
    entries = tree_room.entries_by_names(tree)
    inner = tree.derived.get("inner")
    if inner is None:
        inner = tree.derived["inner"] = frozenset(
            names[:i] for names in entries for i in range(len(names))
        )
    return entries, inner


# Abstract leaf types whose instances all have the same attributes: the registry picks
# the same leaf handler for two of one dtype (see _decided_by_type_and_dtype).
_TYPE_DECIDES = frozenset({np.ndarray, jax.ShapeDtypeStruct})


def _decided_by_type_and_dtype(registry: LeafHandlerRegistry) -> bool:
    """Whether the registry's match of an abstract leaf depends only on its type and dtype:
    protocols (attributes), plain classes, and ``AbstractPRNGKey`` (the dtype)."""
    return all(
        getattr(t, "_is_protocol", False) or type(t) in (type, abc.ABCMeta) or t is AbstractPRNGKey
        for t in (e.abstract_type for e in registry.get_all())
    )


def _abstract_handlers(registry: LeafHandlerRegistry) -> Callable[[Any], type | None]:
    """The leaf handler class for an abstract leaf (looked up once per type and dtype where
    that decides it: most abstract trees hold a few kinds of leaves)."""
    known: dict[tuple[type, Any], type | None] = {}
    kinds = _TYPE_DECIDES if _decided_by_type_and_dtype(registry) else frozenset()

    def handler_of(leaf: Any) -> type | None:
        kind = type(leaf)
        key = (kind, leaf.dtype) if kind in kinds else None
        if key is not None and key in known:
            return known[key]
        leaf_entry = registry.entry_for_abstract(leaf)
        handler = None if leaf_entry is None else leaf_entry.handler_cls
        if key is not None:
            known[key] = handler
        return handler

    return handler_of


# The value types the pytree plugin's own leaf handlers write: each of them reads them all
# (arrays into any array-like abstract leaf, with casts), as before value types were checked.
_STANDARD_TYPES = ARRAY_VALUE_TYPES | {STRING, PRNG_KEY, _PLACEHOLDER_TYPE}


class _ReadsSaved:
    """Whether the leaf handler an abstract leaf picks reads what was saved there: it wrote
    that value type or declares it (secondary typestrs); among the standard value types,
    any standard leaf handler (a ``jax.Array`` loads into ``np.empty(...)``). A leaf that
    records its own value type besides its Orbax one is read by a handler of either (as a
    load without an abstract tree falls back to the Orbax one)."""

    def __init__(self, registry: LeafHandlerRegistry) -> None:
        self._registry = registry
        self._known: dict[tuple[type, str], bool] = {}

    def _typestrs(self, handler: type) -> set[str]:
        entries = [e for e in self._registry.get_all() if e.handler_cls is handler]
        return {cp.handlers.typestr(handler)}.union(*(e.secondary_typestrs for e in entries))

    def __call__(self, handler: type, entry: tree_room.Entry, own_value_types: bool) -> bool:
        own = entry.extra.get(tree_room.OWN_VALUE_TYPE) if own_value_types else None
        if isinstance(own, str) and own != entry.value_type and self._reads(handler, own):
            return True
        return self._reads(handler, entry.value_type)

    def _reads(self, handler: type, saved: str) -> bool:
        known = self._known.get((handler, saved))
        if known is None:
            typestrs = self._typestrs(handler)
            known = saved in typestrs or (
                saved in _STANDARD_TYPES and not typestrs.isdisjoint(_STANDARD_TYPES)
            )
            self._known[(handler, saved)] = known
        return known

    def describe(self, shown: str, leaf: Any, handler: type, entry: tree_room.Entry) -> str:
        """A mismatched leaf for the error: its key path, what was saved, what is asked."""
        own = entry.extra.get(tree_room.OWN_VALUE_TYPE)
        saved = own if isinstance(own, str) else entry.value_type
        how = f"as {saved}" if saved in _STANDARD_TYPES else f"by the leaf handler {saved}"
        return (
            f"{shown} (saved {how}; the abstract leaf, a {describe_type(leaf)}, asks for the "
            f"leaf handler {cp.handlers.typestr(handler)}, which does not read {saved})"
        )


def _no_leaf_stored(
    shown: str, entry: tree_room.Entry | None, is_subtree: bool, mismatch: _Mismatch
) -> None:
    """Records why an abstract leaf has no stored leaf: a subtree, an empty node, or nothing."""
    if is_subtree:
        mismatch.structure.append(
            f"{shown} (a leaf in the abstract tree, a subtree in the checkpoint)"
        )
    elif entry is not None:
        mismatch.structure.append(f"{shown} (an empty {entry.value_type} in the checkpoint)")
    else:
        mismatch.extra.append(shown)


def _left_out(
    tree: tree_room.TreeMetadata, used: set[tuple[str, ...]], skipped: set[tuple[str, ...]]
) -> list[str]:
    """The stored leaves the abstract tree neither asks for nor skips."""
    missing = []
    for entry in tree.entries:
        names = entry.names
        if names in used:
            continue
        if skipped and any(names[:i] in skipped for i in range(len(names) + 1)):
            continue
        # An empty node (optax.EmptyState(), an empty dataclass, the `_pytree__state` of a
        # Flax NNX module saved whole) holds no data: an abstract tree may leave it out
        # (nnx.state(model) does) and the result follows the abstract tree. An abstract
        # leaf there is a structure mismatch, reported where the leaf is matched.
        if entry.is_empty_node:
            continue
        missing.append(_stored_keystr(tree, entry))
    return missing
