"""Flattening pytrees into key paths (``_rebuild`` makes trees of recorded ones).

Keys are recorded the way Orbax records them: each level has a name (the dict
key, sequence index or attribute name, as a string) and a key type
(``SEQUENCE`` = 1 for lists, tuples and other indexed nodes, ``DICT`` = 2 for
dicts, named tuples and attribute nodes). Empty containers, ``None`` and
registered nodes with no children (``optax.EmptyState()``, an empty
``flax.struct`` dataclass) are recorded too, so a tree loaded without an
abstract tree comes back whole, and one loaded with an abstract tree finds
them where its own empty nodes are. The key paths whose last key is an ``int``
dict key are recorded too (``Structure.int_keys``): Orbax's key names are
strings, and a load without an abstract tree makes those keys ints again.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import checkpointables as cp
import jax
import numpy as np

__all__ = [
    "SEQUENCE",
    "DICT",
    "Leaf",
    "Structure",
    "Flat",
    "flatten",
    "flatten_abstract",
    "is_int_key",
    "key_names",
    "keystr",
    "keypath_str",
    "jax_keypath",
]

SEQUENCE = 1
DICT = 2

_DictKey = jax.tree_util.DictKey
_SequenceKey = jax.tree_util.SequenceKey
_GetAttrKey = jax.tree_util.GetAttrKey

# Empty-node value types, as Orbax names them.
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, EMPTY_NONE, EMPTY_NAMEDTUPLE = (
    "Dict",
    "List",
    "Tuple",
    "None",
    "NamedTuple",
)
EMPTY_TYPES = frozenset({EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, EMPTY_NONE, EMPTY_NAMEDTUPLE})

# Types that are never pytree nodes: checked first, to keep flattening cheap.
_LEAF_TYPES: tuple[type, ...] = (
    np.ndarray,
    np.generic,
    int,
    float,
    complex,
    str,
    bytes,
    bool,
    jax.Array,
)


def key_name(key: Any) -> str:
    """The name of one key entry: dict key, index or attribute, as a string."""
    if type(key) is _DictKey:
        return str(key.key)
    if type(key) is _SequenceKey:
        return str(key.idx)
    for attribute in ("key", "idx", "name"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


@functools.lru_cache(maxsize=1 << 16)  # The names of the leaves of recent structures.
def storage_name(names: tuple[str, ...]) -> str:
    """The name a leaf with key names ``names`` is stored under (escapes '.', '/' and '%')."""
    return cp.serialization.param_name_from_keypath(names)


def is_int_key(key: Any) -> bool:
    """Whether a key entry is a dict key that is an integer (not a bool), restored as ``int``."""
    if type(key) is not _DictKey:
        return False
    k = key.key
    return type(k) is int or (isinstance(k, (int, np.integer)) and not isinstance(k, bool))


def key_type(key: Any) -> int:
    """``SEQUENCE`` or ``DICT`` for a key entry."""
    if isinstance(key, (_SequenceKey, jax.tree_util.FlattenedIndexKey)):
        return SEQUENCE
    return DICT


def key_names(keypath: Sequence[Any]) -> tuple[str, ...]:
    """The names of a key path."""
    return tuple(key_name(k) for k in keypath)


def keystr(
    names: Sequence[str],
    key_types: Sequence[int] | None = None,
    int_keys: frozenset[tuple[str, ...]] = frozenset(),
) -> str:
    """A key path as users write it: ``['params']['w']``, ``[0]``; ``<root>`` for ``()``.

    As ``cp.pytree_metadata`` and ``checkpointables inspect`` show a stored tree: a
    sequence index and an int dict key (the paths in ``int_keys``, a tree's recorded
    ones) as ``[0]``, any other key (a dict key, an attribute) as ``['name']``.
    """
    if not names:
        return "<root>"
    types = key_types or [DICT] * len(names)
    bare = [
        t == SEQUENCE or (int_keys and tuple(names[: i + 1]) in int_keys)
        for i, t in enumerate(types)
    ]
    return "".join(f"[{n}]" if b else f"[{n!r}]" for n, b in zip(names, bare, strict=True))


def keypath_str(keypath: Sequence[Any]) -> str:
    """A ``jax.tree_util`` key path shown as ``keystr`` shows the stored one (its key names
    and types are what a save records): an attribute ``['value']`` (not jax's
    ``.value``), an int dict key ``[0]``."""
    if not keypath:
        return "<root>"
    return "".join(
        f"[{key_name(k)}]" if key_type(k) == SEQUENCE or is_int_key(k) else f"[{key_name(k)!r}]"
        for k in keypath
    )


def jax_keypath(names: Sequence[str], key_types: Sequence[int]) -> tuple[Any, ...]:
    """A ``jax.tree_util`` key path from recorded names and key types."""
    if len(names) != len(key_types):
        raise ValueError(f"{len(names)} key names but {len(key_types)} key types")
    return tuple(map(_key_entry, names, key_types))


@functools.lru_cache(maxsize=1 << 16)  # Trees repeat their keys: build each entry once.
def _key_entry(name: str, key_type: int) -> Any:
    return _SequenceKey(int(name)) if key_type == SEQUENCE else _DictKey(name)


class Leaf(NamedTuple):
    """One leaf of a flattened tree: its key path, value, key names and key types.

    A named tuple: a tree of thousands of small arrays builds one per leaf.
    """

    keypath: tuple[Any, ...]
    value: Any
    names: tuple[str, ...]
    key_types: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Structure:
    """What depends only on a tree's structure (its treedef), kept while trees keep it.

    Per leaf, in ``jax.tree_util`` order: its key path, key names and key types.
    ``int_keys``: the key names of every path whose last key is an int dict key.
    ``derived`` holds what saves derive from the structure (and, checked on
    each use, from the leaves' shapes and dtypes): gone with the structure.
    """

    keypaths: tuple[tuple[Any, ...], ...]
    names: tuple[tuple[str, ...], ...]
    key_types: tuple[tuple[int, ...], ...]
    empty: tuple[tuple[tuple[Any, ...], str], ...]
    tuples: tuple[tuple[Any, ...], ...]
    int_keys: frozenset[tuple[str, ...]] = frozenset()
    derived: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def storage_names(self) -> tuple[str, ...]:
        """The name each leaf is stored under."""
        return tuple(map(storage_name, self.names))

    @functools.cached_property
    def same_names(self) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """Two key paths whose keys have the same string forms, if any (they cannot be saved)."""
        if len(set(self.names)) == len(self.names):
            return None
        seen: dict[tuple[str, ...], tuple[Any, ...]] = {}
        for names, keypath in zip(self.names, self.keypaths, strict=True):
            if names in seen:
                return seen[names], keypath
            seen[names] = keypath
        return None


@dataclasses.dataclass(frozen=True)
class Flat:
    """A flattened tree: its structure and its leaves' values (in the same order)."""

    structure: Structure
    values: list[Any]

    @property
    def leaves(self) -> list[Leaf]:
        """One ``Leaf`` per leaf (made on each call: for the few paths that need them)."""
        s = self.structure
        return list(map(Leaf, s.keypaths, self.values, s.names, s.key_types))


def _sorted_keys(d: Mapping[Any, Any]) -> list[Any]:
    try:
        return sorted(d)  # As jax orders dict children.
    except TypeError:
        return list(d)


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def _one_level(node: Any) -> list[tuple[tuple[Any, ...], Any]] | None:
    """The children of a registered pytree node with their keys, or ``None`` for a leaf."""
    children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(children) == 1 and children[0][0] == () and children[0][1] is node:
        return None
    return children


# Structures of recently flattened trees, by treedef: a training loop saves trees of one
# structure again and again. A few, for loops that save several trees (params, optimizer).
_STRUCTURES: dict[Any, Structure] = {}
_STRUCTURES_KEPT = 8
_STRUCTURES_LOCK = threading.Lock()


def flatten(tree: Any) -> Flat:
    """Flattens ``tree`` into leaves (with ``jax.tree_util`` key paths) and empty nodes.

    Dicts, lists, tuples, named tuples and ``None`` are walked here; any other
    registered pytree node is expanded one level at a time by ``jax.tree_util``.
    The key paths, key names and empty nodes of a treedef seen recently are
    reused: then only ``jax.tree_util.tree_flatten`` (C++) walks the tree.
    """
    try:
        values, treedef = jax.tree_util.tree_flatten(tree)
        structure = _STRUCTURES.get(treedef)
    except (TypeError, ValueError):
        # Dict keys jax cannot sort (it raises; the walk keeps their order), or a
        # node whose auxiliary data cannot be hashed: no cache for such trees.
        return _walk(tree)
    except (RecursionError, SystemError) as e:
        # jax's flatten recurses: a tree ~1,000 levels deep exhausts the stack (a
        # SystemError from its binding, caused by a RecursionError).
        _refuse_if_too_deep(tree, e)
        raise
    if structure is not None and len(structure.names) == len(values):
        return Flat(structure, values)
    flat = _walk(tree)
    # Kept only where jax.tree_util finds the same leaves in the same order.
    if len(flat.values) == len(values) and all(map(operator.is_, flat.values, values)):
        with _STRUCTURES_LOCK:  # Saves may run in several threads.
            if len(_STRUCTURES) >= _STRUCTURES_KEPT:
                del _STRUCTURES[next(iter(_STRUCTURES))]
            _STRUCTURES[treedef] = flat.structure
    return flat


# The deepest tree saved and rebuilt: a load rebuilds it recursively, once or twice a level,
# within Python's default limit of 1,000 frames (no model's state comes near). Checked when
# a structure is first walked, so no save writes what its load would refuse.
MAX_DEPTH = 256


_SAVED_TOO_DEEP = (
    "a checkpoint of it could not be loaded. Save a flatter tree (e.g. a dict keyed by key paths)."
)
_ABSTRACT_TOO_DEEP = (
    "no checkpoint holds a tree that deep. Pass an abstract tree of the checkpoint's "
    "structure (cp.pytree_metadata shows it)."
)


def _too_deep(
    names: tuple[str, ...], types: tuple[int, ...], what: str = _SAVED_TOO_DEEP
) -> cp.errors.InvalidArgumentError:
    return cp.errors.InvalidArgumentError(
        f"{keystr(names[:4], types[:4])}... is nested more than {MAX_DEPTH} levels deep: {what}"
    )


def _children(node: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """The children of one node with their keys (none for a leaf), as ``_walk`` finds them."""
    t = type(node)
    if t is dict:
        return [((_DictKey(k),), node[k]) for k in _sorted_keys(node)]
    if t is list or t is tuple:
        return [((_SequenceKey(i),), child) for i, child in enumerate(node)]
    if node is None or isinstance(node, _LEAF_TYPES):
        return []
    if _is_namedtuple(node):
        return [((_GetAttrKey(f),), getattr(node, f)) for f in t._fields]
    return _one_level(node) or []


def _too_deep_path(tree: Any) -> tuple[Any, ...] | None:
    """The first keys of a path deeper than ``MAX_DEPTH``, if any: found without recursion
    (a tree too deep for jax's flatten is too deep for Python's stack), and in bounded time
    (a node is looked at again only when reached deeper: shared or cyclic nodes)."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(tree, 0, ())]
    reached: dict[int, int] = {}
    while stack:
        node, depth, head = stack.pop()
        if depth > MAX_DEPTH:
            return head
        if reached.get(id(node), -1) >= depth:
            continue
        reached[id(node)] = depth
        for keys, child in _children(node):
            stack.append((child, depth + len(keys), (*head, *keys)[:4]))
    return None


def _refuse_if_too_deep(tree: Any, error: BaseException, what: str = _SAVED_TOO_DEEP) -> None:
    """Raises the clear error, from ``error`` (a flatten that ran out of stack), if ``tree``
    is nested too deep; returns if it is not (the caller re-raises ``error``)."""
    head = _too_deep_path(tree)
    if head is not None:
        raise _too_deep(key_names(head), tuple(map(key_type, head)), what) from error


# Frames left free below jax's plain flatten when it checks that a tree is shallow enough
# for its flatten with an `is_leaf` callback (which calls back into Python at each leaf).
_HEADROOM_FRAMES = 8


def _flatten_with_headroom(tree: Any, frames: int = _HEADROOM_FRAMES) -> None:
    if frames:
        return _flatten_with_headroom(tree, frames - 1)
    jax.tree_util.tree_flatten(tree)
    return None


def _walk(tree: Any) -> Flat:
    """``flatten``, walking the tree in Python."""
    leaves: list[Leaf] = []
    empty: list[tuple[tuple[Any, ...], str]] = []
    tuples: list[tuple[Any, ...]] = []

    # `names` and `types` follow `path`: no second pass over each leaf's key path.
    def walk(
        node: Any, path: tuple[Any, ...], names: tuple[str, ...], types: tuple[int, ...]
    ) -> None:
        if len(path) > MAX_DEPTH:  # Refused before the recursion runs out of stack.
            raise _too_deep(names, types)  # Named as users write key paths (['a'][0]).
        t = type(node)
        if t is dict:
            if not node:
                empty.append((path, EMPTY_DICT))
                return
            dict_types = (*types, DICT)
            for k in _sorted_keys(node):
                walk(node[k], (*path, _DictKey(k)), (*names, str(k)), dict_types)
        elif t is list or t is tuple:
            if not node:
                empty.append((path, EMPTY_LIST if t is list else EMPTY_TUPLE))
                return
            if t is tuple:
                tuples.append(path)
            sequence_types = (*types, SEQUENCE)
            for i, child in enumerate(node):
                walk(child, (*path, _SequenceKey(i)), (*names, str(i)), sequence_types)
        elif node is None:
            empty.append((path, EMPTY_NONE))
        elif isinstance(node, _LEAF_TYPES):
            leaves.append(Leaf(path, node, names, types))
        elif _is_namedtuple(node):
            if not node:
                return empty.append((path, EMPTY_NAMEDTUPLE))
            dict_types = (*types, DICT)
            for field in t._fields:
                walk(getattr(node, field), (*path, _GetAttrKey(field)), (*names, field), dict_types)
        else:
            children = _one_level(node)
            if children is None:
                leaves.append(Leaf(path, node, names, types))
            elif not children:
                # A registered node with no children (an empty dataclass, a custom
                # container): recorded as an empty dict, as its non-empty kin load.
                empty.append((path, EMPTY_DICT))
            else:
                for keys, child in children:
                    walk(
                        child,
                        (*path, *keys),
                        (*names, *key_names(keys)),
                        (*types, *(key_type(k) for k in keys)),
                    )

    walk(tree, (), (), ())
    # `walk` refers to itself: a cycle holding the arrays until the garbage collector runs.
    walk = None  # type: ignore[assignment]
    return _flat_of(leaves, empty, tuples)


def _flat_of(
    leaves: list[Leaf], empty: list[tuple[tuple[Any, ...], str]], tuples: list[tuple[Any, ...]]
) -> Flat:
    """The ``Flat`` of what a walk found."""
    keypaths, _, names, key_types = zip(*leaves, strict=True) if leaves else ((), (), (), ())
    int_keys = _int_keys(keypaths, names, empty)
    structure = Structure(keypaths, names, key_types, tuple(empty), tuple(tuples), int_keys)
    return Flat(structure, [leaf.value for leaf in leaves])


def _int_keys(
    keypaths: Sequence[tuple[Any, ...]],
    names: Sequence[tuple[str, ...]],
    empty: Sequence[tuple[tuple[Any, ...], str]],
) -> frozenset[tuple[str, ...]]:
    """The key names of every path to a leaf's or empty node's key that is an int dict key."""
    found: set[tuple[str, ...]] = set()
    paths = [*zip(keypaths, names, strict=True), *((p, key_names(p)) for p, _ in empty)]
    for keypath, key_names_ in paths:
        for i, key in enumerate(keypath):
            if type(key) is _DictKey and type(key.key) is not str and is_int_key(key):
                found.add(key_names_[: i + 1])
    return frozenset(found)


def _abstract_is_leaf(x: Any) -> bool:
    if x is None:
        return True
    return type(x) in (dict, list, tuple) and not x


def flatten_abstract(tree: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], Any]:
    """Flattens an abstract tree (``jax.tree_util``); ``None`` and empty containers are leaves.

    Raises:
      cp.errors.InvalidArgumentError: the tree is nested more than ``MAX_DEPTH`` levels
        deep (no checkpoint is: a save refuses such trees).
    """
    try:
        # jax's flatten with an `is_leaf` callback that runs out of stack leaves the thread's
        # recursion depth raised for good (jax 0.10): its plain flatten, which fails cleanly,
        # finds out first, with frames to spare for the callbacks.
        _flatten_with_headroom(tree)
    except (TypeError, ValueError):
        pass  # Unsortable keys, unhashable auxiliary data: the flatten below says so.
    except (RecursionError, SystemError) as e:
        _refuse_if_too_deep(tree, e, _ABSTRACT_TOO_DEEP)
        raise
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_abstract_is_leaf)
    deepest = max((path for path, _ in flat[0]), key=len, default=())
    if len(deepest) > MAX_DEPTH:
        raise _too_deep(key_names(deepest), tuple(map(key_type, deepest)), _ABSTRACT_TOO_DEEP)
    return flat
