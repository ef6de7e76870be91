"""Iterator states as JSON: plain states stay Grain's JSON; everything else round-trips exactly."""

from __future__ import annotations

import json
import math
import os

import checkpointables as cp
import grain
import numpy as np
import pytest
from checkpointables_grain import UnsupportedStateError
from checkpointables_grain._state_json import StateDecodingError, StateEncodingError, dumps, loads


def _strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float | np.floating) and math.isnan(a):
        return bool(math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


RICH_STATE = {
    "next_index": 7,
    "key": b"\x00\x01\xfe\xff",
    "pair": (1, 2.5, "x"),
    "by_id": {3: "three", (1, 2): [None, True]},
    "count": np.int64(2**62),
    "flag": np.bool_(True),
    "half": np.float16(0.333),
    "rate": np.float32(0.1),
    "weights": np.arange(6, dtype=np.float32).reshape(2, 3),
    "big_endian": np.array([1, 2], dtype=">i4"),
    "names": np.array(["ab", "c"]),
    "wide": np.complex64(1 + 2j),
    "nan": float("nan"),
    "inf": [float("inf"), float("-inf"), np.float64("nan")],
    "tag_lookalike": {"__checkpointables__": "bytes", "base64": "not ours"},
    "nested": [{"deep": [{"deeper": ()}]}],
}


def test_rich_states_round_trip_exactly_as_strict_json() -> None:
    text = dumps(RICH_STATE)
    _strict_json(text)
    assert _same(loads(text), RICH_STATE)


def test_plain_states_are_written_as_grain_writes_them() -> None:
    state = {"next_index": 3, "parents": [{"a": 1.5, "b": None, "c": "s", "d": [True]}]}
    assert dumps(state) == json.dumps(state, indent=4)
    assert loads(json.dumps(state)) == state


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"a": [1, object()]}, r"state\['a'\]\[1\] is a builtins.object"),
        ({"s": {1, 2}}, r"state\['s'\] is a builtins.set"),
        ({"o": np.array([None])}, r"state\['o'\] is a NumPy array of Python objects"),
    ],
)
def test_unsupported_values_are_named(state, where) -> None:
    with pytest.raises(StateEncodingError, match=where):
        dumps(state)


@pytest.mark.parametrize(
    "text",
    [
        "{oops",
        '{"__checkpointables__": "bytes", "base64": "###"}',
        '{"__checkpointables__": "float", "value": "1e400"}',
        '{"__checkpointables__": "ndarray", "dtype": "O", "shape": [1], "base64": ""}',
        '{"__checkpointables__": "tuple"}',
    ],
)
def test_malformed_text_is_refused(text) -> None:
    with pytest.raises(StateDecodingError):
        loads(text)


def test_unknown_tag_asks_for_an_upgrade() -> None:
    with pytest.raises(StateDecodingError, match="Upgrade checkpointables-grain"):
        loads('{"a": {"__checkpointables__": "from-the-future"}}')


class RichStateIterator(grain.DatasetIterator):
    """A user-written iterator whose state holds bytes, tuples and NumPy values."""

    def __init__(self, extra=None) -> None:
        super().__init__()
        self.position = 0
        self.extra = extra
        self.restored = None

    def __next__(self) -> int:
        self.position += 1
        return self.position * 10

    def get_state(self):
        return {**RICH_STATE, "position": np.int64(self.position), "extra": self.extra}

    def set_state(self, state) -> None:
        self.restored = state
        self.position = int(state["position"])


def test_custom_iterator_with_rich_state_resumes(tmp_path) -> None:
    it = RichStateIterator()
    [next(it) for _ in range(4)]
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    _strict_json((tmp_path / "c" / "dataset" / "process_0-of-1.json").read_text())
    fresh = RichStateIterator()
    cp.load_checkpointables(tmp_path / "c", {"dataset": fresh})
    assert _same(fresh.restored, it.get_state())
    assert next(fresh) == next(it) == 50


def test_unsupported_state_fails_before_anything_is_written(tmp_path) -> None:
    it = RichStateIterator(extra=object())
    with pytest.raises(UnsupportedStateError, match=r"'dataset'.*state\['extra'\]"):
        cp.save_checkpointables(tmp_path / "c", {"x": {"a": 1}, "dataset": it})
    assert os.listdir(tmp_path) == []
