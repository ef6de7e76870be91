"""Array leaves built piece by piece, for loads under a host-memory budget.

``io``'s streamed reads hand each piece of a large array to a ``PieceSink`` as
soon as it is read: ``DeviceSink`` puts it on the devices that hold its region
(into a buffer there, updated in place: the old buffer is donated), so the
host holds a piece, never the array. On CPU devices, whose memory is the
host's, it copies the piece into the region's own aligned buffer instead,
which ``jax.device_put`` then takes over without a copy (nothing compiled, no
second copy). ``HostSink`` copies it into the NumPy array being loaded (the
result, not staging).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from checkpointables_pytree import storage
from checkpointables_pytree.io import Region

__all__ = ["DeviceSink", "HostSink"]


def _key(region: Region) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in region)


def _normalize(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


@functools.partial(jax.jit, donate_argnums=0)
def _update(buffer: jax.Array, piece: jax.Array, *offset: jax.Array) -> jax.Array:
    """``buffer`` with ``piece`` written at ``offset`` (in place: ``buffer`` is donated)."""
    return jax.lax.dynamic_update_slice(buffer, piece, offset)


def _block(
    buffer: np.ndarray, offset: tuple[int, ...], shape: tuple[int, ...]
) -> np.ndarray | None:
    """``buffer``'s part of ``shape`` at ``offset``, if it is C-contiguous (else ``None``)."""
    view = buffer[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
    return view if view.flags.c_contiguous else None


class DeviceSink:
    """Builds a ``jax.Array`` (of ``sharding``, or uncommitted on the default device) from
    pieces of its regions."""

    def __init__(
        self,
        shape: tuple[int, ...] | None,
        dtype: Any,
        sharding: jax.sharding.Sharding | None,
        regions: list[Region],
        stored_dtype: np.dtype,
        *,
        on_host: bool | None = None,
    ) -> None:
        """``on_host``: build the regions in host buffers (``None``: when every device is a
        CPU; ``False`` updates buffers on the devices, as on accelerators)."""
        self._dtype = np.dtype(dtype) if dtype is not None else stored_dtype
        self._stored_dtype = stored_dtype
        self._sharding = sharding
        self._regions = regions
        self._shape = shape
        # The devices of each region (``[None]``: the default device, uncommitted).
        self._devices: list[list[Any]] = [[None] for _ in regions]
        if sharding is not None and shape is not None:
            position = {_key(r): n for n, r in enumerate(regions)}
            self._devices = [[] for _ in regions]
            for device, index in sharding.addressable_devices_indices_map(shape).items():
                region = _normalize(tuple(index or ()), shape)
                self._devices[position[_key(region)]].append(device)
        self._buffers: list[dict[Any, jax.Array]] = [{} for _ in regions]
        # On CPU devices: one host buffer per region, handed to the devices at the end.
        self._host: list[np.ndarray | None] | None = None
        if on_host is None:
            on_host = all(
                (d.platform if d is not None else jax.default_backend()) == "cpu"
                for devices in self._devices
                for d in devices
            )
        if on_host:
            self._host = [None] * len(regions)

    @classmethod
    def maker(
        cls, shape: tuple[int, ...] | None, dtype: Any, sharding: jax.sharding.Sharding | None
    ) -> Callable[[list[Region], np.dtype], DeviceSink]:
        """What ``ArrayRead.sink`` holds: makes the sink once the regions are known."""
        return functools.partial(cls, shape, dtype, sharding)

    def put(self, n: int, offset: tuple[int, ...], data: np.ndarray) -> list[jax.Array]:
        """Puts a piece of region ``n`` on its devices; returns the pieces' device copies
        (once they are ready the host copy may go)."""
        if data.dtype != self._dtype:
            data = data.astype(self._dtype)
        shape = tuple(s.stop - s.start for s in self._regions[n])
        if self._host is not None:
            self._into_host(n, shape, offset, data)
            return []
        buffers = self._buffers[n]
        placed = []
        for device in self._devices[n]:
            # Never an alias (on CPU devices it could be): the reader reuses its buffers.
            piece = jax.device_put(data, device, may_alias=False)
            placed.append(piece)
            if data.shape == shape:  # The whole region in one piece.
                buffers[device] = piece
                continue
            buffer = buffers.get(device)
            if buffer is None:
                buffer = jnp.zeros(shape, self._dtype, device=device)
            buffers[device] = _update(buffer, piece, *offset)
        return placed

    def destination(
        self, n: int, offset: tuple[int, ...], shape: tuple[int, ...]
    ) -> np.ndarray | None:
        """The part of region ``n``'s host buffer a piece of ``shape`` at ``offset`` fills,
        where it is one block and needs no cast (on CPU devices); else ``None``."""
        if self._host is None or self._dtype != self._stored_dtype:
            return None
        region = tuple(s.stop - s.start for s in self._regions[n])
        return _block(self._host_buffer(n, region), offset, shape)

    def _host_buffer(self, n: int, shape: tuple[int, ...]) -> np.ndarray:
        assert self._host is not None
        buffer = self._host[n]
        if buffer is None:
            nbytes = math.prod(shape) * self._dtype.itemsize
            buffer = storage.aligned_empty(nbytes).view(self._dtype).reshape(shape)
            self._host[n] = buffer
        return buffer

    def _into_host(
        self, n: int, shape: tuple[int, ...], offset: tuple[int, ...], data: np.ndarray
    ) -> None:
        buffer = self._host_buffer(n, shape)
        buffer[tuple(slice(o, o + s) for o, s in zip(offset, data.shape, strict=True))] = data

    def finish(self) -> jax.Array:
        """The array, from every region's buffers."""
        if self._host is not None:
            for n, devices in enumerate(self._devices):
                for device in devices:  # Aligned host memory: the CPU device takes it as is.
                    self._buffers[n][device] = jax.device_put(self._host[n], device)
        if self._sharding is None or self._shape is None:
            return self._buffers[0][None]
        arrays = [
            self._buffers[n][device]
            for n, devices in enumerate(self._devices)
            for device in devices
        ]
        # A process holding no shard of the array has no buffer to take its dtype from.
        return jax.make_array_from_single_device_arrays(
            self._shape, self._sharding, arrays, dtype=None if arrays else self._dtype
        )


class HostSink:
    """Builds an ``np.ndarray`` (whole, in ``dtype`` or as stored) from its pieces."""

    def __init__(self, dtype: Any, regions: list[Region], stored_dtype: np.dtype) -> None:
        shape = tuple(s.stop - s.start for s in regions[0])
        self._array = np.empty(shape, np.dtype(dtype) if dtype is not None else stored_dtype)
        self._stored_dtype = stored_dtype

    @classmethod
    def maker(cls, dtype: Any) -> Callable[[list[Region], np.dtype], HostSink]:
        """What ``ArrayRead.sink`` holds: makes the sink once the regions are known."""
        return functools.partial(cls, dtype)

    def destination(
        self, n: int, offset: tuple[int, ...], shape: tuple[int, ...]
    ) -> np.ndarray | None:
        """The part of the array a piece of ``shape`` at ``offset`` fills, where it is one
        block and of the stored dtype; else ``None``."""
        if self._array.dtype != self._stored_dtype:
            return None
        return _block(self._array, offset, shape)

    def put(self, n: int, offset: tuple[int, ...], data: np.ndarray) -> None:
        """Copies a piece into the array (nothing to wait for)."""
        index = tuple(slice(o, o + s) for o, s in zip(offset, data.shape, strict=True))
        self._array[index] = data

    def finish(self) -> np.ndarray:
        """The array."""
        return self._array
