"""A load that fails leaves nothing of its own running."""

from __future__ import annotations

import sys

import checkpointables as cp
import numpy as np
import pytest

_BACKGROUND_READS = ("_read_root", "check_recorded_nodes")


def _reads_still_running() -> list[str]:
    """The background reads of a load (the index's prefetch, its node check) on any thread."""
    running = []
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name in _BACKGROUND_READS:
                running.append(frame.f_code.co_name)
            frame = frame.f_back
    return running


@pytest.mark.parametrize("attempt", range(3))
def test_a_load_that_fails_on_its_metadata_waits_for_its_background_reads(
    tmp_path, attempt
) -> None:
    # Enough leaves that the load starts reading the index on a worker thread at once;
    # the damaged _METADATA fails in microseconds, long before that read ends. A load
    # that raised with it running left it reading a directory the caller may delete.
    path = tmp_path / "c"
    cp.save_pytree(path, {f"leaf_{i}": np.full(3, i) for i in range(600)})
    metadata = path / "pytree" / "_METADATA"
    metadata.write_bytes(metadata.read_bytes()[:-7] + b"garbage")
    with pytest.raises(cp.errors.CheckpointError):
        cp.load_pytree(path)
    assert _reads_still_running() == []
