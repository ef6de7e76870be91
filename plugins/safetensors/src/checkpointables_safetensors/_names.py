"""Tensor names and pytree key paths: ``"model.layers.0.mlp.weight"`` is a path of keys.

Hugging Face names join module attribute names and list indices with dots.
Loading without an abstract tree nests them as dicts (``{"model": {"layers":
{"0": ...}}}``); an abstract tree's key paths are joined the same way to find
each leaf's tensor, so lists and custom nodes (``nnx.State``) load too.

A Flax NNX ``Variable`` (``nnx.Param``...) flattens to one child under the
attribute key ``value``, so ``nnx.state(model)``'s key paths end in ``.value``
(``['l']['kernel'].value``); that key is no part of a tensor name: the name is
the one ``nnx.to_pure_dict`` gives (``l.kernel``). Variables are recognised by
class (one named ``Variable`` from a ``flax.nnx`` module, subclasses too) while
flattening: flax is never imported here, and another class with a ``value``
attribute keeps its key. A checkpoint's metadata tree records Variables as
dicts (``{"kernel": {"value": ...}}``); such a tree (or subtree) whose every
leaf is the lone ``"value"`` entry of its dict is named the same way.

A load gives each leaf the first of its ``NamedLeaf.candidates`` that the file
holds: its full key path (``a.value`` loads tensor ``a.value`` even beside
``a``), then the shortened name, then the name less a last ``value`` key (what
exporting a checkpoint of a dataclass with a ``value`` field writes).
"""

from __future__ import annotations

import collections
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax

__all__ = [
    "SEPARATOR",
    "name_of",
    "nest",
    "child_keys",
    "subtree",
    "SubtreeNotFoundError",
    "NamedLeaf",
    "named_leaves",
    "dict_form",
    "tensor_names",
]

SEPARATOR = "."
# The attribute key under which a Flax NNX Variable's flattening puts its value.
VARIABLE_KEY = "value"
# Its classes' names: state leaves were ``VariableState``s before Flax 0.12 (now an alias).
_VARIABLE_CLASSES = frozenset({"Variable", "VariableState"})


class SubtreeNotFoundError(cp.errors.InvalidArgumentError, KeyError):
    """A subtree key path selects nothing: an ``InvalidArgumentError``, and a ``KeyError``
    as it always was (``except KeyError`` keeps working)."""

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError's own would show the message quoted.


def _key_text(entry: Any) -> str:
    for attribute in ("key", "idx", "name"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def name_of(keypath: tuple[Any, ...]) -> str:
    """The tensor name of a pytree key path: its keys joined with dots."""
    return SEPARATOR.join(_key_text(entry) for entry in keypath)


def nest(values: Mapping[str, Any], *, source: Any) -> dict[str, Any]:
    """``{"a.b": x, "a.c": y}`` as ``{"a": {"b": x, "c": y}}``, in the order of ``values``.

    Raises:
      cp.errors.MetadataError: a name is both a tensor and the prefix of
        another (``"a.b"`` and ``"a.b.c"``); the message names ``source``.
    """
    tree: dict[str, Any] = {}
    for name, value in values.items():
        *parents, leaf = name.split(SEPARATOR)
        node = tree
        for depth, key in enumerate(parents):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise _clash(source, SEPARATOR.join(parents[: depth + 1]), name)
            node = child
        if leaf in node:
            raise _clash(source, name, name + SEPARATOR + "...")
        node[leaf] = value
    return tree


def _clash(source: Any, first: str, second: str) -> cp.errors.MetadataError:
    return cp.errors.MetadataError(
        f"{source}: the tensor names {first!r} and {second!r} cannot both be keys of a nested "
        f"dict (one is a prefix of the other). Load the file with safetensors' own loader, "
        f"or rename the tensors."
    )


def child_keys(node: Any) -> dict[str, Any]:
    """The direct children of a pytree node, by their keys as tensor names write them."""
    # Every child is a leaf here: this lists the node's direct children.
    flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x, n=node: x is not n)[0]
    return {_key_text(keypath[0]): child for keypath, child in flat if keypath}


def subtree(tree: Any, path: str | Iterable[str] | None) -> Any:
    """The subtree of ``tree`` at the dotted key path ``path`` (all of it for ``None``/``""``).

    Raises:
      SubtreeNotFoundError: no such key (a ``cp.errors.InvalidArgumentError`` and a
        ``KeyError``); the message lists the keys there.
    """
    keys = path.split(SEPARATOR) if isinstance(path, str) else list(path or [])
    node = tree
    for depth, key in enumerate(k for k in keys if k):
        children = child_keys(node)
        if key not in children:
            where = SEPARATOR.join(keys[:depth]) or "the root"
            raise SubtreeNotFoundError(
                f"No key {key!r} under {where}; the keys there are {sorted(children)}."
            )
        node = children[key]
    return node


def is_nnx_variable(node: Any) -> bool:
    """True for a Flax NNX ``Variable`` (any subclass: ``nnx.Param``, ``nnx.BatchStat``...),
    told by its classes' names and modules: flax is not imported (it is optional)."""
    return any(
        c.__name__ in _VARIABLE_CLASSES and str(getattr(c, "__module__", "")).startswith("flax.nnx")
        for c in type(node).__mro__
    )


def _is_attribute_value(key: Any) -> bool:
    return isinstance(key, jax.tree_util.GetAttrKey) and key.name == VARIABLE_KEY


def _is_dict_value(key: Any) -> bool:
    return isinstance(key, jax.tree_util.DictKey) and key.key == VARIABLE_KEY


@attrs.frozen
class NamedLeaf:
    """A leaf of a flattened tree, and the key of its path that is no part of its name."""

    keypath: tuple[Any, ...]
    leaf: Any
    drop: int | None = None  # The index in ``keypath`` of an NNX Variable's ``value`` key.

    @property
    def keys(self) -> list[str]:
        """The texts of the keys that name the tensor, the Variable's ``value`` left out."""
        return [_key_text(k) for i, k in enumerate(self.keypath) if i != self.drop]

    @property
    def name(self) -> str:
        """The tensor name: the key path joined with dots, less a Variable's ``value``."""
        return SEPARATOR.join(self.keys)

    @property
    def full(self) -> str:
        """Every key joined with dots (the name before NNX Variables were recognised)."""
        return name_of(self.keypath)

    @property
    def bare(self) -> str:
        """The full name less a last key ``value`` (attribute or dict key): the name a
        checkpoint's export gives a node's ``value`` field, recorded as ``{"value": x}``."""
        last = self.keypath[-1] if len(self.keypath) > 1 else None
        if _is_attribute_value(last) or _is_dict_value(last):
            return name_of(self.keypath[:-1])
        return self.full

    @property
    def candidates(self) -> list[str]:
        """The names the leaf loads from, the first that a file holds winning: its full
        key path, then its shortened ``name``, then ``bare`` (each once)."""
        return list(dict.fromkeys((self.full, self.name, self.bare)))


def named_leaves(tree: Any) -> list[NamedLeaf]:
    """The leaves of ``tree`` in ``jax.tree_util`` order (``None`` leaves included, as
    ``tree_flatten_with_path(tree, is_leaf=lambda x: x is None)`` gives them), each
    with the ``value`` key of its NNX Variable marked to leave out of its name."""
    outer = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None or is_nnx_variable(x)
    )[0]
    leaves = []
    for keypath, node in outer:
        if node is None or not is_nnx_variable(node):
            leaves.append(NamedLeaf(keypath, node))
            continue
        # A Variable's one child, its value (an array, or a pytree), is flattened in place:
        # the same leaves, in the same order, as a flattening that does not stop here.
        for inner, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is None)[
            0
        ]:
            drop = len(keypath) if inner and _is_attribute_value(inner[0]) else None
            leaves.append(NamedLeaf((*keypath, *inner), leaf, drop))
    return leaves


def dict_form(leaves: Sequence[NamedLeaf], among: Sequence[NamedLeaf]) -> list[NamedLeaf]:
    """``leaves`` (some of ``among``, a whole tree's) named as NNX Variables saved as dicts.

    A checkpoint records no node types: ``nnx.state(model)`` is saved, and its metadata
    and a load without an abstract tree give, ``{"kernel": {"value": array}}``. When no
    Variable was recognised by class and every leaf here that is not ``None`` is the lone
    ``"value"`` entry of a dict (no other leaf of ``among`` under that dict), the tree is
    taken for that form and the ``"value"`` keys are left out of the names. Any other
    leaf (a ``"bias"`` beside a ``"value"``, a plain array) keeps every name whole.
    """
    if any(leaf.drop is not None for leaf in among):
        return list(leaves)
    under: collections.Counter[tuple[Any, ...]] = collections.Counter(
        leaf.keypath[:depth] for leaf in among for depth in range(len(leaf.keypath))
    )
    present = [leaf for leaf in leaves if leaf.leaf is not None]
    lone = all(
        len(leaf.keypath) > 1  # A top-level "value" names the tensor: no name is empty.
        and _is_dict_value(leaf.keypath[-1])
        and under[leaf.keypath[:-1]] == 1
        for leaf in present
    )
    if not present or not lone:
        return list(leaves)
    return [
        attrs.evolve(leaf, drop=len(leaf.keypath) - 1) if leaf.leaf is not None else leaf
        for leaf in leaves
    ]


def tensor_names(tree: Any, available: Container[str]) -> list[str]:
    """The tensor each leaf of ``tree`` loads from, in ``named_leaves`` order: the first of
    its ``candidates`` in ``available`` (the full key path where the file holds it, so
    ``a.value`` loads tensor ``a.value``, never ``a``), or its shortened name, the one
    reported missing, where none is."""
    leaves = named_leaves(tree)
    return [
        next((n for n in leaf.candidates if n in available), leaf.name)
        for leaf in dict_form(leaves, leaves)
    ]
