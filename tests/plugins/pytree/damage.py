"""Damaged copies of a saved checkpoint, for integrity tests."""

from __future__ import annotations

import pathlib
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


def varint(value: int) -> bytes:
    """``value`` as an OCDBT (LEB128) varint."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def root_location(database) -> tuple[str, int, int]:
    """The file, offset and length of the root node the manifest of ``database`` names."""
    import tensorstore as ts

    base = ts.KvStore.open({"driver": "file", "path": f"{database}/"}).result()
    location = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
    _, _, file, offset, length = location.split(":")
    return file, int(offset), int(length)


def forge_root(database, offset: int, length: int) -> None:
    """Rewrites the manifest of ``database`` (one we wrote) so that its root node is at
    ``offset`` and ``length`` bytes long, with a valid CRC-32C (as a forger would)."""
    import struct

    import crc32c

    manifest = database / "manifest.ocdbt"
    raw = manifest.read_bytes()
    _, old_offset, old_length = root_location(database)
    old = varint(old_offset) + varint(old_length)
    at = raw.index(old, 30)  # After the header and the database's uuid.
    body = raw[14:at] + varint(offset) + varint(length) + raw[at + len(old) : -4]
    forged = raw[:4] + struct.pack("<Q", 14 + len(body) + 4) + raw[12:14] + body
    manifest.write_bytes(forged + struct.pack("<I", crc32c.crc32c(forged)))


def saved_by_fast_path(tmp_path_factory, tree) -> pathlib.Path:
    """A checkpoint of ``tree`` written by our database writer, for a module's fixture (made
    before a ``fast_path`` mark turns that writer on, so it is turned on here)."""
    import checkpointables as cp

    path = tmp_path_factory.mktemp("saved") / "c"
    with cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=True)):
        cp.save_pytree(path, tree)
    return path
