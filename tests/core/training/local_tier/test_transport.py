"""The local tier's file service and its client: only the files asked for, checked as they
stream; a dead or silent peer fails within the timeout, named by its address."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import checkpointables as cp
import jax.numpy as jnp
import pytest
from checkpointables.training.local_tier import _manifest, _transport
from checkpointables.training.local_tier._store import Store


@pytest.fixture
def served(tmp_path):
    """A host's store with one committed copy of step 7, served over HTTP."""
    source = Store(str(tmp_path / "source"))
    copy = source.copy_dir(7, "p0-of-1")
    cp.save_pytree(copy, {"w": jnp.arange(1000.0), "note": "x"})
    manifest = _manifest.build(
        copy, 7, "p0-of-1", process_index=0, process_count=1, held={}, shards={}
    )
    source.commit_copy(manifest)
    server = _transport.FileServer(source.directory, "127.0.0.1")
    yield source, manifest, server
    server.close()


def test_a_fetched_copy_is_the_same_bytes_and_committed(served, tmp_path) -> None:
    _, manifest, server = served
    target = Store(str(tmp_path / "target"))
    received = _transport.fetch_copy(server.address, manifest, target, timeout=10)
    assert received == manifest.nbytes
    assert target.copies(7) == {"p0-of-1": manifest}
    assert not _manifest.problems(target.copy_dir(7, "p0-of-1"), manifest)
    assert cp.load_pytree(target.copy_dir(7, "p0-of-1"))["note"] == "x"


def test_a_damaged_file_is_refused_and_nothing_is_kept(served, tmp_path) -> None:
    source, manifest, server = served
    relative = max(manifest.files, key=lambda r: manifest.files[r][0])
    path = Path(source.copy_dir(7, "p0-of-1")) / relative
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 4
    path.write_bytes(bytes(data))
    target = Store(str(tmp_path / "target"))
    with pytest.raises(_transport.FetchError, match="damaged"):
        _transport.fetch_copy(server.address, manifest, target, timeout=10)
    assert target.copies(7) == {}
    assert [p.name for p in (tmp_path / "target" / "7").iterdir()] == []  # No staging left.


def test_only_files_under_the_directory_are_served(served, tmp_path) -> None:
    _, _, server = served
    (tmp_path / "secret").write_text("no")
    source = tmp_path / "source"
    (source / "7" / "out").symlink_to(tmp_path / "secret")  # A link leading out of it.
    (source / "7" / "outside").symlink_to(tmp_path)
    os.mkfifo(source / "7" / "pipe")
    (source / "7" / "in").symlink_to(source / "7" / "p0-of-1.manifest.json")
    for path in ("/../secret", "/7/../../secret", "/", "/7", "/7/out", "/7/outside/secret",
                 "/7/pipe"):  # fmt: skip
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://{server.address}{path}", timeout=5)
    with urllib.request.urlopen(f"http://{server.address}/7/in", timeout=5) as inside:
        assert inside.read() == (source / "7" / "p0-of-1.manifest.json").read_bytes()


def test_a_dead_peer_is_named(served, tmp_path) -> None:
    _, manifest, server = served
    address = server.address
    server.close()
    with pytest.raises(_transport.FetchError, match=address):
        _transport.fetch_copy(address, manifest, Store(str(tmp_path / "t")), timeout=5)


def test_a_silent_peer_fails_within_the_timeout(served, tmp_path) -> None:
    _, manifest, _ = served
    with socket.socket() as silent:  # Accepts connections, never answers.
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        began = time.monotonic()
        with pytest.raises(_transport.FetchError, match=address):
            _transport.fetch_copy(address, manifest, Store(str(tmp_path / "t")), timeout=0.5)
        assert time.monotonic() - began < 5
