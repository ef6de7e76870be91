"""A chunk TensorStore's zarr3 driver finds missing (it is told not to read one as the
fill value) is a ``MissingChunkError`` naming its key, as the fast path's reads raise:
the type a process-local load tells from damage."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import storage

ZSTD = [{"name": "bytes"}, {"name": "zstd"}]
SHARDED = [
    {
        "name": "sharding_indexed",
        "configuration": {"chunk_shape": [2, 2], "codecs": ZSTD},
    }
]


@pytest.mark.parametrize("codecs", [ZSTD, SHARDED], ids=["chunks", "shards"])
def test_a_chunk_the_driver_finds_missing_is_a_missing_chunk_error(codecs) -> None:
    context = ts.Context()
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "ocdbt", "base": "memory://", "path": "w/"},
        "metadata": {
            "shape": [8, 8],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
            "data_type": "float32",
            "codecs": codecs,
        },
    }
    written = ts.open(spec, create=True, context=context).result()
    written[:4, :4] = np.ones((4, 4), np.float32)  # One chunk (shard) of four.
    store = ts.open({**spec, "fill_missing_data_reads": False}, context=context).result()
    with pytest.raises(ValueError) as raised:
        store.read().result()
    error = storage.storage_error("['w'] (array 'w')", raised.value)
    assert isinstance(error, storage.MissingChunkError), error
    assert isinstance(error, cp.errors.IntegrityError)
    assert "['w'] (array 'w') failed its integrity check: chunk w/c/" in str(error)
    assert "is missing" in str(error)


def test_other_failures_are_not_missing_chunks() -> None:
    error = storage.storage_error("x", ValueError('DATA_LOSS: Error reading local file "f"'))
    assert type(error) is cp.errors.IntegrityError
