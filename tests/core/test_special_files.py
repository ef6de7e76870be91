"""``cp.storage`` reads regular files only: a pipe, socket or directory is refused at once."""

from __future__ import annotations

import os
import socket

import checkpointables as cp
import pytest

from ..special_files import KINDS, bounded, replace_with

READS = {
    "open_regular_file": lambda path: os.close(cp.storage.open_regular_file(path)),
    "read_bytes": cp.storage.read_bytes,
    "read_text": cp.storage.read_text,
    "metadata_checksums.read_file": cp.metadata_checksums.read_file,
}
SAYS = {
    "fifo": "is a named pipe (FIFO)",
    "link to fifo": "is a named pipe (FIFO)",
    "directory": "is a directory",
}


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("kind", KINDS)
def test_what_is_no_regular_file_is_refused_at_once_naming_it(tmp_path, read, kind) -> None:
    path = tmp_path / "data.json"
    path.write_text("{}")
    replace_with(path, kind)
    took, outcome = bounded(lambda: READS[read](path), tmp_path)
    assert isinstance(outcome, cp.errors.IntegrityError), outcome
    assert f"{path} {SAYS[kind]}" in str(outcome)
    assert "restore the checkpoint from a copy" in str(outcome)
    assert took < 5


def test_a_socket_is_refused(tmp_path) -> None:
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(os.fspath(path))
        with pytest.raises(cp.errors.IntegrityError, match="is a socket"):
            cp.storage.read_bytes(path)


@pytest.mark.parametrize("link", [False, True], ids=["file", "link"])
def test_regular_files_read_as_before(tmp_path, link) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\x00abc" * 1000)
    if link:
        os.symlink("f", tmp_path / "l")
        path = tmp_path / "l"
    assert cp.storage.read_bytes(path) == b"\x00abc" * 1000
    fd = cp.storage.open_regular_file(path)
    try:
        assert os.get_blocking(fd)  # Reads wait for data as usual.
        assert os.pread(fd, 4, 4) == b"\x00abc"
    finally:
        os.close(fd)


def test_a_missing_file_is_still_file_not_found(tmp_path) -> None:
    for read in READS.values():
        with pytest.raises(FileNotFoundError):
            read(tmp_path / "missing")
