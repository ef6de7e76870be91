"""The database a load opens early (``ocdbt.OpenedDatabase``, a part of the fast path)."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest
from checkpointables_pytree import ocdbt
from etils import epath

pytestmark = pytest.mark.fast_path


def test_a_load_opens_the_database_before_reading_the_metadata(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"w": np.arange(10)})
    pytree = epath.Path(tmp_path / "c" / "pytree")
    opened = ocdbt.OpenedDatabase.start(pytree, many_values=False)
    assert opened is not None
    assert any(k.endswith(b"zarr.json") for k in opened.kvstore.list().result())
    # Not a local OCDBT database: left to the ordinary reads.
    assert ocdbt.OpenedDatabase.start(epath.Path(tmp_path), many_values=False) is None
    gs = epath.Path("gs://bucket/c/pytree")
    assert ocdbt.OpenedDatabase.start(gs, many_values=False) is None


def test_a_load_of_many_leaves_starts_reading_the_index_early(tmp_path) -> None:
    cp.save_pytree(tmp_path / "few", {"w": np.arange(10)})
    many = {f"w{i}": np.full(4, i) for i in range(300)}
    cp.save_pytree(tmp_path / "many", many)
    few = ocdbt.OpenedDatabase.start(tmp_path / "few" / "pytree", many_values=False)
    assert few is not None and few.index._start is None  # A small tree: nothing started.
    # The handler says "many" from the size of _METADATA.
    assert (
        tmp_path / "many" / "pytree" / "_METADATA"
    ).stat().st_size > ocdbt.PREFETCH_METADATA_BYTES
    opened = ocdbt.OpenedDatabase.start(tmp_path / "many" / "pytree", many_values=True)
    assert opened is not None and opened.index._start is not None
    loaded = cp.load_pytree(tmp_path / "many")
    for key, value in many.items():
        np.testing.assert_array_equal(loaded[key], value)
