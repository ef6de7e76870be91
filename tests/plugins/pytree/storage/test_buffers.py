"""Aligned buffers shared by the arrays of one read (``_buffers``)."""

from __future__ import annotations

import numpy as np
from checkpointables_pytree import storage


def test_aligned_empty_is_aligned_and_writable() -> None:
    for nbytes in (1, 63, 64, 1000, 5 << 20):
        buffer = storage.aligned_empty(nbytes)
        assert buffer.nbytes == nbytes
        assert buffer.ctypes.data % storage.ALIGNMENT == 0
        assert buffer.flags.writeable


def test_a_slab_hands_out_aligned_disjoint_pieces_of_one_buffer() -> None:
    sizes = [100, 64, 1, 4000]
    slab = storage.Slab(sizes)
    pieces = [slab.take(n) for n in sizes]
    for piece, n in zip(pieces, sizes, strict=True):
        assert piece.nbytes == n and piece.ctypes.data % storage.ALIGNMENT == 0
    bases = {id(piece.base) for piece in pieces}
    assert len(bases) == 1  # One buffer.
    for n, piece in enumerate(pieces):
        piece[:] = n
    for n, piece in enumerate(pieces):
        assert (piece == n).all()  # Writing one piece never touched another.
    starts = [piece.ctypes.data for piece in pieces]
    assert starts == sorted(starts)


def test_a_used_up_slab_gives_buffers_of_their_own() -> None:
    slab = storage.Slab([64])
    first = slab.take(64)
    extra = slab.take(128)  # More than the slab was made for.
    assert extra.nbytes == 128 and extra.ctypes.data % storage.ALIGNMENT == 0
    assert not np.shares_memory(first, extra)
