"""The Grain plugin against oversized, damaged and hostile files: clear errors, at once."""

from __future__ import annotations

import json

import checkpointables as cp
import grain
import pytest

from ...metadata_edits import with_metadata_checksums_recomputed


class FixedStateIterator(grain.DatasetIterator):
    """A custom dataset iterator whose state is whatever it was given."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state

    def __next__(self):
        raise StopIteration

    def get_state(self):
        return self.state

    def set_state(self, state) -> None:
        self.state = state


@pytest.mark.parametrize(
    "tagged",
    [
        {"__checkpointables__": "numpy", "dtype": "int8", "value": 3000},
        {"__checkpointables__": "numpy", "dtype": "V8", "value": 10**12},
        {"__checkpointables__": "numpy", "dtype": "float32", "value": [1, 2]},
    ],
)
def test_a_malformed_numpy_value_is_an_integrity_error(tmp_path, tagged) -> None:
    checkpoint = tmp_path / "c"
    cp.save_checkpointables(checkpoint, {"dataset": FixedStateIterator({"n": 1})})
    (checkpoint / "dataset" / "process_0-of-1.json").write_text(json.dumps({"n": tagged}))
    with_metadata_checksums_recomputed(checkpoint)
    with pytest.raises(cp.errors.IntegrityError, match="malformed 'numpy' value"):
        cp.load_checkpointables(checkpoint, {"dataset": FixedStateIterator(None)})
