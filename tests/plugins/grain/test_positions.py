"""Positions in Grain's own iterator states: every state a real pipeline writes loads and
resumes exactly; a forged one (mix index NaN, interleave cycle index 2**64, window
position true, None where a count belongs) is an IntegrityError naming the file and the
key path, not a load that yields other data or a bare IndexError at the first next()."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import checkpointables as cp
import checkpointables_grain
import grain
import grain.experimental as gx
import numpy as np
import pytest
from checkpointables_grain import _positions, _state_json

from ...metadata_edits import with_metadata_checksums_recomputed
from .pipelines import data_loader, take

R = grain.MapDataset.range


def _iter(start: int, stop: int) -> grain.IterDataset:
    return R(start, stop).to_iter_dataset()


def _mix() -> grain.IterDataset:
    return grain.IterDataset.mix([_iter(0, 30), _iter(30, 60)], [0.5, 0.5])


def _interleave() -> grain.IterDataset:
    parts = [_iter(0, 3), _iter(10, 14), _iter(20, 22), _iter(30, 35)]
    return gx.InterleaveIterDataset(parts, cycle_length=2)


def _window_shuffle() -> grain.IterDataset:
    return gx.WindowShuffleIterDataset(_iter(0, 40), window_size=7, seed=1)


class _Twice(gx.FlatMapTransform):
    max_fan_out = 2

    def flat_map(self, element: int) -> list[int]:
        return [element, element + 100]


def _sequences() -> grain.IterDataset:
    ds = R(20).map(lambda i: {"x": np.arange(i % 5 + 1, dtype=np.int32)})
    return ds.to_iter_dataset()


def _add_rng(x: int, rng: np.random.Generator) -> int:
    return x + int(rng.integers(1000))


# Pipelines whose iterators' states hold every field of Grain's own states that
# _positions checks (mix, window shuffle, interleave, repeat, flat_map, packing, ...).
PIPELINES: dict[str, Callable[[], Any]] = {
    "mix": _mix,
    "map_mix": lambda: grain.MapDataset.mix([R(10), R(10, 20)], [0.5, 0.5]),
    "interleave": _interleave,
    "window_shuffle": _window_shuffle,
    "shuffle_batch": lambda: R(50).shuffle(seed=3).to_iter_dataset().batch(4),
    "repeat": lambda: gx.RepeatIterDataset(_iter(0, 5), num_epochs=3),
    "limit": lambda: gx.LimitIterDataset(_iter(0, 20), count=10),
    "flat_map": lambda: gx.FlatMapIterDataset(_iter(0, 10), _Twice()),
    "rebatch": lambda: gx.RebatchIterDataset(_iter(0, 30).batch(4), batch_size=3),
    "zip": lambda: gx.ZipIterDataset([_iter(0, 10), _iter(10, 20)]),
    "elastic": lambda: gx.ElasticIterator(
        R(40), global_batch_size=4, shard_options=grain.sharding.NoSharding()
    ),
    "thread_prefetch": lambda: gx.ThreadPrefetchIterDataset(_iter(0, 20), prefetch_buffer_size=3),
    "read_threads": lambda: R(20).to_iter_dataset(grain.ReadOptions(num_threads=2)),
    "random_map": lambda: _iter(0, 20).random_map(_add_rng, seed=3),
    "map_with_index": lambda: _iter(0, 20).map_with_index(lambda i, x: i * 1000 + x),
    "filter": lambda: _iter(0, 20).filter(lambda x: x % 3 != 0),
    "first_fit": lambda: gx.FirstFitPackIterDataset(
        _sequences(), length_struct={"x": 8}, num_packing_bins=2
    ),
    "concat_then_split": lambda: gx.ConcatThenSplitIterDataset(
        _sequences(), length_struct={"x": 4}
    ),
    "mix_of_interleave": lambda: grain.IterDataset.mix(
        [_interleave(), _window_shuffle()], [0.3, 0.7]
    ).batch(2),
    "data_loader": data_loader,
}


def _plain(element: Any) -> Any:
    """An element as plain lists and dicts, for comparison (packing yields dicts of arrays)."""
    if isinstance(element, dict):
        return {k: _plain(v) for k, v in element.items()}
    return np.asarray(element).tolist()


def _take(iterator: Any, n: int) -> list[Any]:
    return [_plain(next(iterator)) for _ in range(n)]


def _all(pipeline: Callable[[], Any]) -> list[Any]:
    return [_plain(element) for element in iter(pipeline())]


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_state_of_a_real_pipeline_has_whole_positions(name) -> None:
    # The rule refuses no state Grain writes: at every step, from the first to exhaustion.
    it = iter(PIPELINES[name]())
    kind = "DataLoaderIterator" if name == "data_loader" else "DatasetIterator"
    while True:
        state = it.get_state()
        state = json.loads(state) if isinstance(state, bytes) else state
        assert _positions.bad_position(state, kind) is None, state
        if next(it, None) is None:
            break


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_real_pipeline_saved_anywhere_resumes_exactly(tmp_path, name) -> None:
    pipeline = PIPELINES[name]
    everything = _all(pipeline)
    for steps in sorted({0, 1, 3, len(everything) // 2, len(everything)}):
        it = iter(pipeline())
        _take(it, steps)
        cp.save_checkpointables(tmp_path / str(steps), {"dataset": it})
        restored = cp.load_checkpointables(tmp_path / str(steps), {"dataset": pipeline()})
        rest = restored["dataset"]
        assert _take(rest, len(everything) - steps) == everything[steps:], steps


def _saved_mix(tmp_path):
    it = iter(_mix())
    take(it, 2)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    return tmp_path / "c"


def _forge(checkpoint, edit: Callable[[dict[str, Any]], None]) -> None:
    file = checkpoint / "dataset" / "process_0-of-1.json"
    state = _state_json.loads(file.read_text())
    edit(state)
    file.write_text(_state_json.dumps(state))
    with_metadata_checksums_recomputed(checkpoint)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value

    return edit


def test_the_attackers_mix_state_resumes_when_whole(tmp_path) -> None:
    # The attacker's baseline: forged consistently, with a whole index, it is a real state.
    checkpoint = _saved_mix(tmp_path)
    state = {"parents": [{"next_index": 1}, {"next_index": 1}], "index": 2, "stop": False}
    _forge(checkpoint, lambda s: s.update(state))
    restored = cp.load_checkpointables(checkpoint, {"dataset": _mix()})["dataset"]
    assert take(restored, 3) == [1, 31, 2]


NOT_POSITIONS = [
    float("nan"), 1.5, 8.0, True, False, -5, -1, None, "x", "2", [1], [], {}, {"a": 1},
    2**63, 2**64 + 1, 10**29, np.float64(2.0), np.bool_(True), np.array(2),
]  # fmt: skip


def _refused(checkpoint, abstract: Any, where: str) -> None:
    with pytest.raises(cp.errors.IntegrityError) as e:
        cp.load_checkpointables(checkpoint, {"dataset": abstract})
    message = str(e.value)
    assert str(checkpoint / "dataset" / "process_0-of-1.json") in message
    assert f"{where} = " in message and "damaged" in message


@pytest.mark.parametrize("value", NOT_POSITIONS, ids=repr)
def test_a_mix_index_that_is_no_position_is_refused_at_load(tmp_path, value) -> None:
    # It loaded, and the mix yielded [1, 2, 3] or [31, 1, 32] instead of [1, 31, 2], or
    # failed at the first next() with a bare TypeError or IndexError.
    checkpoint = _saved_mix(tmp_path)
    _forge(checkpoint, _set(("index",), value))
    _refused(checkpoint, _mix(), "state['index']")


def _saved(tmp_path, pipeline: Callable[[], Any], steps: int):
    it = iter(pipeline())
    take(it, steps)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    return tmp_path / "c"


FORGED = [
    ("interleave", ("next_index_in_cycle",), 2**63),
    ("interleave", ("next_index_in_cycle",), 2**64 + 1),
    ("interleave", ("next_index_in_cycle",), 10**29),
    ("interleave", ("next_index_in_cycle",), None),
    ("interleave", ("next_index_in_cycle",), "x"),
    ("interleave", ("next_index_in_cycle",), []),
    ("interleave", ("next_index_in_cycle",), {}),
    ("interleave", ("iterators_in_use_indices",), [-1, 1]),
    ("interleave", ("iterators_in_use_indices",), None),
    ("interleave", ("exhausted",), [5, 0]),
    ("window_shuffle", ("pos_in_window",), -1),
    ("window_shuffle", ("pos_in_window",), True),
    ("window_shuffle", ("window_index",), True),
    ("window_shuffle", ("window_index",), 2.0),
    ("mix", ("stop",), "x"),
    ("mix", ("parents", 0, "next_index"), None),
    ("limit", ("count_elements_read",), 1.5),
    ("flat_map", ("next_index_in_buffer",), None),
    ("rebatch", ("batch_idx",), True),
    ("random_map", ("index_for_rng",), float("nan")),
    ("first_fit", ("counter",), "3"),
    ("concat_then_split", ("elements_from_buffer_after_checkpoint",), -2),
    ("elastic", ("global_next_index",), 2**63),
]


@pytest.mark.parametrize(("name", "path", "value"), FORGED, ids=repr)
def test_a_forged_field_of_a_grain_state_is_refused_at_load(tmp_path, name, path, value) -> None:
    checkpoint = _saved(tmp_path, PIPELINES[name], 3)
    _forge(checkpoint, _set(path, value))
    where = "state" + "".join(f"[{key!r}]" for key in path[:-1])
    _refused(checkpoint, PIPELINES[name](), f"{where}[{path[-1]!r}]")


@pytest.mark.parametrize("value", [2**63, -(2**63), 10**29])
def test_a_data_loader_index_beyond_64_bits_is_refused_at_load(tmp_path, value) -> None:
    checkpoint = _saved(tmp_path, data_loader, 1)
    file = checkpoint / "dataset" / "process_0-of-1.json"
    state = json.loads(file.read_text())
    state["last_seen_indices"]["0"] = value
    file.write_text(json.dumps(state))
    with_metadata_checksums_recomputed(checkpoint)
    _refused(checkpoint, data_loader(), "state['last_seen_indices']['0']")


class _CustomIterator(grain.DatasetIterator):
    """A user's iterator whose state borrows Grain's generic names for other things."""

    def __init__(self) -> None:
        super().__init__()
        self.state: Any = None

    def __next__(self) -> int:
        raise StopIteration

    def get_state(self) -> Any:
        return self.state

    def set_state(self, state: Any) -> None:
        self.state = state


def test_a_custom_state_is_only_checked_where_it_has_the_shape_of_grains(tmp_path) -> None:
    # "index" is a position in Grain's mix state ({"parents", "index", "stop"}) and "epoch"
    # in its repeat state ({"parent", "epoch"}); in a dict of neither shape they are
    # whatever the user keeps there, and round-trip.
    it = _CustomIterator()
    it.state = {"parents": 1, "epoch": 0.5, "index": None, "counter": "c", "n": [-1.5]}
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    restored = cp.load_checkpointables(tmp_path / "c", {"dataset": _CustomIterator()})
    assert restored["dataset"].state == it.state


# States of custom iterators that hold all the keys of a Grain state of one or two generic
# keys (repeat, map_with_index, TFRecord): such shapes are not claimed as Grain's.
CUSTOM_STATES = [
    {"parent": {"next_index": 3}, "epoch": 0.7},
    {"parent": [1, "x"], "counter": -2.5},
    {"reader_offset": "page-7"},
    {"parent": None, "epoch": None, "counter": [0.5], "reader_offset": {"a": -1}},
]


@pytest.mark.parametrize("state", CUSTOM_STATES, ids=repr)
def test_a_custom_state_of_a_small_generic_shape_saves_and_loads_exactly(tmp_path, state) -> None:
    it = _CustomIterator()
    it.state = state
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    restored = cp.load_checkpointables(tmp_path / "c", {"dataset": _CustomIterator()})
    assert restored["dataset"].state == state


def test_a_custom_state_of_a_larger_generic_shape_is_still_checked(tmp_path) -> None:
    # Three generic keys ({parents, index, stop}: mix's state) are claimed as Grain's; so
    # is a nested parent's next_index, a distinctive name, under a small generic shape.
    for state, where in [
        ({"parents": [], "index": 0.5, "stop": False}, "state['index']"),
        ({"parent": {"next_index": -1}, "epoch": 0.7}, "state['parent']['next_index']"),
    ]:
        it = _CustomIterator()
        it.state = state
        with pytest.raises(checkpointables_grain.UnsupportedStateError, match=re.escape(where)):
            cp.save_checkpointables(tmp_path / "c", {"dataset": it})
