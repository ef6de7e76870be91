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
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import checkpointables as cp
import numpy as np
import tensorstore as ts

from checkpointables_pytree import storage, zarr3
from checkpointables_pytree.storage import aligned_empty

__all__ = [
    "ArrayRead",
    "BatchConvert",
    "OpenedArray",
    "open_stored",
    "assemble",
    "check_against_metadata",
    "check_fits_in_memory",
    "physical_memory_bytes",
    "read_region",
    "tiling_box",
    "within",
    "Region",
    "StoredArray",
    "check_shape",
    "chunk_keys",
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
            self._chunk_indices = zarr3.all_chunk_indices(self.shape, self.chunk_shape)
        return self._chunk_indices


Region = tuple[slice, ...]


@dataclasses.dataclass(slots=True)  # Thousands per load: slots make them faster.
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
      sink: under a host-memory budget, makes the ``PieceSink`` that takes the
        array piece by piece (``_streamed_reads``) from the regions and the
        stored dtype; ``None``: read whole (scalars, strings, small arrays).
    """

    label: Any
    name: str
    stored: StoredArray | None
    convert: Callable[[list[np.ndarray]], Any]
    target_shape: tuple[int, ...] | None = None
    regions: list[Region] | None = None
    allow_resize: bool = False
    sink: Any = None
    result: Any = None
    _whole: bool | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # Set by whoever knows them already (a load's session keeps them per _METADATA text).
    keys: tuple[bytes, ...] | None = dataclasses.field(default=None, init=False, compare=False)

    @property
    def what(self) -> str:
        """How errors name the leaf (``label`` is a string, or has a ``keystr``)."""
        return self.label if isinstance(self.label, str) else self.label.keystr

    @property
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
            self._whole = bool(
                stored is not None
                and stored.direct
                and (self.regions is None or not self.reads_part)
            )
        return self._whole

    @property
    def chunk_keys(self) -> tuple[bytes, ...]:
        """The database keys of its recorded shards, in C order (``()`` if not recorded)."""
        if self.keys is None:
            self.keys = chunk_keys(self.name, self.stored)
        return self.keys


def chunk_keys(name: str, stored: StoredArray | None) -> tuple[bytes, ...]:
    """The database keys of the shards of array ``name`` (``()`` if its layout is unknown)."""
    if stored is None:
        return ()
    if stored.single_chunk:
        return (zarr3.chunk_key(name, (0,) * len(stored.shape)).encode(),)
    return tuple(zarr3.chunk_key(name, i).encode() for i in stored.chunk_indices)


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
    if read.regions is None and (read.target_shape is None or read.target_shape == stored.shape):
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
        kind: type = type(read.convert)  # Typed: mypy finds no hash on type[Callable].
        many = _convert_many_of(kind)
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


async def read_region(
    read: ArrayRead, store: Any, region: Region, stored_shape: tuple[int, ...]
) -> np.ndarray:
    """``region`` of the stored array (zeros beyond its bounds)."""
    dtype = store.dtype.numpy_dtype
    parts = intersect(region, stored_shape) if region else ((), ())
    if parts is None:
        return np.zeros(region_shape(region), dtype=dtype)
    source, destination = parts
    try:
        data = await store[source].read() if source else await store.read()
    except ValueError as e:
        raise storage.storage_error(f"{read.what} (array {read.name!r})", e) from e
    if data.shape != region_shape(region):
        padded = np.zeros(region_shape(region), dtype=data.dtype)
        padded[destination] = data
        data = padded
    return data


def within(region: Region, box: Region) -> tuple[slice, ...]:
    return tuple(
        slice(r.start - b.start, r.stop - b.start) for r, b in zip(region, box, strict=True)
    )


def assemble(read: ArrayRead, chunks: list[memoryview]) -> np.ndarray:
    """The whole array from its shards' data (a view of the only one, or a fresh array)."""
    stored = read.stored
    assert stored is not None
    if stored.single_chunk:
        # A read-only view when TensorStore read the value: conversions copy or make it writable.
        return np.frombuffer(chunks[0], dtype=stored.dtype).reshape(stored.shape)
    layout = zarr3.ZarrLayout(read.name, stored.shape, stored.dtype, stored.chunk_shape)
    full = aligned_empty(stored.nbytes).view(stored.dtype).reshape(stored.shape)
    for index, data in zip(stored.chunk_indices, chunks, strict=True):
        chunk = np.frombuffer(data, dtype=stored.dtype).reshape(stored.chunk_shape)
        region = layout.region(index)
        full[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]
    return full


def check_against_metadata(
    read: ArrayRead,
    shape: tuple[int, ...],
    dtype: np.dtype,
    chunk_shape: tuple[int, ...] | None = None,
    directory: Any = "",
) -> None:
    """The array's own ``zarr.json`` must agree with what ``_METADATA`` recorded of it: our
    layout, or Orbax's ``write_shape`` (``zarr3.record_contradiction``).

    Raises:
      cp.errors.MetadataError: naming the leaf, its ``zarr.json`` and ``_METADATA``.
    """
    stored = read.stored
    recorded = (stored.shape, stored.dtype) if stored is not None else None
    write_shape = getattr(read.label, "write_shape", None)
    if recorded is None and write_shape is None:
        return
    problem = zarr3.record_contradiction(
        shape, dtype, chunk_shape, recorded=recorded, write_shape=write_shape
    )
    if problem is not None:
        raise zarr3.contradiction_error(read.what, directory, read.name, problem)


@functools.cache
def physical_memory_bytes() -> int:
    """The machine's memory (``0`` where unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        return 0


def check_fits_in_memory(read: ArrayRead, nbytes: int) -> None:
    """Refuses, before anything is allocated, a read larger than the machine's memory."""
    memory = physical_memory_bytes()
    if memory and nbytes > memory:
        raise cp.errors.MetadataError(
            f"{read.what} (array {read.name!r}): loading it here needs {nbytes:,} bytes, more "
            f"than this machine's memory ({memory:,} bytes). If the checkpoint is damaged, restore "
            f"it from a copy; otherwise load it across more processes, or skip the leaf "
            f"(cp.PLACEHOLDER in the abstract tree)."
        )


def tiling_box(regions: Sequence[Region]) -> Region | None:
    """The block several regions tile exactly, or ``None`` (one region, or gaps between them)."""
    if len(regions) < 2 or not regions[0]:
        return None
    box = tuple(
        slice(min(r[d].start for r in regions), max(r[d].stop for r in regions))
        for d in range(len(regions[0]))
    )
    # Distinct regions of a sharding never overlap: equal volumes mean no gaps.
    if sum(math.prod(region_shape(r)) for r in regions) != math.prod(region_shape(box)):
        return None
    return box


@dataclasses.dataclass(frozen=True, slots=True)
class OpenedArray:
    """A stored array opened for TensorStore's zarr3 driver, checked against the load."""

    store: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    regions: list[Region]  # The regions the load asks for (the whole target if none).


async def open_stored(
    read: ArrayRead, spec: dict[str, Any], context: ts.Context, directory: Any = ""
) -> OpenedArray:
    """Opens ``read``'s array with the driver (a missing chunk is damage, not zeros);
    ``directory``: the pytree's, which errors name.

    Raises:
      cp.errors.MetadataError: its ``zarr.json`` contradicts ``_METADATA``, or names a
        codec this library never writes.
      cp.errors.TreeMismatchError: the target's shape differs from the stored one.
      cp.errors.CheckpointError: it cannot be opened (``IntegrityError`` where it is damaged).
    """
    try:
        spec = {**spec, "fill_missing_data_reads": False}
        store = await ts.open(spec, context=context, open=True)
    except ValueError as e:
        raise storage.storage_error(f"{read.what} (array {read.name!r})", e) from e
    shape = tuple(int(s) for s in store.shape)
    dtype = store.dtype.numpy_dtype
    chunk = store.chunk_layout.write_chunk.shape or store.chunk_layout.read_chunk.shape
    chunk_shape = None if chunk is None else tuple(int(c or 1) for c in chunk)
    check_against_metadata(read, shape, dtype, chunk_shape, directory)
    if read.stored is not None:  # Ours: its codecs must be ones this library writes.
        zarr3.check_own_codecs(store.codec, f"{read.what} (array {read.name!r})")
    return OpenedArray(store, shape, dtype, regions_of(read, check_shape(read, shape)))
