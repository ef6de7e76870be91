"""Memory for loaded arrays: 64-byte aligned, many arrays to a buffer.

A load into fresh memory pays a page fault per page it fills: 4 KiB pages
cost about 0.5 s per GiB on the benchmark machine, and NumPy asks the kernel
for 2 MiB pages only for buffers of 4 MiB or more. Reading many arrays into
one buffer gets them those pages too (the ``256mib`` case loaded in 131 ms
instead of 157 ms; 3,300 small arrays are allocated in 2 ms instead of 7).
The arrays are views of the buffer, so it lives as long as any of them: one
kept array keeps at most one buffer's worth of other arrays' memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Sequence

import numpy as np

__all__ = ["ALIGNMENT", "Slab", "aligned_empty", "aligned_size", "give_back_free_memory"]

# jax.device_put aliases host buffers aligned to this on CPU instead of copying them.
ALIGNMENT = 64


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of ``ALIGNMENT``."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 buffer aligned to ``ALIGNMENT`` bytes."""
    buffer = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    offset = (-buffer.ctypes.data) % ALIGNMENT
    return buffer[offset : offset + nbytes]


class Slab:
    """One buffer for the arrays of ``sizes``, handed out in aligned pieces.

    Example::

        slab = Slab([4096, 100])
        a = slab.take(4096)  # The buffer is allocated here, at the first take.
        b = slab.take(100)   # Starts at byte 4096 of the same buffer.
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self._size = sum(aligned_size(n) for n in sizes)
        self._buffer: np.ndarray | None = None  # Allocated by the first take.
        self._used = 0

    @classmethod
    def runs(cls, sizes: Sequence[int], limit: int) -> list[Slab]:
        """The slab of each size: one per run of consecutive sizes of about ``limit`` bytes."""
        slabs: list[Slab] = []
        start, used = 0, 0
        for n, size in enumerate(sizes):
            if used and used + aligned_size(size) > limit:
                slabs += [cls(sizes[start:n])] * (n - start)
                start, used = n, 0
            used += aligned_size(size)
        if start < len(sizes):
            slabs += [cls(sizes[start:])] * (len(sizes) - start)
        return slabs

    def take(self, nbytes: int) -> np.ndarray:
        """The next ``nbytes`` of the buffer (a buffer of its own once it is used up)."""
        if self._buffer is None:
            self._buffer = aligned_empty(self._size)
        start = self._used
        if start + nbytes > len(self._buffer):
            return aligned_empty(nbytes)
        self._used = start + aligned_size(nbytes)
        return self._buffer[start : start + nbytes]


@functools.cache
def _malloc_trim() -> object | None:
    """glibc's ``malloc_trim``, or ``None`` (another C library)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_free_memory() -> None:
    """Hands the C allocator's free memory back to the kernel (glibc only).

    Under a host-memory budget, buffers of a few MiB are freed by one thread
    after another allocated them: glibc keeps them in per-thread arenas, so
    without this the process's memory grows by several pieces past the budget.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)  # type: ignore[operator]
