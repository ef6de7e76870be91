"""The database of one load or save (``_database``)."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
from checkpointables_pytree import _database
from etils import epath


def test_a_load_opens_the_database_before_reading_the_metadata(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"w": np.arange(10)})
    pytree = epath.Path(tmp_path / "c" / "pytree")
    opened = _database.OpenedDatabase.start(pytree)
    assert opened is not None
    assert any(k.endswith(b"zarr.json") for k in opened.kvstore.list().result())
    # Not a local OCDBT database: left to the ordinary reads.
    assert _database.OpenedDatabase.start(epath.Path(tmp_path)) is None
    assert _database.OpenedDatabase.start(epath.Path("gs://bucket/c/pytree")) is None
