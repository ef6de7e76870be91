"""The Grain plugin against oversized, damaged and hostile files: clear errors, at once."""

from __future__ import annotations

import json

import checkpointables as cp
import grain
import numpy as np
import pytest
from checkpointables import cli
from checkpointables_grain import IteratorStateError, UnsupportedStateError, _state_json
from hypothesis import given, settings
from hypothesis import strategies as st

from ...metadata_edits import with_metadata_checksums_recomputed
from ...traced_memory import TracedPeak
from .pipelines import data_loader, map_pipeline, take

MAX = cp.metadata_checksums.MAX_FILE_BYTES


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


def _saved(tmp_path, steps: int = 2):
    it = iter(map_pipeline())
    take(it, steps)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    return tmp_path / "c"


def _load(checkpoint):
    return cp.load_checkpointables(checkpoint, {"dataset": iter(map_pipeline())})["dataset"]


def test_a_state_larger_than_a_metadata_file_is_refused_before_writing(tmp_path) -> None:
    # Escaped, each character is 12 bytes of JSON: a file past the limit, cheaply.
    state = {"next_index": 0, "pad": "\U0001f600" * (MAX // 12 + 1)}
    with pytest.raises(cp.errors.InvalidArgumentError, match="pytree checkpointable"):
        cp.save_checkpointables(tmp_path / "c", {"dataset": FixedStateIterator(state)})
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("name", ["process_0-of-1.json", "grain_iterator.json"])
def test_a_huge_file_is_refused_unread(tmp_path, name) -> None:
    # Sparse: 3 GiB on no disk. Read whole, a 5 GiB state file took 63 s and 10 GiB.
    checkpoint = _saved(tmp_path)
    with open(checkpoint / "dataset" / name, "r+b") as f:
        f.truncate(3 << 30)
    with_metadata_checksums_recomputed(checkpoint)  # It is now data, as core sees it.
    with TracedPeak() as traced:
        with pytest.raises(cp.errors.MetadataError, match=f"{name} holds more than"):
            _load(checkpoint)
        assert cli.main(["verify", str(checkpoint)]) == 1
    assert traced.peak < 64 << 20, traced.peak


def _with_info(checkpoint, **changes) -> None:
    info_file = checkpoint / "dataset" / "grain_iterator.json"
    info = json.loads(info_file.read_text())
    info_file.write_text(json.dumps({**info, **changes}))
    with_metadata_checksums_recomputed(checkpoint)


@pytest.mark.parametrize("count", [10**11, True, 0])
def test_an_impossible_recorded_process_count_is_refused(tmp_path, capsys, count) -> None:
    checkpoint = _saved(tmp_path)
    _with_info(checkpoint, process_count=count)
    with pytest.raises(cp.errors.MetadataError, match="'process_count' from 1 to 1,048,576"):
        _load(checkpoint)
    assert cli.main(["verify", str(checkpoint)]) == 1  # At once: it looped 10**11 times.
    assert "'process_count' from 1 to" in capsys.readouterr().out


def test_verify_refuses_a_file_name_with_a_huge_process_count(tmp_path, capsys) -> None:
    checkpoint = _saved(tmp_path)
    (checkpoint / "dataset" / "grain_iterator.json").unlink()  # As Grain's own handler writes.
    (checkpoint / "dataset" / "process_0-of-1.json").rename(
        checkpoint / "dataset" / "process_0-of-99999999999.json"
    )
    with_metadata_checksums_recomputed(checkpoint)
    assert cli.main(["verify", str(checkpoint)]) == 1
    assert "names 99,999,999,999 processes" in capsys.readouterr().out


def test_verify_counts_many_missing_state_files(tmp_path, capsys) -> None:
    checkpoint = _saved(tmp_path)
    _with_info(checkpoint, process_count=5000)
    (checkpoint / "dataset" / "process_0-of-1.json").rename(
        checkpoint / "dataset" / "process_0-of-5000.json"
    )
    with_metadata_checksums_recomputed(checkpoint)
    assert cli.main(["verify", str(checkpoint)]) == 1
    out = capsys.readouterr().out
    assert "lacks process_1-of-5000.json" in out and "lacks 4,989 more" in out
    assert "process_11-of-5000.json" not in out


@pytest.mark.parametrize("value", ["2.5", "NaN", "true", "1e400"])
def test_a_next_index_that_is_no_position_is_an_integrity_error(tmp_path, capsys, value) -> None:
    # No save writes it, so the file is damaged or forged (docs/grain.md): IntegrityError,
    # as for a malformed tag, and not the error of an iterator that does not fit.
    checkpoint = _saved(tmp_path)
    (checkpoint / "dataset" / "process_0-of-1.json").write_text(f'{{"next_index": {value}}}')
    with_metadata_checksums_recomputed(checkpoint)
    with pytest.raises(
        cp.errors.IntegrityError, match=r"state\['next_index'\] = .* non-negative"
    ) as e:
        _load(checkpoint)
    assert not isinstance(e.value, IteratorStateError)
    assert cli.main(["verify", str(checkpoint)]) == 1
    assert "is not a position" in capsys.readouterr().out


def test_a_next_index_that_is_no_position_is_refused_at_save(tmp_path) -> None:
    with pytest.raises(UnsupportedStateError, match=r"state\['next_index'\] is 2.5"):
        iterator = FixedStateIterator({"next_index": 2.5})
        cp.save_checkpointables(tmp_path / "c", {"dataset": iterator})
    assert not (tmp_path / "c").exists()


# What no Grain state holds where a position is: fractions, NaN, infinities, whole floats
# (8.0), bools, negative numbers; as JSON numbers and as the tagged NumPy values a save writes.
_FLOATS = st.floats(allow_nan=True, allow_infinity=True)
_NOT_POSITIONS = st.one_of(
    _FLOATS,
    st.sampled_from([8.5, float("nan"), 8.0, -0.0]),
    st.booleans(),
    st.integers(max_value=-1),
    _FLOATS.map(np.float64),
    st.floats(width=32).map(np.float32),
    _FLOATS.map(np.array),  # A 0-d float array.
    st.integers(min_value=-(2**63), max_value=-1).map(np.int64),
    # An integer array, even 0-d: Grain adds to it in place, and the iterator skips elements.
    st.integers(0, 9).map(np.array),
    st.integers(0, 9).map(lambda i: np.array([i])),
)


def _rewrite_state(checkpoint, text: str) -> None:
    (checkpoint / "dataset" / "process_0-of-1.json").write_text(text)
    with_metadata_checksums_recomputed(checkpoint)


def test_a_stored_next_index_that_is_no_whole_position_is_refused_at_load(tmp_path) -> None:
    # Grain's set_state takes NaN or 8.5 and the first next() failed with a bare IndexError.
    checkpoint = _saved(tmp_path)

    @settings(max_examples=40, deadline=None)
    @given(value=_NOT_POSITIONS, nested=st.booleans())
    def check(value, nested: bool) -> None:
        state = {"parent": {"next_index": value}} if nested else {"next_index": value}
        _rewrite_state(checkpoint, _state_json.dumps(state))
        with pytest.raises(cp.errors.IntegrityError, match=r"\['next_index'\] = .* not a pos") as e:
            _load(checkpoint)
        assert str(checkpoint / "dataset" / "process_0-of-1.json") in str(e.value)
        assert "start the data pipeline afresh" in str(e.value)

    check()


def test_whole_positions_as_grain_and_saves_write_them_still_load(tmp_path) -> None:
    checkpoint = _saved(tmp_path)

    @settings(max_examples=15, deadline=None)
    @given(index=st.integers(0, 30), as_numpy=st.sampled_from([None, np.int64]))
    def check(index: int, as_numpy) -> None:
        value = index if as_numpy is None else as_numpy(index)
        _rewrite_state(checkpoint, _state_json.dumps({"next_index": value}))
        expected = iter(map_pipeline())
        take(expected, index)
        assert take(_load(checkpoint), min(2, 30 - index)) == take(expected, min(2, 30 - index))

    check()


def _saved_loader(tmp_path, steps: int):
    it = iter(data_loader())
    take(it, steps)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    return tmp_path / "c"


def test_a_data_loader_position_that_is_no_whole_number_is_refused_at_load(tmp_path) -> None:
    # A DataLoader state holds last_seen_indices: NaN there failed at the first next()
    # with "IndexError: pop from an empty deque", 8.5 with a TypeError.
    checkpoint = _saved_loader(tmp_path, 1)
    state = json.loads((checkpoint / "dataset" / "process_0-of-1.json").read_text())
    plain = st.one_of(_FLOATS, st.sampled_from([8.5, float("nan")]), st.booleans())
    fields = st.sampled_from(["last_seen_indices", "last_worker_index", "worker_count"])

    @settings(max_examples=30, deadline=None)
    @given(value=plain, field=fields)
    def check(value, field: str) -> None:
        forged = {**state, field: {"0": value} if field == "last_seen_indices" else value}
        _rewrite_state(checkpoint, json.dumps(forged))
        with pytest.raises(cp.errors.IntegrityError, match=rf"\['{field}'\].* = .* not a pos"):
            cp.load_checkpointables(checkpoint, {"dataset": data_loader()})

    check()


@pytest.mark.parametrize("steps", [0, 3])
def test_data_loader_states_grain_writes_still_load(tmp_path, steps) -> None:
    # Before the first element, Grain records last_seen_indices {"0": -1}: negative, and whole.
    checkpoint = _saved_loader(tmp_path, steps)
    expected = iter(data_loader())
    take(expected, steps)
    restored = cp.load_checkpointables(checkpoint, {"dataset": data_loader()})["dataset"]
    assert take(restored, 2) == take(expected, 2)


@pytest.mark.parametrize(
    "state",
    [{"next_index": np.array(8.5)}, {"p": [{"next_index": np.float64("nan")}]}],
)
def test_a_position_that_is_no_whole_number_is_refused_at_save(tmp_path, state) -> None:
    with pytest.raises(UnsupportedStateError, match=r"\['next_index'\] is .* non-negative"):
        cp.save_checkpointables(tmp_path / "c", {"dataset": FixedStateIterator(state)})
    assert not (tmp_path / "c").exists()


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
