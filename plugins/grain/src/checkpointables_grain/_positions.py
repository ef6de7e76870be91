"""Which values in an iterator state are positions, and what a position may be.

Grain's ``set_state`` methods store what they are given and check little
else: a mix ``index`` of ``NaN`` or ``true`` loads, and the iterator then
yields other elements than the saved one would; ``2**64`` or ``None`` load,
and the first ``next()`` fails with a bare ``IndexError`` or ``TypeError``.
Every count and position Grain writes is a JSON integer from 0 to 2**63 - 1
(Grain indexes with them, and NumPy and the C API take no larger index), so
anything else where one belongs is damage, refused before ``set_state``.

Custom iterators may keep any JSON-able value in their states (floats,
strings, arrays), so the rule is not "every number": it covers the fields of
Grain's own iterator states, found by their names. ``next_index`` and the
other distinctive names are positions wherever they appear; a generic name
(``index``, ``epoch``, ``counter``) only in a dict that has the shape of the
Grain iterator state that holds it (all of that state's keys), and only for a
shape that is Grain's own: one with a key outside ``GENERIC_KEYS`` or with 3
keys or more. A shape of one or two generic keys (repeat's ``{parent,
epoch}``, map_with_index's ``{parent, counter}``, TFRecord's
``{reader_offset}``) is what a custom iterator's state may well be, and is not
checked (its ``parent`` still is, wherever it nests Grain's states).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

from checkpointables_grain._grain_types import DATA_LOADER_ITERATOR

__all__ = ["Problem", "bad_position", "expected"]

# One past the largest position: Grain's positions index Python sequences and NumPy
# arrays, which take no index of 64 bits or more.
POSITION_LIMIT = 2**63

# What a field holds: a position (an integer from 0), a list of positions, a bool, a
# list of 0/1 flags (bools accepted: they mean the same there), or any state (None).
Kind = Literal["position", "positions", "flag", "flags"] | None

# Positions wherever they appear (a pipeline nests its parents' states at any depth).
_POSITIONS_ANYWHERE = frozenset(
    {"next_index", "global_next_index", "next_index_in_cycle", "next_index_in_datasets"}
)

# The states of Grain's own dataset iterators (grain 0.2.x), by their keys. A dict of
# the state holding all of one's keys is checked against it.
_GRAIN_STATES: tuple[dict[str, Kind], ...] = (
    {"parents": None, "index": "position", "stop": "flag"},  # mix
    {"parent_window_start_state": None, "window_index": "position", "pos_in_window": "position"},
    {
        "next_index_in_cycle": "position",  # interleave
        "next_index_in_datasets": "position",
        "iterators_in_use_indices": "positions",
        "iterators_in_use_states": None,
        "exhausted": "flags",
    },
    {"parent": None, "epoch": "position"},  # repeat
    {"parent": None, "next_index_in_buffer": "position"},  # flat_map
    {"parent": None, "next_row": "position", "counter": "position"},  # packing
    {"parent": None, "counter": "position"},  # map_with_index
    {"parent": None, "batch_idx": "position"},  # rebatch
    {"parent": None, "count_elements_read": "position"},  # limit
    {"parent": None, "position": "position", "cache_filled": "flag"},  # cache
    {"parent": None, "index_for_rng": "position"},  # random_map
    {"parent_state": None, "elements_from_buffer_after_checkpoint": "position"},  # packing
    {"reader_offset": "position"},  # TFRecord source
    {"row_group": "position", "index_within_row_group": "position"},  # Parquet source
)

# The positions at the top of a DataLoader iterator's state, and the least value of each;
# its ``last_seen_indices`` values are integers of any sign (-1 and below before a
# worker's first element).
_LOADER_POSITIONS: dict[str, int] = {"last_worker_index": -1, "worker_count": 0}

# Keys a custom iterator's state may well use for anything: a shape of Grain's made only of
# these claims a dict of a custom state only with 3 keys or more (mix, packing, cache).
GENERIC_KEYS = frozenset(
    {"parent", "parents", "parent_state", "index", "stop", "epoch", "counter", "position"}
    | {"reader_offset"}  # A file offset: what a custom reader's state would call it too.
)
_LEAST_GENERIC_KEYS = 3

# The shapes checked: Grain's own, less those a custom state may have.
_CHECKED_STATES = tuple(
    shape
    for shape in _GRAIN_STATES
    if len(shape) >= _LEAST_GENERIC_KEYS or not GENERIC_KEYS.issuperset(shape)
)

# Where in the state, the value found there, and what it should be.
Problem = tuple[str, Any, str]


def bad_position(state: Any, kind: str) -> Problem | None:
    """The first field of ``state`` (an iterator of ``kind``'s) that is no position."""
    if kind == DATA_LOADER_ITERATOR:
        return _bad_loader_position(state)
    pending: list[tuple[Any, str]] = [(state, "state")]
    while pending:  # No recursion: a hostile state may nest deeper than the stack.
        value, where = pending.pop()
        if isinstance(value, dict):
            found = _bad_field(value, where)
            if found is not None:
                return found
            pending.extend((item, f"{where}[{key!r}]") for key, item in value.items())
        elif isinstance(value, list | tuple):
            pending.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return None


def _fields(state: dict[Any, Any]) -> Iterable[tuple[str, Kind]]:
    """The checked fields of one dict of a state, with what each holds."""
    for key in _POSITIONS_ANYWHERE.intersection(state):
        yield key, "position"
    for shape in _CHECKED_STATES:
        if all(key in state for key in shape):
            yield from shape.items()


def _bad_field(state: dict[Any, Any], where: str) -> Problem | None:
    for key, field_kind in _fields(state):
        value = state[key]
        if not _holds(value, field_kind):
            return f"{where}[{key!r}]", value, expected(field_kind)
    return None


def _holds(value: Any, kind: Kind) -> bool:
    if kind == "position":
        return is_position(value, 0)
    if kind == "flag":
        return isinstance(value, bool | np.bool_)
    if kind == "positions":
        return isinstance(value, list | tuple) and all(is_position(v, 0) for v in value)
    if kind == "flags":
        return isinstance(value, list | tuple) and all(_is_flag(v) for v in value)
    return True


def _is_flag(value: Any) -> bool:
    """0 or 1 (Grain writes ints "for Pathways"), or a bool, which means the same there."""
    return isinstance(value, bool | np.bool_) or (is_position(value, 0) and value <= 1)


def _bad_loader_position(state: Any) -> Problem | None:
    if not isinstance(state, dict):
        return None  # Grain's set_state refuses it.
    for key, least in _LOADER_POSITIONS.items():
        if key in state and not is_position(state[key], least):
            return f"state[{key!r}]", state[key], _position_kind(least)
    seen = state.get("last_seen_indices")
    for worker, index in seen.items() if isinstance(seen, dict) else ():
        if not is_position(index, 1 - POSITION_LIMIT):
            return f"state['last_seen_indices'][{worker!r}]", index, _position_kind(None)
    return None


def is_position(value: Any, least: int) -> bool:
    """Whether ``value`` is an integer (Python or NumPy scalar, not a bool) of at least
    ``least`` and below 2**63. Not an array, even a 0-d integer one: Grain adds to it in
    place, and the restored iterator skips elements. Nor ``None``, a string or a list:
    Grain's ``set_state`` takes them, and the first ``next()`` fails."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        return False
    return bool(least <= value < POSITION_LIMIT)


def expected(kind: Kind) -> str:
    """What a field of ``kind`` must be, for an error message."""
    if kind == "flag":
        return "true or false"
    if kind == "flags":
        return "a list of 0s and 1s"
    if kind == "positions":
        return "a list of non-negative integers below 2**63"
    return _position_kind(0)


def _position_kind(least: int | None) -> str:
    if least is None:
        return "an integer above -2**63 and below 2**63"
    if least == 0:
        return "a non-negative integer below 2**63"
    return f"an integer of at least {least} and below 2**63"
