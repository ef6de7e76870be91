"""``_ocdbt_index.dump``: TensorStore's node dumps without the references they leak."""

from __future__ import annotations

import sys

import tensorstore as ts
from checkpointables_pytree import ocdbt


def _database() -> ts.KvStore:
    store = ts.KvStore.open({"driver": "ocdbt", "base": "memory://"}).result()
    store.write("some/key", b"some value that is stored inline").result()
    return store


def _refcount_of_a_member(document: dict) -> int:
    return sys.getrefcount(document["versions"])


def test_a_dumped_manifest_holds_no_reference_too_many() -> None:
    manifest = ocdbt.dump(_database().base)
    control = {"versions": []}
    assert _refcount_of_a_member(manifest) == _refcount_of_a_member(control)


def test_every_member_of_a_node_can_be_freed() -> None:
    base = _database().base
    manifest = ocdbt.dump(base)
    location = manifest["versions"][-1]["root"]["location"]
    node = ocdbt.dump(base, location)
    (entry,) = node["entries"]
    assert entry["key"] == b"some/key"
    value = entry["inline_value"]
    # The entry dict holds it, and so do `value` and getrefcount's argument: nothing else.
    assert sys.getrefcount(value) == 3


def test_the_probe_tells_whether_tensorstore_leaks() -> None:
    raw = ts.ocdbt.dump(_database().base).result()
    control = {"versions": []}
    extra = 1 if ocdbt.leaks() else 0
    assert _refcount_of_a_member(raw) == _refcount_of_a_member(control) + extra
