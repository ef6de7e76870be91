"""Turning the bytes read into leaves (``_array_reads``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from checkpointables_pytree.io import ArrayRead, StoredArray, convert_all, pieces_of

_batches: list[int] = []


class _Scaled:
    """A batchable conversion that records the size of each batch it is given."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __call__(self, pieces: list[np.ndarray]) -> Any:
        _batches.append(1)
        return pieces[0] * self.factor

    @staticmethod
    def convert_many(converts: Sequence[Any], pieces: Sequence[list[np.ndarray]]) -> list[Any]:
        _batches.append(len(converts))
        return [p[0] * c.factor for c, p in zip(converts, pieces, strict=True)]


def _read(name: str, convert: Any, shape: tuple[int, ...] = (4,)) -> ArrayRead:
    stored = StoredArray(shape, np.dtype(np.int64), shape, direct=True)
    return ArrayRead(label=name, name=name, stored=stored, convert=convert)


def test_reads_sharing_a_batch_conversion_are_converted_in_one_call() -> None:
    _batches.clear()
    reads = [_read("a", _Scaled(2)), _read("b", lambda p: -p[0]), _read("c", _Scaled(3))]
    convert_all([(r, [np.arange(4)]) for r in reads])
    assert _batches == [2]
    np.testing.assert_array_equal(reads[0].result, np.arange(4) * 2)
    np.testing.assert_array_equal(reads[1].result, -np.arange(4))
    np.testing.assert_array_equal(reads[2].result, np.arange(4) * 3)


def test_a_lone_batch_conversion_is_called_as_is() -> None:
    _batches.clear()
    read = _read("a", _Scaled(5))
    convert_all([(read, [np.ones(4, np.int64)])])
    assert _batches == [1]
    np.testing.assert_array_equal(read.result, np.full(4, 5))


def test_pieces_are_the_regions_asked_for_zero_padded() -> None:
    stored = StoredArray((4,), np.dtype(np.int64), (4,), direct=True)
    read = ArrayRead(
        label="a",
        name="a",
        stored=stored,
        convert=lambda p: p,
        target_shape=(6,),
        regions=[(slice(0, 3),), (slice(3, 6),)],
        allow_resize=True,
    )
    first, second = pieces_of(read, np.arange(4))
    np.testing.assert_array_equal(first, [0, 1, 2])
    np.testing.assert_array_equal(second, [3, 0, 0])
