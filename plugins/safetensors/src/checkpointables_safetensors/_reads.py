"""Reading tensors, or the regions of them each device needs, into the loaded arrays.

Each tensor is read through ``safe_open(...).get_slice(name)[region]``, which
copies only the requested region out of the memory-mapped file, so a
process reads only the byte ranges of its own shards.

Memory stays bounded, measured (see docs/safetensors.md):

- Results are written straight into 64-byte aligned buffers, which
  ``jax.device_put`` on CPU aliases instead of copying. A region is copied in
  pieces of at most ``PIECE_BYTES`` (the package allocates each piece).
- Pages of a mapped file stay resident, and count in the process's memory,
  until the file is closed: each reading thread closes and reopens a file
  after every ``WINDOW_BYTES`` it read from it.
- On accelerators each region goes to its devices as soon as it is read and
  its host buffer is dropped: at most one region per thread is on the host.

So a load holds its results plus about ``THREADS * (WINDOW_BYTES +
PIECE_BYTES)``, 80 MiB (a 1 GiB file loads with a peak of about 1.05x its
size, where ``safetensors.numpy.load_file`` + ``jax.device_put`` peaks at 2x).

Under a host-memory budget (``cp.options.MemoryOptions(host_bytes=...)``,
``Limits.of``) pieces and windows shrink to fit it, and on accelerators a
region is never whole on the host: each piece goes to the devices as it is
read, into a buffer on each device updated in place (``_to_devices``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import math
import queue
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import checkpointables as cp
import jax
import numpy as np

from checkpointables_safetensors._files import StoredTensor, safe_open

__all__ = ["ArrayRead", "Limits", "read_all", "aligned_empty", "pieces"]

# jax.device_put aliases host buffers aligned to this on CPU instead of copying them.
ALIGNMENT = 64
PIECE_BYTES = 8 << 20
WINDOW_BYTES = 32 << 20
# The package copies out of the file holding the GIL; a second thread copies into the
# results meanwhile (NumPy releases the GIL). More threads would only add memory.
THREADS = 2

Region = tuple[slice, ...]


@attrs.frozen
class Limits:
    """How much one reading thread holds: a piece copied out of a file, and the bytes read
    from a mapped file before it is closed (its resident pages freed).

    ``streamed``: under a budget, regions on accelerators go to the devices piece by piece.
    """

    piece: int = PIECE_BYTES
    window: int = WINDOW_BYTES
    streamed: bool = False

    @classmethod
    def of(cls, host_bytes: int | None) -> Limits:
        """The limits within a budget of ``host_bytes`` (``None``: the defaults): the
        ``THREADS`` threads hold at most three quarters of it, a piece and a window each."""
        if host_bytes is None:
            return cls()
        share = host_bytes // (THREADS * 8)
        return cls(min(PIECE_BYTES, 2 * share), min(WINDOW_BYTES, 4 * share), streamed=True)

    @classmethod
    def in_context(cls) -> Limits:
        """The limits of the budget of the context in force."""
        return cls.of(cp.context.get_context().memory_options.host_bytes)


@attrs.frozen
class ArrayRead:
    """One tensor to load, and what it becomes.

    Attributes:
      tensor: the stored tensor.
      dtype: the dtype of the result (a cast when it differs from the stored one).
      to_jax: a ``jax.Array`` (else a ``np.ndarray``).
      sharding: the result's sharding (``None``: the default device).
      to_scalar: a Python scalar of this type (0-d tensors).
    """

    tensor: StoredTensor
    dtype: np.dtype
    to_jax: bool = True
    sharding: jax.sharding.Sharding | None = None
    to_scalar: type | None = None

    @classmethod
    def as_stored(cls, tensor: StoredTensor) -> ArrayRead:
        """A ``jax.Array`` on the default device; NumPy for dtypes JAX would narrow.

        With 64-bit types off (JAX's default) a ``jax.Array`` cannot hold float64
        or int64: those tensors load as ``np.ndarray``, bit for bit, instead.
        """
        exact = jax.dtypes.canonicalize_dtype(tensor.dtype) == tensor.dtype
        return cls(tensor, tensor.dtype, to_jax=exact)

    def regions(self) -> list[tuple[Region, list[Any]]]:
        """Each distinct region this process reads, with the devices that hold it."""
        full = tuple(slice(0, n) for n in self.tensor.shape)
        if not self.to_jax or self.sharding is None:
            return [(full, [None])]
        by_region: dict[tuple[tuple[int, int], ...], tuple[Region, list[Any]]] = {}
        shape = self.tensor.shape
        for device, index in self.sharding.addressable_devices_indices_map(shape).items():
            region = tuple(
                slice(*s.indices(n)[:2]) for s, n in zip(index or full, shape, strict=True)
            )
            key = tuple((r.start, r.stop) for r in region)
            by_region.setdefault(key, (region, []))[1].append(device)
        return list(by_region.values())


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array aligned to ``ALIGNMENT`` bytes (aliased by device_put on CPU)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    offset = (-buffer.ctypes.data) % ALIGNMENT
    return buffer[offset : offset + nbytes].view(dtype).reshape(shape)


def pieces(shape: tuple[int, ...], itemsize: int, limit: int = PIECE_BYTES) -> Iterator[Region]:
    """Sub-regions of an array of ``shape`` tiling it in C order, each at most ``limit`` bytes.

    The last axes stay whole as long as they fit; the first axis that does not
    is cut; the axes before it go one index at a time.
    """
    if not shape or math.prod(shape) == 0:
        yield tuple(slice(0, n) for n in shape)
        return
    axis, inner = len(shape), itemsize
    while axis > 0 and inner * shape[axis - 1] <= limit:
        axis -= 1
        inner *= shape[axis]
    if axis == 0:
        yield tuple(slice(0, n) for n in shape)
        return
    cut = axis - 1  # Axes after `cut` are whole; `cut` is split in steps of `step`.
    step = max(1, limit // inner)
    for outer in itertools.product(*(range(n) for n in shape[:cut])):
        for start in range(0, shape[cut], step):
            head = tuple(slice(i, i + 1) for i in outer)
            tail = tuple(slice(0, n) for n in shape[cut + 1 :])
            yield (*head, slice(start, min(start + step, shape[cut])), *tail)


# Dtypes the package's NumPy reader has no type for (it looks them up in NumPy, which
# lacks them; ml_dtypes has them): their bytes are read here, then viewed as the dtype.
_READ_RAW = frozenset(
    {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}
)


def _read_raw(tensor: StoredTensor, region: Region) -> np.ndarray:
    """``region`` of ``tensor``, from its bytes in the file (a one-byte dtype: no order)."""
    if tensor.nbytes == 0:  # Nothing to map.
        return np.empty(tensor.shape, tensor.dtype)[region]
    whole = np.memmap(tensor.file, np.uint8, "r", tensor.start, (tensor.nbytes,))
    try:
        return np.array(whole.view(tensor.dtype).reshape(tensor.shape)[region])
    finally:
        del whole  # Unmapped now, not when collected.


def _check_bools(tensor: StoredTensor, values: np.ndarray) -> None:
    """Refuses BOOL bytes other than 0 and 1: NumPy and JAX would keep them as they are, and
    the array then disagrees with itself (``a == True`` false where ``a.astype(int)`` is 1)."""
    raw = values.view(np.uint8)
    if raw.size and int(raw.max()) > 1:
        byte = int(raw[raw > 1][0])
        raise cp.errors.MetadataError(
            f"{tensor.file}: tensor {tensor.name!r} is BOOL but holds the byte {byte} (a BOOL "
            f"byte is 0 or 1); the file is damaged or was written by a broken tool."
        )


class _OpenFiles:
    """One reading thread's open files, each closed again after ``limits.window`` bytes read."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._open: dict[str, list[Any]] = {}  # file -> [handle, bytes read since opened]

    def read(self, tensor: StoredTensor, region: Region) -> np.ndarray:
        entry = self._open.get(tensor.file)
        if entry is None:
            handle = safe_open(tensor.file)
            entry = self._open[tensor.file] = [handle, 0]
            handle.__enter__()
        try:
            if tensor.dtype.name in _READ_RAW:
                values = _read_raw(tensor, region)
            else:
                values = entry[0].get_slice(tensor.name)[region]
        except Exception as e:  # SafetensorError: e.g. the file changed since it was opened.
            raise cp.errors.MetadataError(
                f"{tensor.file}: cannot read tensor {tensor.name!r}: {e}"
            ) from e
        if values.dtype == np.bool_:
            _check_bools(tensor, values)
        entry[1] += values.nbytes
        if entry[1] >= self.limits.window:
            self.close(tensor.file)
        return values

    def close(self, file: str | None = None) -> None:
        for name in [file] if file is not None else list(self._open):
            entry = self._open.pop(name, None)
            if entry is not None:
                entry[0].__exit__(None, None, None)


def _pieces_of(files: _OpenFiles, read: ArrayRead, region: Region) -> Iterator[Any]:
    """Each piece of ``region`` (relative to it) with its values, read from the file."""
    shape = tuple(r.stop - r.start for r in region)
    for piece in pieces(shape, read.tensor.dtype.itemsize, files.limits.piece):
        if math.prod(r.stop - r.start for r in piece) == 0:
            continue
        absolute = tuple(
            slice(r.start + p.start, r.start + p.stop) for r, p in zip(region, piece, strict=True)
        )
        yield piece, files.read(read.tensor, absolute)


def _read_region(files: _OpenFiles, read: ArrayRead, region: Region) -> np.ndarray:
    out = aligned_empty(tuple(r.stop - r.start for r in region), read.dtype)
    for piece, values in _pieces_of(files, read, region):
        out[piece] = values
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _update(buffer: jax.Array, values: jax.Array, starts: tuple[jax.Array, ...]) -> jax.Array:
    """``buffer`` with ``values`` at ``starts``, in place (compiled per piece shape)."""
    return jax.lax.dynamic_update_slice(buffer, values.astype(buffer.dtype), starts)


def _to_devices(
    files: _OpenFiles, read: ArrayRead, region: Region, devices: list[Any]
) -> list[Any]:
    """``region`` on each of ``devices``, sent piece by piece: never whole on the host."""
    shape = tuple(r.stop - r.start for r in region)
    buffers = [jax.numpy.zeros(shape, read.dtype, device=d) for d in devices]
    for piece, values in _pieces_of(files, read, region):
        starts = tuple(np.int32(p.start) for p in piece)
        pairs = zip(buffers, devices, strict=True)
        buffers = [_update(b, jax.device_put(values, d), starts) for b, d in pairs]
        cp.progress.advance(values.nbytes)
    return buffers


def _streams(files: _OpenFiles, read: ArrayRead, devices: list[Any]) -> bool:
    """Whether a region goes to ``devices`` piece by piece: under a budget, onto
    accelerators (on CPU the region's host buffer becomes the array: it is not staged)."""
    return (
        files.limits.streamed
        and read.to_jax
        and devices[0] is not None
        and any(d.platform != "cpu" for d in devices)
    )


def _read_one(files: _OpenFiles, read: ArrayRead) -> Any:
    """Reads every region of ``read``; returns its result."""
    parts = []
    for region, devices in read.regions():
        if _streams(files, read, devices):
            parts += _to_devices(files, read, region, devices)
            continue
        host = _read_region(files, read, region)
        cp.progress.advance(host.nbytes)
        if read.to_scalar is not None:
            return read.to_scalar(host.item())
        if not read.to_jax:
            return host
        parts += [jax.device_put(host, device) for device in devices]
        del host  # On accelerators: freed once copied to the devices.
    if read.sharding is None:
        return parts[0]
    return jax.make_array_from_single_device_arrays(read.tensor.shape, read.sharding, parts)


def read_all(reads: Sequence[ArrayRead], limits: Limits | None = None) -> list[Any]:
    """The results of ``reads``, in order, read on ``THREADS`` threads within ``limits``
    (``None``: the defaults).

    Raises the first error of any read (a file changed or truncated since its
    header was read raises ``cp.errors.MetadataError`` naming it).
    """
    idle: queue.SimpleQueue[_OpenFiles] = queue.SimpleQueue()
    everyone = [_OpenFiles(limits or Limits()) for _ in range(THREADS)]
    for files in everyone:
        idle.put(files)

    def task(read: ArrayRead) -> Any:
        files = idle.get()
        try:
            return _read_one(files, read)
        finally:
            idle.put(files)

    try:
        if len(reads) <= 1:
            return [task(r) for r in reads]
        with concurrent.futures.ThreadPoolExecutor(THREADS, "safetensors-read") as pool:
            return list(pool.map(task, reads))
    finally:
        for files in everyone:
            files.close()
