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
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp


def _strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray | np.generic):
        # Bytes: NaN and NaT equal themselves. dtype == ignores alignment; the flag does not.
        return (
            a.dtype == b.dtype
            and a.dtype.descr == b.dtype.descr
            and a.dtype.isalignedstruct == b.dtype.isalignedstruct
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
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
    "text": np.str_("np"),
    "raw": np.bytes_(b"np"),
    "records": np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
    "record": np.array([(3, [4, 5])], dtype=[("a", ">u2"), ("b", "<i1", (2,))])[0],
    "aligned": np.zeros(2, dtype=np.dtype([("a", "i1"), ("b", [("c", "<f4")])], align=True)),
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


_UNION = np.dtype((np.int32, {"lo": (np.uint16, 0), "hi": (np.uint16, 2)}))


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"a": [1, object()]}, r"state\['a'\]\[1\] is a builtins.object"),
        ({"s": {1, 2}}, r"state\['s'\] is a builtins.set"),
        ({"o": np.array([None])}, r"state\['o'\] is a NumPy array of Python objects"),
        (
            {"r": np.zeros(1, dtype=[("a", "O")])},
            r"state\['r'\] is a NumPy array of Python objects",
        ),
        ({"n": [10**5000]}, r"state\['n'\]\[0\] is an integer of 16,610 bits, more than"),
        # Named fields over an int (it came back a record of other values), as a field too.
        ({"u": np.zeros(2, _UNION)}, r"state\['u'\] has dtype .* over a 'i'-kind base"),
        ({"u": np.zeros(1, [("f", _UNION)])}, r"state\['u'\] has dtype .* over a 'i'-kind"),
        # Records of no bytes (they could not be read back).
        ({"z": np.zeros(2, [])}, r"state\['z'\] has dtype .* of records holding no bytes"),
        ({-(10**4300): 1}, r"state key <an integer of 14,285 bits> is an integer of 14,285 bits"),
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
        # Structured dtypes: only what a save writes, exactly; nothing NumPy would build.
        '{"__checkpointables__": "ndarray", "dtype": {"names": ["a"], "formats": ["O"], '
        '"offsets": [0], "itemsize": 8}, "shape": [0], "base64": ""}',
        '{"__checkpointables__": "ndarray", "dtype": {"names": ["a"], "formats": ["<i4"], '
        '"offsets": [0], "itemsize": 4, "evil": 1}, "shape": [0], "base64": ""}',
        '{"__checkpointables__": "ndarray", "dtype": {"names": ["a"], "formats": ["<i4"]}, '
        '"shape": [0], "base64": ""}',
        '{"__checkpointables__": "ndarray", "dtype": {"base": "<i4", "shape": [-1]}, '
        '"shape": [0], "base64": ""}',
        '{"__checkpointables__": "ndarray", "dtype": ["<i4"], "shape": [0], "base64": ""}',
        '{"__checkpointables__": "ndarray", "dtype": '
        + '{"names": ["a"], "offsets": [0], "itemsize": 4, "formats": [' * 300
        + '"<i4"'
        + "]}" * 300
        + ', "shape": [0], "base64": ""}',
    ],
)
def test_malformed_text_is_refused(text) -> None:
    with pytest.raises(StateDecodingError):
        loads(text)


def _no_objects(dtype: np.dtype) -> bool:
    return not dtype.hasobject


@settings(max_examples=25, deadline=None)
@given(
    hnp.arrays(
        hnp.nested_dtypes(
            subtype_strategy=hnp.scalar_dtypes().filter(_no_objects), max_itemsize=64
        ).filter(_no_objects),
        hnp.array_shapes(min_dims=0, max_dims=2, max_side=3),
    )
)
def test_any_numpy_array_or_scalar_round_trips(array: np.ndarray) -> None:
    state = {"array": array, "scalar": array.reshape(-1)[0] if array.size else array[()]}
    assert _same(loads(dumps(state)), state)


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


def test_too_long_integer_is_refused_with_where(tmp_path) -> None:
    it = RichStateIterator(extra={"seed": 10**5000})
    with pytest.raises(UnsupportedStateError, match=r"state\['extra'\]\['seed'\].*digits"):
        cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    assert os.listdir(tmp_path) == []
