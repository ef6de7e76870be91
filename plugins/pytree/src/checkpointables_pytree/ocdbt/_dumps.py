"""TensorStore's ``ts.ocdbt.dump``, run at most once per b-tree node while its results leak.

``ts.ocdbt.dump`` (TensorStore 0.1.86, the newest release at the time of
writing) builds its result with ``PyDict_SetItem`` on new references that it
never releases, so every key and value of a dumped node stays alive for good:
a load of 10,000 small arrays in zstd-compressed nodes (Orbax's) lost 13 MiB,
every load. The report for TensorStore is ``docs/design/tensorstore-ocdbt-dump-leak.md``.

Until it is fixed, results are kept by what identifies their bytes: a node's
location (a byte range of an immutable data file, under its database's
directory) or a local manifest's identity, size and modification time. A
process then leaks once per distinct node it reads, not once per load; the
cache holds at most ``CACHED_DUMPS`` results, so a fixed TensorStore's results
are freed as they fall out. Nothing here manipulates reference counts.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
from collections.abc import Hashable, Sequence
from typing import Any

import tensorstore as ts

__all__ = ["dump", "dump_async", "dump_each", "dump_leaks", "CACHED_DUMPS"]

# Dumped manifests and nodes kept: a load of a tree of 10,000 arrays reads a few nodes.
CACHED_DUMPS = 256

_cached: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
_lock = threading.Lock()


def dump(base: ts.KvStore, location: str | None = None, *, key: Hashable = None) -> Any:
    """``ts.ocdbt.dump(base, location).result()``, reused for the same ``key``.

    ``key`` must identify the dumped bytes (``None``: not kept). The result is
    shared: callers must not change it.
    """
    found = _get(key)
    if found is not None:
        return found
    return _put(key, ts.ocdbt.dump(base, location).result())


async def dump_async(base: ts.KvStore, location: str | None = None, *, key: Hashable = None) -> Any:
    """``await ts.ocdbt.dump(base, location)``, reused for the same ``key`` (see ``dump``)."""
    found = _get(key)
    if found is not None:
        return found
    return _put(key, await ts.ocdbt.dump(base, location))


def dump_each(base: ts.KvStore, locations: Sequence[str], keys: Sequence[Hashable]) -> list[Any]:
    """``dump`` of every location, read all at once (one round trip, not one per node, on
    an object store); a node that cannot be dumped gives its ``ValueError`` in its place."""
    started = [
        _get(key) or ts.ocdbt.dump(base, where) for where, key in zip(locations, keys, strict=True)
    ]
    results: list[Any] = []
    for key, result in zip(keys, started, strict=True):
        if isinstance(result, ts.Future):
            try:
                result = _put(key, result.result())
            except ValueError as e:
                result = e
        results.append(result)
    return results


def _get(key: Hashable) -> Any:
    if key is None:
        return None
    with _lock:
        found = _cached.get(key)
        if found is not None:
            _cached.move_to_end(key)
        return found


def _put(key: Hashable, result: Any) -> Any:
    if key is not None:
        with _lock:
            _cached[key] = result
            while len(_cached) > CACHED_DUMPS:
                _cached.popitem(last=False)
    return result


@functools.cache
def dump_leaks() -> bool:
    """Whether this TensorStore's ``ts.ocdbt.dump`` results hold a reference too many
    (the bug ``docs/design/tensorstore-ocdbt-dump-leak.md`` reports)."""
    try:
        store = ts.KvStore.open({"driver": "ocdbt", "base": "memory://"}).result()
        store.write("probe", b"probe value").result()
        assert store.base is not None  # An ocdbt store's base: the memory store above.
        manifest = ts.ocdbt.dump(store.base).result()
    except ValueError:  # TensorStore's errors: no probe.
        return False
    control: dict[str, Any] = {"versions": []}
    return sys.getrefcount(manifest["versions"]) == sys.getrefcount(control["versions"]) + 1
