"""``ts.ocdbt.dump`` without the memory its results leak.

TensorStore (0.1.86, the newest release at the time of writing) turns the JSON
of ``ts.ocdbt.dump`` into Python objects with ``PyDict_SetItem`` on references
it then releases instead of dropping: every key and value of every dict in
the result keeps one reference too many and is never freed. The b-tree nodes
of a load of 10,000 small arrays hold their values inline, so each such load
lost about 13 MiB for good.

This module hands those references back. A probe at first use checks that
this TensorStore leaks them (dumping a one-key database in memory); a
version that does not is left alone, so a fixed TensorStore never has
references taken away.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import sys
from typing import Any

import tensorstore as ts

__all__ = ["dump", "dump_async"]

_decref = ctypes.pythonapi.Py_DecRef
_decref.argtypes = [ctypes.py_object]
_decref.restype = None
_IS_DICT = frozenset({dict}).__contains__
_IS_LIST = frozenset({list}).__contains__
_IS_CONTAINER = frozenset({dict, list}).__contains__


@functools.cache
def leaks() -> bool:
    """Whether this TensorStore's ``ts.ocdbt.dump`` results hold a reference too many."""
    try:
        store = ts.KvStore.open({"driver": "ocdbt", "base": "memory://"}).result()
        store.write("probe", b"probe value").result()
        manifest = ts.ocdbt.dump(store.base).result()
    except Exception:  # No probe, no correction: a leak is better than a crash.
        return False
    control: dict[str, Any] = {"versions": []}
    expected = sys.getrefcount(control["versions"])
    return sys.getrefcount(manifest["versions"]) == expected + 1


def _give_back(result: Any) -> Any:
    """Drops the reference too many of every dict key and value in ``result``.

    Nodes hold thousands of entries: they are handed to ``Py_DecRef`` by
    C-level iteration (``map``, ``compress``), not one Python statement each.
    """
    stack = [result]
    while stack:
        node = stack.pop()
        dicts = [node] if type(node) is dict else _dicts_in(node, stack)
        values = list(itertools.chain.from_iterable(map(dict.values, dicts)))
        # Each dict still holds its keys and values: nothing is freed here.
        keys = itertools.chain.from_iterable(dicts)
        collections.deque(map(_decref, itertools.chain(keys, values)), maxlen=0)
        stack.extend(itertools.compress(values, map(_IS_CONTAINER, map(type, values))))
    return result


def _dicts_in(items: list[Any], stack: list[Any]) -> list[dict[Any, Any]]:
    """The dicts among ``items``; its lists go onto ``stack``."""
    kinds = list(map(type, items))
    if kinds.count(dict) == len(kinds):  # A node's entries (or nothing).
        return items
    stack.extend(itertools.compress(items, map(_IS_LIST, kinds)))
    return list(itertools.compress(items, map(_IS_DICT, kinds)))


def dump(base: ts.KvStore, location: str | None = None) -> Any:
    """``ts.ocdbt.dump(base, location).result()``, without its leak."""
    result = ts.ocdbt.dump(base, location).result()
    return _give_back(result) if leaks() else result


async def dump_async(base: ts.KvStore, location: str | None = None) -> Any:
    """``await ts.ocdbt.dump(base, location)``, without its leak."""
    result = await ts.ocdbt.dump(base, location)
    return _give_back(result) if leaks() else result
