"""Damaged copies of a saved checkpoint, for integrity tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator


def flip(path, offset: int, bit: int = 0x10) -> None:
    """Flips one bit of the file at ``path``."""
    raw = bytearray(path.read_bytes())
    raw[offset] ^= bit
    path.write_bytes(bytes(raw))


def copies_with_a_flipped_bit(saved, tmp_path, fractions: tuple[float, ...]) -> Iterator:
    """Copies of ``saved``, each with one bit flipped in one database file.

    Every data file and the manifest get one copy per fraction of their size
    (the first and the fifth-last byte included).
    """
    database = saved / "pytree"
    files = [*sorted((database / "d").iterdir()), database / "manifest.ocdbt"]
    case = 0
    for original in files:
        size = original.stat().st_size
        for offset in sorted({0, size - 5, *(int(size * f) for f in fractions)}):
            copy = tmp_path / f"case{case}"
            case += 1
            shutil.copytree(saved, copy)
            flip(copy / "pytree" / original.relative_to(database), offset)
            yield copy
