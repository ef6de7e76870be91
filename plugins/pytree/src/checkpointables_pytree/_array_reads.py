"""What a load asks of one stored array, and how the bytes read become its leaf.

An ``ArrayRead`` names the array, what ``_METADATA`` recorded of it, the
shape and regions the caller wants, and ``convert``, which turns the regions
read into the leaf. Conversions that can do many arrays in one call (one
``jax.device_put`` for many arrays costs a third of as many calls) say so
with ``convert_many``; ``convert_all`` groups them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import checkpointables as cp
import numpy as np

from checkpointables_pytree import _zarr3

__all__ = [
    "ArrayRead",
    "BatchConvert",
    "Region",
    "StoredArray",
    "check_shape",
    "convert_all",
    "cut",
    "intersect",
    "pieces_of",
    "region_shape",
    "regions_of",
]


@dataclasses.dataclass(slots=True)  # Not frozen: a frozen class is made twice as slowly.
class StoredArray:
    """What ``_METADATA`` recorded about an array this library wrote.

    ``direct`` means: uncompressed, one inner chunk per shard, so its shards
    can be read as values and checked (zarr3's CRC-32C) without the zarr3
    driver. ``nbytes`` (bytes of the whole array), ``chunk_nbytes`` and
    ``single_chunk`` are derived when it is made: loads of many small arrays
    consult them several times per array. Treat it as immutable.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    direct: bool
    nbytes: int = dataclasses.field(init=False, compare=False)
    chunk_nbytes: int = dataclasses.field(init=False, compare=False)
    single_chunk: bool = dataclasses.field(init=False, compare=False)
    _chunk_indices: list[tuple[int, ...]] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.single_chunk = self.chunk_shape == self.shape
        self.chunk_nbytes = (
            self.nbytes if self.single_chunk else math.prod(self.chunk_shape) * self.dtype.itemsize
        )

    @property
    def chunk_indices(self) -> list[tuple[int, ...]]:
        """Every chunk index, in C order (computed once: reads ask for them several times)."""
        if self._chunk_indices is None:
            self._chunk_indices = _zarr3.all_chunk_indices(self.shape, self.chunk_shape)
        return self._chunk_indices


Region = tuple[slice, ...]


@dataclasses.dataclass
class ArrayRead:
    """One array to read.

    Attributes:
      label: names the leaf in errors: a string, or an object with a ``keystr``
        (computed only when an error needs it).
      name: the array's name in the database.
      stored: its recorded layout, or ``None`` (then the driver reads its ``zarr.json``).
      target_shape: the shape the caller wants (``None``: as stored). A
        different shape raises, unless ``allow_resize`` (zero padding or truncation).
      regions: the parts of the target to return (``None``: all of it).
      convert: turns the list of region arrays into the leaf, once its batch
        (a load's small arrays, or a group of large ones) is read, so that at
        most a few batches are held twice at once.
    """

    label: Any
    name: str
    stored: StoredArray | None
    convert: Callable[[list[np.ndarray]], Any]
    target_shape: tuple[int, ...] | None = None
    regions: list[Region] | None = None
    allow_resize: bool = False
    result: Any = None
    _whole: bool | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def what(self) -> str:
        """How errors name the leaf (``label`` is a string, or has a ``keystr``)."""
        return self.label if isinstance(self.label, str) else self.label.keystr

    @functools.cached_property
    def reads_part(self) -> bool:
        """Whether the regions asked for cover only part of the stored array.

        Then the zarr3 driver reads just the chunks they touch (in a multi-process
        load each process reads only what its devices need) instead of the
        whole array being read here.
        """
        stored = self.stored
        if self.regions is None or stored is None:
            return False
        covered = 0
        for region in self.regions:
            parts = intersect(region, stored.shape)
            if parts is not None:
                covered += math.prod(region_shape(parts[0]))
        return covered < math.prod(stored.shape)

    @property
    def whole(self) -> bool:
        """Whether its shards are read as values and checked here (else by the zarr3 driver).

        Decided once, when added: arrays whose layout this library recorded,
        stored uncompressed with one inner chunk per shard, of which more than
        a small part is wanted.
        """
        if self._whole is None:
            stored = self.stored
            self._whole = bool(stored is not None and stored.direct and not self.reads_part)
        return self._whole


def check_shape(read: ArrayRead, stored_shape: tuple[int, ...]) -> tuple[int, ...]:
    target = read.target_shape if read.target_shape is not None else stored_shape
    if tuple(target) != tuple(stored_shape) and (
        len(target) != len(stored_shape) or not read.allow_resize
    ):
        raise cp.errors.TreeMismatchError(
            f"{read.what}: the abstract tree asks for shape {tuple(target)}, but the checkpoint "
            f"stores shape {tuple(stored_shape)}. Pass the stored shape, or allow zero padding "
            f"and truncation with cp.options.ArrayOptions(enable_padding_and_truncation=True)."
        )
    return tuple(target)


def intersect(region: Region, shape: tuple[int, ...]) -> tuple[Region, Region] | None:
    """The part of ``region`` inside ``shape``: (source slices, destination slices)."""
    source, destination = [], []
    for r, size in zip(region, shape, strict=True):
        start, stop = r.start or 0, r.stop
        hi = min(stop, size)
        if hi <= start:
            return None
        source.append(slice(start, hi))
        destination.append(slice(0, hi - start))
    return tuple(source), tuple(destination)


def regions_of(read: ArrayRead, target: tuple[int, ...]) -> list[Region]:
    if read.regions is not None:
        return read.regions
    return [tuple(slice(0, s) for s in target)]


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple((r.stop or 0) - (r.start or 0) for r in region)


def cut(full: np.ndarray, region: Region, stored_shape: tuple[int, ...]) -> np.ndarray:
    """Region of the target, taken from the whole stored array (zero-padded beyond it)."""
    if all(r.start in (0, None) and r.stop == s for r, s in zip(region, stored_shape, strict=True)):
        return full
    out = np.zeros(region_shape(region), dtype=full.dtype)
    parts = intersect(region, stored_shape)
    if parts is not None:
        source, destination = parts
        out[destination] = full[source]
    return out


def pieces_of(read: ArrayRead, array: np.ndarray) -> list[np.ndarray]:
    """The regions ``read`` asks for, from the whole stored ``array``."""
    stored = read.stored
    assert stored is not None
    if read.regions is None and read.target_shape in (None, stored.shape):
        return [array]
    target = check_shape(read, stored.shape)
    return [cut(array, r, stored.shape) for r in regions_of(read, target)]


class BatchConvert(Protocol):
    """A conversion that can also convert many reads in one call.

    ``convert_many`` must be the same function for every instance (a
    ``staticmethod``): reads whose conversions share it are converted together.
    """

    def __call__(self, pieces: list[np.ndarray]) -> Any:
        """The leaf of one read."""

    @staticmethod
    def convert_many(converts: Sequence[Any], pieces: Sequence[list[np.ndarray]]) -> list[Any]:
        """The leaves of many reads: ``converts[i]`` applied to ``pieces[i]``."""


def convert_all(done: Sequence[tuple[ArrayRead, list[np.ndarray]]]) -> None:
    """Sets each read's ``result`` from its pieces, batching what can be batched.

    Example::

        convert_all([(read, [array]) for read, array in finished])
    """
    batches: dict[Any, list[tuple[ArrayRead, list[np.ndarray]]]] = collections.defaultdict(list)
    for read, pieces in done:
        many = _convert_many_of(type(read.convert))
        if many is None:
            read.result = read.convert(pieces)
        else:
            batches[many].append((read, pieces))
    for many, items in batches.items():
        if len(items) == 1:
            read, pieces = items[0]
            read.result = read.convert(pieces)
            continue
        results = many([read.convert for read, _ in items], [pieces for _, pieces in items])
        for (read, _), result in zip(items, results, strict=True):
            read.result = result


@functools.cache
def _convert_many_of(kind: type) -> Any:
    """The ``convert_many`` of a conversion's class, or ``None`` (looked up once per class:
    ``convert_all`` runs per leaf, and most conversions are plain functions)."""
    return getattr(kind, "convert_many", None)
