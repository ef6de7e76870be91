"""``cp.storage.read_bytes(path, max_bytes=)``: a file larger than the bound is refused
before it is read on the local disk (by its size), and after on other storage."""

from __future__ import annotations

import checkpointables as cp
import pytest

from ..traced_memory import TracedPeak


def test_a_bounded_read_refuses_a_larger_file_before_reading_it(tmp_path) -> None:
    small, sparse = tmp_path / "small", tmp_path / "sparse"
    small.write_bytes(b"x" * 100)
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)  # 2 GiB that occupy no disk.
    assert cp.storage.read_bytes(small, max_bytes=100) == b"x" * 100
    with pytest.raises(cp.errors.MetadataError, match=r"small holds more than 99 bytes"):
        cp.storage.read_bytes(small, max_bytes=99)
    refused = pytest.raises(cp.errors.MetadataError, match="Restore it from a copy")
    with TracedPeak() as traced, refused:
        cp.storage.read_bytes(sparse, max_bytes=1 << 20)
    assert traced.peak < 1 << 20, traced.peak
    assert isinstance(cp.storage.for_path(small), cp.storage.BoundedReads)
