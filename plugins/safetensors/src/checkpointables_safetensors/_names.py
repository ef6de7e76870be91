"""Tensor names and pytree key paths: ``"model.layers.0.mlp.weight"`` is a path of keys.

Hugging Face names join module attribute names and list indices with dots.
Loading without an abstract tree nests them as dicts (``{"model": {"layers":
{"0": ...}}}``); an abstract tree's key paths are joined the same way to find
each leaf's tensor, so lists and custom nodes (``nnx.State``) load too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import checkpointables as cp
import jax

__all__ = ["SEPARATOR", "name_of", "nest", "child_keys", "subtree"]

SEPARATOR = "."


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
      KeyError: no such key; the message lists the keys there.
    """
    keys = path.split(SEPARATOR) if isinstance(path, str) else list(path or [])
    node = tree
    for depth, key in enumerate(k for k in keys if k):
        children = child_keys(node)
        if key not in children:
            where = SEPARATOR.join(keys[:depth]) or "the root"
            raise KeyError(f"No key {key!r} under {where}; the keys there are {sorted(children)}.")
        node = children[key]
    return node
