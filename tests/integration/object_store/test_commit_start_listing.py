"""What a save's start check on an object store costs: one listing of the prefix (every key,
paged by 1,000: the store lists keys, not top-level names), refused or not, and what it keeps:
the keys only while the save needs them (to clear the prefix), never in a refusal's traceback.
"""

from __future__ import annotations

import math
import types

import checkpointables as cp
import numpy as np
import pytest
from checkpointables import _commit
from etils import epath

from ...object_store_server import S3Proxy

OBJECTS = 1_500  # Two pages of a listing.


def _put_directly(bucket: str, keys: list[str]) -> None:
    """Puts ``keys`` into the test server's own store: thousands of PUTs over HTTP would take
    seconds; the save under test reaches them over HTTP as any other object."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for key in keys:
        backend.put_object(bucket, key, b"x")


@pytest.fixture
def proxy(s3):
    proxy = S3Proxy(s3.endpoint)
    yield proxy
    proxy.stop()


def _large_values(tb: types.TracebackType | None) -> list[str]:
    """The locals of a traceback's frames holding ``OBJECTS`` keys or more (or an
    ``Occupant`` holding them)."""
    held = []
    while tb is not None:
        for name, value in tb.tb_frame.f_locals.items():
            if isinstance(value, _commit.Occupant):
                value = value.keys or ()
            if isinstance(value, (set, frozenset, list, tuple)) and len(value) >= OBJECTS:
                held.append(f"{tb.tb_frame.f_code.co_name}: {name}")
        tb = tb.tb_next
    return held


def test_a_refused_save_lists_the_prefix_once_and_keeps_no_key(s3, proxy) -> None:
    name = s3.new_bucket()
    _put_directly(name, [f"root/step_{i % 4}/{i}" for i in range(OBJECTS)])
    path = f"s3://{name}/root"
    with cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint)):
        cp.storage.exists(f"s3://{name}/elsewhere")  # The store opened before counting.
        with proxy.counting() as counts, pytest.raises(cp.errors.CheckpointExistsError) as e:
            cp.save_pytree(path, {"w": np.ones(2)}, overwrite=True)
    assert "which no checkpoint's metadata" in str(e.value), e.value
    # The pages of one listing; nothing written or removed.
    assert counts.requests["LIST"] == math.ceil(OBJECTS / 1000), counts.requests
    assert counts.requests["PUT"] == counts.requests["DELETE"] == 0, counts.requests
    # The error (kept by a caller, or by an interactive session) holds none of the keys.
    assert not _large_values(e.value.__traceback__)


def _lists(proxy: S3Proxy, path: str, **kwargs) -> int:
    with proxy.counting() as counts:
        cp.save_pytree(path, {"w": np.ones(2)}, **kwargs)
    return counts.requests["LIST"]


def test_an_overwrite_lists_as_a_new_save_does(bucket, proxy) -> None:
    with cp.Context(storage_options=cp.options.StorageOptions(endpoint=proxy.endpoint)):
        cp.save_pytree(f"{bucket}/ck", {"w": np.zeros(2)})
        new = _lists(proxy, f"{bucket}/new")
        overwrite = _lists(proxy, f"{bucket}/ck", overwrite=True)
    # The start check is one listing, names and keys alike: no second one to get the keys.
    assert overwrite == new, (overwrite, new)


def test_a_save_lets_the_start_keys_go_once_it_cleared_the_prefix(bucket) -> None:
    path = epath.Path(f"{bucket}/ck")
    cp.save_checkpointables(path, {"old": {"a": 1}, "pytree": {"w": np.zeros(2)}})
    found = _commit.clear_to_save(path, overwrite=True, replace_unfinished=False, timeout_secs=60)
    assert found is not None and any(k.startswith("old/") for k in found.keys or ())
    target = _commit.target_for(path, path, overwrite=True, found=found)
    target.create(["pytree"], None)
    assert not [k for k in cp.storage.list_files(path) if k.startswith("old/")]  # Cleared.
    # Not held while the save writes (a checkpoint of 100k objects: ~10 MB of keys).
    assert target.found is not None and target.found.keys == frozenset()
    target.discard()
