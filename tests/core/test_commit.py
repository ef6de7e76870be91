"""The identity of a committed checkpoint on an object store (``_commit.identity``).

The store here is a real plugin storage of its own scheme (``objdir://``),
keeping its objects in a local directory, as an object store would: no
renames, so checkpoints are committed by their ``commit_success.txt``. It
records what it reads, to show what the identity costs.
"""

from __future__ import annotations

import os
import shutil
import textwrap

import checkpointables as cp
import importlib_metadata
import pytest
from checkpointables import _commit, plugins

from .helpers import SaveOnlyHandler

_PLUGIN = """
import os
import checkpointables as cp

ROOT = os.environ["CPT_OBJDIR_ROOT"]
READS = []  # (method, relative path) of every read


class ObjDir:
    '''objdir://KEY is ROOT/KEY; reads whole or bounded (cp.storage.BoundedReads).'''

    atomic_rename = False
    _local = cp.storage.LocalStorage()

    def _path(self, path):
        return os.path.join(ROOT, path.partition("://")[2])

    def read_bytes(self, path):
        READS.append(("read_bytes", path))
        return self._local.read_bytes(self._path(path))

    def read_bytes_within(self, path, max_bytes):
        READS.append(("read_bytes_within", path))
        return self._local.read_bytes_within(self._path(path), max_bytes)

    def write_bytes(self, path, data, durable=False):
        os.makedirs(os.path.dirname(self._path(path)), exist_ok=True)
        self._local.write_bytes(self._path(path), data)

    def is_file(self, path):
        return os.path.isfile(self._path(path))


class VersionedObjDir(ObjDir):
    '''Tells versions, as S3 tells ETags (cp.storage.Versions).'''

    def version(self, path):
        READS.append(("version", path))
        try:
            info = os.stat(self._path(path))
        except FileNotFoundError:
            return None
        return f"{info.st_ino}-{info.st_mtime_ns}-{info.st_size}".encode()


@cp.hookimpl
def register_storage(register):
    register("objdir", lambda context: ObjDir())
    register("versioned", lambda context: VersionedObjDir())
"""


@pytest.fixture
def objdir(tmp_path, monkeypatch):
    """The plugin's module, its storages registered for ``objdir://`` and ``versioned://``."""
    (tmp_path / "cpt_objdir_plugin.py").write_text(textwrap.dedent(_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CPT_OBJDIR_ROOT", str(tmp_path / "objects"))
    monkeypatch.delitem(__import__("sys").modules, "cpt_objdir_plugin", raising=False)
    ep = importlib_metadata.EntryPoint(
        name="objdir", value="cpt_objdir_plugin", group=plugins.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(plugins, "_cached", plugins.discover([ep], disabled=set()))
    import cpt_objdir_plugin

    return cpt_objdir_plugin


def _commit_marker(path: str, data: bytes | None = None) -> str:
    marker = f"{path}/{cp.layout.COMMIT_SUCCESS_FILE}"
    cp.storage.write_bytes(marker, _commit.marker(path).encode() if data is None else data)
    return marker


def test_a_marker_is_read_with_a_bound_and_a_larger_one_refused(objdir) -> None:
    path = "objdir://bucket/ckpt"
    assert _commit.identity(path) is None
    marker = _commit_marker(path)
    opened = _commit.identity(path)
    assert opened == cp.storage.read_bytes(marker)
    assert ("read_bytes_within", marker) in objdir.READS  # Bounded, never read whole.
    assert ("read_bytes", marker) not in objdir.READS[:-1]
    _commit.check_unchanged(path, opened, None)
    _commit_marker(path, b"x" * _commit.MAX_MARKER_BYTES)  # At the bound: still an identity.
    assert _commit.identity(path) == b"x" * _commit.MAX_MARKER_BYTES
    _commit_marker(path, b"x" * (_commit.MAX_MARKER_BYTES + 1))
    with pytest.raises(cp.errors.IntegrityError, match="holds more than 65,536 bytes") as raised:
        _commit.identity(path)
    assert marker in str(raised.value) and "Restore the checkpoint" in str(raised.value)


def test_a_replaced_marker_is_noticed(objdir) -> None:
    for path in ("objdir://bucket/ckpt", "versioned://bucket/ckpt"):
        _commit_marker(path)
        opened = _commit.identity(path)
        _commit_marker(path)  # An overwrite's commit: another commit time.
        with pytest.raises(cp.errors.CheckpointChangedError, match="load it again"):
            _commit.check_unchanged(path, opened, None)
        os.remove(os.path.join(os.environ["CPT_OBJDIR_ROOT"], "bucket/ckpt/commit_success.txt"))
        assert _commit.identity(path) is None  # Deleted.
        with pytest.raises(cp.errors.CheckpointChangedError):
            _commit.check_unchanged(path, opened, None)


def test_a_storage_that_tells_versions_is_not_read(objdir) -> None:
    path = "versioned://bucket/ckpt"
    marker = _commit_marker(path, b"x" * (4 << 20))  # Too large to read, but never read.
    opened = _commit.identity(path)
    assert opened is not None
    _commit.check_unchanged(path, opened, None)
    reads = [("version", marker)] * 2  # A version per check, no read.
    assert list(objdir.READS) == reads


def test_a_local_identity_is_the_directory_not_the_marker(tmp_path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / cp.layout.COMMIT_SUCCESS_FILE).write_bytes(b"x" * (_commit.MAX_MARKER_BYTES + 1))
    info = os.stat(path)
    assert _commit.identity(path) == (info.st_dev, info.st_ino, info.st_ctime_ns)


class _CleanedAway:
    """A checkpointable whose save, once written, finds the save's temporary directory
    deleted (as another process's cleanup of temporary directories would)."""


class _CleaningHandler(SaveOnlyHandler):
    """Deletes the save's temporary directory in its background phase."""

    handles = _CleanedAway

    async def save(self, directory, checkpointable):
        async def write() -> None:
            path = await directory.await_creation()
            shutil.rmtree(path.parent)

        return write()


@pytest.mark.parametrize("metrics", [None, {"loss": 1.0}])
def test_a_temporary_directory_deleted_before_the_commit_commits_nothing(tmp_path, metrics) -> None:
    cp.handlers.register_handler(_CleaningHandler, priority=5)
    try:
        with cp.training.Checkpointer(tmp_path / "run") as checkpointer:
            with pytest.raises(cp.errors.StorageError, match="was deleted while it was writing"):
                checkpointer.save_checkpointables(
                    0, {"gone": _CleanedAway()}, metrics=metrics, force=True
                )
            assert checkpointer.steps() == []
    finally:
        cp.handlers.unregister_handler(_CleaningHandler)
    assert not [n for n in os.listdir(tmp_path / "run") if n[0].isdigit()]  # No step.
