"""Rebuilding a nested tree of dicts, lists and tuples from recorded key paths.

A load without an abstract tree gets its structure from ``_METADATA``: each
leaf's key names and key types (``_tree.DICT``, ``_tree.SEQUENCE``), and
the paths of ``int`` dict keys (made ints again: key names are strings). A
malformed record (a path both a leaf and a container, a level mixing list and
dict keys) is reported through ``on_conflict``, never guessed at.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from checkpointables_pytree.tree._keypaths import DICT, MAX_DEPTH, SEQUENCE, keystr

__all__ = ["Recipe", "unflatten", "MAX_DEPTH", "MAX_PADDING"]

# The most ``None``s a sequence with gaps in its indices is padded with.
MAX_PADDING = 1 << 16


def unflatten(
    items: Sequence[tuple[tuple[str, ...], tuple[int, ...], Any]],
    tuple_paths: frozenset[tuple[str, ...]] = frozenset(),
    int_keys: frozenset[tuple[str, ...]] = frozenset(),
    *,
    on_conflict: Callable[[str], Exception] = ValueError,
) -> Any:
    """Rebuilds a tree from ``(names, key_types, value)`` items.

    DICT levels become dicts, SEQUENCE levels lists (or tuples for the paths in
    ``tuple_paths``), ordered by index. The dict keys at the paths in
    ``int_keys`` are ints; each must name a dict key of the tree.
    """
    if len(items) == 1 and not items[0][0]:
        return items[0][2]
    root: dict[str, Any] = {}
    kinds: dict[tuple[str, ...], int] = {}
    # Items come sorted, so siblings follow each other: their parent is found once.
    parent_names: tuple[str, ...] | None = None
    parent: dict[str, Any] = root
    for names, types, value in items:
        if not names:
            raise on_conflict("the root is recorded both as a leaf and as a container")
        if len(names) > MAX_DEPTH:  # Each level costs a Python frame below, and a key tuple.
            shown = keystr(names[:4], types[:4] if len(types) == len(names) else None)
            raise on_conflict(
                f"{shown}... is nested {len(names)} levels deep (at most {MAX_DEPTH})"
            )
        if len(names) != len(types):
            raise ValueError(f"{len(names)} key names but {len(types)} key types")
        head = names[:-1]
        if head != parent_names:
            parent_names, parent = head, _parent_of(root, kinds, names, types, on_conflict)
        name, kind = names[-1], types[-1]
        recorded = kinds.setdefault(head, kind)
        if recorded != kind:
            raise on_conflict(f"the children of {keystr(head)} mix list and dict keys")
        if name in parent:
            raise on_conflict(f"{keystr(names, types)} is recorded twice")
        parent[name] = _Value(value)
    if int_keys:
        _check_int_keys(root, kinds, int_keys, on_conflict)
    return _build(root, (), kinds, tuple_paths, int_keys, on_conflict)


def _check_int_keys(
    root: dict[str, Any],
    kinds: dict[tuple[str, ...], int],
    int_keys: frozenset[tuple[str, ...]],
    on_conflict: Callable[[str], Exception],
) -> None:
    """Raises unless every path in ``int_keys`` names a dict key of the tree."""
    for names in sorted(int_keys):
        node: Any = root
        for name in names:
            node = node.get(name) if type(node) is dict else None
        if node is None or kinds.get(names[:-1], DICT) != DICT:
            raise on_conflict(f"int_keys names {keystr(names)}, which is no dict key of the tree")


def _parent_of(
    root: dict[str, Any],
    kinds: dict[tuple[str, ...], int],
    names: tuple[str, ...],
    types: tuple[int, ...],
    on_conflict: Callable[[str], Exception],
) -> dict[str, Any]:
    """The dict that holds the item at ``names`` (made on the way), checking each level's kind."""
    node = root
    for depth in range(len(names) - 1):
        name, kind = names[depth], types[depth]
        prefix = names[:depth]
        recorded = kinds.setdefault(prefix, kind)
        if recorded != kind:
            raise on_conflict(f"the children of {keystr(prefix)} mix list and dict keys")
        child = node.setdefault(name, {})
        if isinstance(child, _Value):
            raise on_conflict(f"{keystr(names[: depth + 1])} is both a leaf and a container")
        node = child
    return node


def _build(
    node: dict[str, Any],
    prefix: tuple[str, ...],
    kinds: dict[tuple[str, ...], int],
    tuple_paths: frozenset[tuple[str, ...]],
    int_keys: frozenset[tuple[str, ...]],
    on_conflict: Callable[[str], Exception],
) -> Any:
    """The container at ``prefix``: a dict, or a list or tuple for SEQUENCE levels."""

    def value(key: str, child: Any) -> Any:
        if isinstance(child, _Value):
            return child.value
        return _build(child, (*prefix, key), kinds, tuple_paths, int_keys, on_conflict)

    if kinds.get(prefix, DICT) != SEQUENCE:
        if int_keys:
            return {int(k) if (*prefix, k) in int_keys else k: value(k, v) for k, v in node.items()}
        return {k: value(k, v) for k, v in node.items()}
    try:
        ordered = sorted(node.items(), key=lambda kv: int(kv[0]))
    except ValueError:
        raise on_conflict(f"{keystr(prefix)} has non-integer sequence keys") from None
    values = [value(k, v) for k, v in ordered]
    if ordered and int(ordered[-1][0]) != len(ordered) - 1:
        # Indices with gaps (only possible in hand-edited metadata): keep positions, within
        # a bound (the padding is allocated before anything else is checked).
        length = int(ordered[-1][0]) + 1
        if length > len(ordered) + MAX_PADDING:
            raise on_conflict(
                f"{keystr(prefix)} has {len(ordered)} items at indices up to {length - 1}"
            )
        padded: list[Any] = [None] * length
        for (k, _), v in zip(ordered, values, strict=True):
            padded[int(k)] = v
        values = padded
    return tuple(values) if prefix in tuple_paths else values


class _Value:
    """Marks a leaf value in the nested dicts ``unflatten`` builds."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Slot:
    """Stands for the value of slot ``index`` while a ``Recipe`` is made."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class Recipe:
    """How ``unflatten`` builds a tree of one structure, replayed for new values.

    Made once per ``_METADATA`` text: the containers in the order they are
    built (children first), each as its kind, its keys and where each child
    comes from (a value, ``None`` padding, or a container built before it),
    so that a rebuild is a few C-level calls per container.

    Example::

        recipe = Recipe.of(items_without_values, tuple_paths)
        tree = recipe.build(values)
    """

    def __init__(self, count: int) -> None:
        self._count = count  # Values; pool index ``count`` holds None (sequence padding).
        self._steps: list[tuple[type, list[Any], Callable[[list[Any]], Any]]] = []
        self._root_value: int | None = None

    @classmethod
    def of(
        cls,
        slots: Sequence[tuple[tuple[str, ...], tuple[int, ...]]],
        tuple_paths: frozenset[tuple[str, ...]] = frozenset(),
        int_keys: frozenset[tuple[str, ...]] = frozenset(),
        *,
        on_conflict: Callable[[str], Exception] = ValueError,
    ) -> Recipe:
        """The recipe of the tree ``unflatten`` builds from ``slots`` (raising as it does)."""
        items = [(names, types, _Slot(i)) for i, (names, types) in enumerate(slots)]
        skeleton = unflatten(items, tuple_paths, int_keys, on_conflict=on_conflict)
        recipe = cls(len(slots))
        if type(skeleton) is _Slot:
            recipe._root_value = skeleton.index
        else:
            recipe._add(skeleton)
        return recipe

    def _add(self, node: Any) -> int:
        """Adds the steps building ``node`` (a container); returns its index in the pool."""
        children = list(node.values()) if type(node) is dict else list(node)
        refs = []
        for child in children:
            if type(child) is _Slot:
                refs.append(child.index)
            elif child is None:
                refs.append(self._count)
            else:
                refs.append(self._add(child))

        def gather(pool: list[Any], r: list[int] = refs) -> list[Any]:
            return [pool[i] for i in r]

        pick: Callable[[list[Any]], Any] = operator.itemgetter(*refs) if len(refs) > 1 else gather
        self._steps.append((type(node), list(node) if type(node) is dict else [], pick))
        return self._count + len(self._steps)

    def build(self, values: Sequence[Any]) -> Any:
        """The tree with ``values`` (one per slot, in order) at its leaves."""
        if self._root_value is not None:
            return values[self._root_value]
        pool = [*values, None]
        for kind, keys, pick in self._steps:
            children = pick(pool)
            if kind is dict:
                pool.append(dict(zip(keys, children, strict=True)))
            else:
                pool.append(kind(children))
        return pool[-1]
