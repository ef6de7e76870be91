"""A ``reuse_from`` source that someone else controls, on real files: a save from it
either commits exactly the tree it was given, with no symbolic link and no file from
outside the source, or fails with a documented error and commits nothing.

(A record forged to claim the save's fingerprints is trusted, as documented in
``docs/integrity.md``; not tested here.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from checkpointables import _verification
from checkpointables_pytree import ocdbt, reuse, zarr3

from ....python_subprocess import assert_verifies
from ....traced_memory import TracedPeak
from .helpers import linked_names

pytestmark = pytest.mark.fast_path  # Linking is the fast path's.


def _tree() -> dict:
    a = jnp.arange(64 * 1024, dtype=jnp.float32).reshape(256, 256)
    return {"a": a, "b": a * 3 + 1, "n": np.arange(32 * 1024, dtype=np.float64) * 7}


def _assert_saved_exactly(path, tree) -> None:
    loaded = cp.load_pytree(path)
    for name, value in tree.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes(), name
    for directory, names, files in os.walk(path):
        for name in names + files:
            assert not os.path.islink(os.path.join(directory, name)), (directory, name)
    assert_verifies(path)


def _place(database: str, placement: dict[str, str]) -> None:
    """Rewrites ``database`` (an OCDBT database of ours) so that the values of the keys in
    ``placement`` lie in data files of the given names; the others in ``d/rest``."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{database}/"}).result()
    values = {k.decode(): store.read(k).result().value for k in store.list().result()}
    for name in (ocdbt.MANIFEST_FILE, "_btree_checksums", "d"):
        path = os.path.join(database, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    files: dict[str, bytearray] = {}
    keys, lengths, fixed = sorted(values), [], []
    for key in keys:
        value = values[key]
        lengths.append(len(value))
        if len(value) <= ocdbt.MAX_INLINE_VALUE_BYTES:
            fixed.append(value)
            continue
        name = placement.get(key, "d/rest")
        content = files.setdefault(name, bytearray())
        linked = ocdbt.Linked(os.path.join(database, name), len(content), len(value))
        linked.name = name  # Where the b-tree places it.
        content += value
        fixed.append(linked)
    for name, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(database, name)), exist_ok=True)
        with open(os.path.join(database, name), "wb") as f:
            f.write(content)
    layout = ocdbt.DatabaseLayout(keys, lengths, fixed, file_bytes=32 << 20)
    btree, manifest = layout.btree_file(layout.file_names(), [])
    ocdbt.write_local_file(database, btree, flush=False)
    with open(os.path.join(database, ocdbt.MANIFEST_FILE), "wb") as f:
        f.write(manifest)


@pytest.mark.parametrize("second", ["d/rX", "e/X"], ids=["r-prefixed", "another-directory"])
def test_two_source_files_of_one_name_are_linked_apart(tmp_path, second) -> None:
    tree = _tree()
    source = tmp_path / "source"
    cp.save_pytree(source, tree)  # No record: its bytes are compared in full.
    _place(str(source / "pytree"), {"a/c/0/0": "d/X", "b/c/0/0": second})
    cp.metadata_checksums.record(source)
    _assert_saved_exactly(source, tree)  # The source itself is sound.
    cp.save_pytree(tmp_path / "new", tree, reuse_from=source)
    linked = linked_names(tmp_path / "new")
    assert linked == {"a", "b"}
    _assert_saved_exactly(tmp_path / "new", tree)


def _data_files(pytree_directory) -> list[str]:
    data = os.path.join(pytree_directory, "d")
    return [os.path.join(data, name) for name in os.listdir(data)]


def test_a_data_file_that_is_a_link_out_of_the_source_is_refused(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "source", tree)
    (tmp_path / "outside").mkdir()
    for file in _data_files(tmp_path / "source" / "pytree"):  # Same bytes, elsewhere.
        moved = tmp_path / "outside" / os.path.basename(file)
        shutil.move(file, moved)
        os.symlink(moved, file)
    with pytest.raises(cp.errors.OutsideCheckpointError, match="outside the checkpoint"):
        cp.save_pytree(tmp_path / "new", tree, reuse_from=tmp_path / "source")
    assert not (tmp_path / "new").exists()


def _recorded_source(root, tree):
    """A checkpoint whose record lists every array, each in data files of its own (a
    reusing Checkpointer's first step), and its pytree's directory."""
    with cp.training.Checkpointer(root, reuse_unchanged=True) as ckptr:
        ckptr.save_pytree(0, tree)
    return root / "0", root / "0" / "state"


@pytest.mark.parametrize("inside", ["symlink", "directory"])
def test_a_data_file_that_is_not_a_regular_file_is_not_linked(tmp_path, inside) -> None:
    tree = _tree()
    source, pytree = _recorded_source(tmp_path / "run", tree)
    for file in _data_files(pytree):
        size = os.path.getsize(file)
        if size < reuse.MIN_BYTES:
            continue  # The b-tree's file.
        if inside == "symlink":  # To a file inside the checkpoint: allowed there.
            moved = source / f"moved-{os.path.basename(file)}"
            shutil.move(file, moved)
            os.symlink(moved, file)
            continue
        os.remove(file)  # A directory at least as large: its size passes for a file's.
        os.mkdir(file)
        for i in range(20_000):
            if os.path.getsize(file) >= size:
                break
            open(os.path.join(file, f"{i:0200d}"), "w").close()
        else:
            pytest.skip("this file system's directories do not grow with their entries")
    cp.save_pytree(tmp_path / "new", tree, reuse_from=source)
    assert not any(reuse.reuse_report(tmp_path / "new" / "pytree").values())
    _assert_saved_exactly(tmp_path / "new", tree)


@pytest.mark.parametrize("replacement", ["symlink", "pipe", "directory"])
@pytest.mark.parametrize("where", ["linked", "copied"])  # Copied: on another file system.
def test_a_data_file_replaced_after_it_was_chosen_is_not_taken(
    tmp_path, request, where, replacement
) -> None:
    # What a source's file may become between the save's check of it and its link: a
    # writer racing the save. The link (or copy) must not put it in the new checkpoint.
    directory = str(tmp_path) if where == "linked" else request.getfixturevalue("elsewhere")
    os.makedirs(os.path.join(directory, "d"))
    secret = os.path.join(directory, "outside")
    with open(secret, "wb") as f:
        f.write(b"not the checkpoint's" * 1000)
    source = os.path.join(directory, "d", "0a1b")
    if replacement == "symlink":
        os.symlink(secret, source)
    elif replacement == "pipe":
        os.mkfifo(source)
    else:
        os.mkdir(source)
    database = tmp_path / "new"
    database.mkdir()
    linked = ocdbt.Linked(source, offset=0, length=100)
    with pytest.raises(cp.errors.IntegrityError, match="during the save") as raised:
        ocdbt.link_files(database, [linked])
    assert source in str(raised.value)
    assert not os.path.lexists(database / linked.name)


_MALFORMED = {
    "entry-a-string": "x",
    "shards-an-int": {"signature": "s", "shards": 3},
    "shard-an-int": {"signature": "s", "shards": [3]},
    "shard-of-three": {"signature": "s", "shards": [[[0], "p", "q"]]},
    "shard-empty": {"signature": "s", "shards": [[]]},
    "starts-of-floats": {"signature": "s", "shards": [[[0.5], "p"]]},
    "probes-of-ints": {"signature": "s", "shards": [[[0], "p"]], "probes": [1]},
    "signature-a-list": {"signature": ["s"], "shards": []},
}


@pytest.mark.parametrize("entry", list(_MALFORMED), ids=list(_MALFORMED))
def test_a_malformed_record_entry_is_ignored(tmp_path, entry) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree)
    cp.save_pytree(tmp_path / "source", tree, reuse_from=tmp_path / "1")
    record_file = tmp_path / "source" / "pytree" / reuse.RECORD_FILE
    record = json.loads(record_file.read_text())
    good = record["arrays"]["b"]
    record["arrays"] = {"a": _MALFORMED[entry], "b": good, "n": _MALFORMED[entry]}
    record_file.write_text(json.dumps(record))
    cp.save_pytree(tmp_path / "new", tree, reuse_from=tmp_path / "source")
    linked = linked_names(tmp_path / "new")
    assert "b" in linked and "n" not in linked  # The well-formed entry still counts.
    _assert_saved_exactly(tmp_path / "new", tree)


def test_a_record_nested_too_deeply_counts_as_none(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "1", tree)
    cp.save_pytree(tmp_path / "source", tree, reuse_from=tmp_path / "1")
    record_file = tmp_path / "source" / "pytree" / reuse.RECORD_FILE
    record_file.write_text("[" * 100_000 + "]" * 100_000)
    cp.save_pytree(tmp_path / "new", tree, reuse_from=tmp_path / "source")
    _assert_saved_exactly(tmp_path / "new", tree)


@pytest.mark.parametrize("record", ["directory", "pipe", "huge"])
def test_a_checkpointer_whose_latest_record_is_unusable_keeps_saving(tmp_path, record) -> None:
    # A record that is no regular file, or too large to be one of ours (sparse here: no
    # disk used), counts as none (the arrays are compared byte for byte), and the run
    # goes on.
    tree = _tree()
    _, pytree = _recorded_source(tmp_path / "run", tree)
    record_file = pytree / reuse.RECORD_FILE
    record_file.unlink()
    if record == "directory":
        record_file.mkdir()
    elif record == "pipe":
        os.mkfifo(record_file)
    else:
        with open(record_file, "wb") as f:
            f.truncate(300 << 20)
    with (
        TracedPeak() as traced,
        cp.training.Checkpointer(tmp_path / "run", reuse_unchanged=True) as ckptr,
    ):
        ckptr.save_pytree(1, tree)
    assert traced.peak < 64 << 20  # The huge record was not read.
    _assert_saved_exactly(tmp_path / "run" / "1", tree)
    with cp.training.Checkpointer(tmp_path / "run", reuse_unchanged=True) as ckptr:
        ckptr.save_pytree(2, tree)  # From step 1's record: linked again.
        assert ckptr.last_save_stats.bytes_reused > 0


def _flip_first_byte(path: str, in_place: bool) -> None:
    """Damages a data file's first byte: in place (its inode, which every step linking it
    shares), or in a copy put in its place (this step's name only)."""
    with open(path, "rb") as f:
        content = bytearray(f.read())
    content[0] ^= 0xFF
    if not in_place:
        os.remove(path)
    with open(path, "r+b" if in_place else "wb") as f:
        f.write(content)


@pytest.mark.parametrize("in_place", [False, True], ids=["replaced", "written-into"])
def test_a_damaged_source_file_is_written_afresh_not_linked(tmp_path, in_place) -> None:
    # A data file changed since the save that recorded it (its time differs) is not linked:
    # the new step is written from the arrays, whole, and the run links again after it.
    tree = _tree()
    _, pytree = _recorded_source(tmp_path / "run", tree)
    for file in _data_files(pytree):
        if os.path.getsize(file) >= reuse.MIN_BYTES:
            _flip_first_byte(file, in_place)
    with cp.training.Checkpointer(tmp_path / "run", reuse_unchanged=True) as ckptr:
        ckptr.save_pytree(1, tree)
        assert ckptr.last_save_stats.bytes_reused == 0
        ckptr.save_pytree(2, tree)
        assert ckptr.last_save_stats.bytes_reused > 0
    _assert_saved_exactly(tmp_path / "run" / "1", tree)
    _assert_saved_exactly(tmp_path / "run" / "2", tree)


def test_a_source_chunk_with_a_damaged_checksum_is_not_linked(tmp_path) -> None:
    # A plain source (no record) is compared byte for byte: data equal to the arrays' but a
    # damaged CRC-32C after it would fail every step linking it.
    tree = _tree()
    cp.save_pytree(tmp_path / "source", tree)
    found = asyncio.run(ocdbt.locate(tmp_path / "source" / "pytree", ["a/c/0/0", "b/c/0/0"]))
    assert len(found) == 2
    for place in found.values():
        with open(place.file, "r+b") as f:  # The chunk's CRC-32C: right after its data.
            f.seek(place.offset + place.length - zarr3.SHARD_TRAILER_BYTES)
            crc = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([crc[0] ^ 0xFF]))
    cp.save_pytree(tmp_path / "new", tree, reuse_from=tmp_path / "source")
    assert not linked_names(tmp_path / "new")
    _assert_saved_exactly(tmp_path / "new", tree)


def test_a_checkpointer_does_not_reuse_a_step_linking_out_of_itself(tmp_path, caplog) -> None:
    # Its latest step checked as reuse_from is: a data directory moved out and linked back
    # gives the next step nothing of it (no hard link to a file outside the run), and the
    # run goes on, saying why once.
    tree = _tree()
    _, pytree = _recorded_source(tmp_path / "run", tree)
    outside = tmp_path / "outside"
    shutil.move(pytree / "d", outside)
    os.symlink(outside, pytree / "d")
    with (
        caplog.at_level(logging.WARNING, logger="checkpointables.reuse"),
        cp.training.Checkpointer(tmp_path / "run", reuse_unchanged=True) as ckptr,
    ):
        ckptr.save_pytree(1, tree)
        assert ckptr.last_save_stats.bytes_reused == 0
    assert "Step 0 is not reused from" in caplog.text and "outside" in caplog.text
    assert all(os.stat(outside / name).st_nlink == 1 for name in os.listdir(outside))
    _assert_saved_exactly(tmp_path / "run" / "1", tree)


def test_a_source_file_deleted_before_its_link_fails_the_save_clearly(tmp_path) -> None:
    database = tmp_path / "new"
    database.mkdir()
    linked = ocdbt.Linked(str(tmp_path / "gone" / "d" / "0a1b"), offset=0, length=100)
    with pytest.raises(cp.errors.StorageError, match="was deleted during the save"):
        ocdbt.link_files(database, [linked])


def _forged(source, how: str) -> None:
    """Rewrites ``source``'s record (format 2) to misstate how its arrays are stored, and
    its ``_CHECKSUMS`` to match (a CRC: anyone can recompute it)."""
    path = source / "pytree" / reuse.RECORD_FILE
    record = json.loads(path.read_text())
    assert record["format"] == 2
    for name, entry in record["arrays"].items():
        signature = json.loads(entry["signature"])
        if how == "chunk shape" and name == "big":
            signature[3] = [512, 1024]  # The unbudgeted shape; stored: the budget's halves.
        elif how == "codec":
            signature[4] = True  # Compressed; stored: plain.
        entry["signature"] = json.dumps(signature)
    path.write_text(json.dumps(record))
    cp.metadata_checksums.record(source)
    assert _problems(source) == []  # Nothing tells the forgery from a sound step.


def _problems(checkpoint) -> list[str]:
    """What ``checkpointables verify`` finds wrong with ``checkpoint`` (in process)."""
    return [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]


@pytest.mark.parametrize("how", ["chunk shape", "codec"])
def test_a_forged_record_of_another_layout_links_nothing_that_would_not_load(tmp_path, how) -> None:
    # A compressed save cannot check a chunk's length: the source's zarr.json, which its
    # own loads obey, is compared with this save's for each array before it is linked.
    rng = np.random.default_rng(5)
    tree = {
        "big": jnp.asarray(rng.standard_normal((512, 1024), np.float32)),  # Two 1 MiB pieces.
        "w": jnp.asarray(rng.standard_normal((128, 256), np.float32)),
    }
    before = cp.options.MemoryOptions(host_bytes=8 << 20 if how == "chunk shape" else None)
    with cp.Context(
        memory_options=before,
        array_options=cp.options.ArrayOptions(use_compression=how == "chunk shape"),
    ):
        cp.save_pytree(tmp_path / "1", tree)
        cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")
    _forged(tmp_path / "2", how)
    with cp.Context(array_options=cp.options.ArrayOptions(use_compression=True)):
        cp.save_pytree(tmp_path / "3", tree, reuse_from=tmp_path / "2")
    loaded = cp.load_pytree(tmp_path / "3")
    for name, value in tree.items():
        assert np.asarray(loaded[name]).tobytes() == np.asarray(value).tobytes(), name
    assert _problems(tmp_path / "3") == []
    # What was stored as this save stores it is still linked; nothing else.
    assert linked_names(tmp_path / "3") == ({"w"} if how == "chunk shape" else set())


def _inner_chunks(kib: int) -> cp.options.ArrayOptions:
    storage = cp.options.ArrayStorageOptions(chunk_byte_size=kib << 10)
    return cp.options.ArrayOptions(storage_options=storage)


def test_a_source_of_another_inner_chunk_shape_is_written_not_linked(tmp_path) -> None:
    # Saved with inner chunks of 64 KiB ((128, 128) of a (256, 256) float32), its record
    # forged to claim this save's 32 KiB ((128, 64), which its chunks' (128, 128) does not
    # match though both divide the chunk shape): its zarr.json decides, exactly.
    tree = {"w": jnp.asarray(np.random.default_rng(7).standard_normal((256, 256), np.float32))}
    with cp.Context(array_options=_inner_chunks(64)):
        cp.save_pytree(tmp_path / "1", tree)
        cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "1")  # Its record.
        cp.save_pytree(tmp_path / "3", tree, reuse_from=tmp_path / "2")
    assert linked_names(tmp_path / "3") == {"w"}  # The same inner chunks: linked.
    path = tmp_path / "2" / "pytree" / reuse.RECORD_FILE
    record = json.loads(path.read_text())
    signature = json.loads(record["arrays"]["w"]["signature"])
    signature[5] = repr(_inner_chunks(32).storage_options)
    record["arrays"]["w"]["signature"] = json.dumps(signature)
    path.write_text(json.dumps(record))
    cp.metadata_checksums.record(tmp_path / "2")
    with cp.Context(array_options=_inner_chunks(32)):
        cp.save_pytree(tmp_path / "4", tree, reuse_from=tmp_path / "2")
    assert linked_names(tmp_path / "4") == set()
    loaded = cp.load_pytree(tmp_path / "4")
    assert np.asarray(loaded["w"]).tobytes() == np.asarray(tree["w"]).tobytes()
    assert _problems(tmp_path / "4") == []
