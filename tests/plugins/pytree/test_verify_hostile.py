"""``checkpointables verify`` on hostile or unprotected checkpoints: it finishes, in bounded
memory, names what is wrong, and says what it could not check.

An Orbax checkpoint's ``_METADATA`` records no shapes, so verify walks each array's
chunks as its ``zarr.json`` says: a claimed shape of 2**62 elements must be refused
before any walk. Orbax's arrays carry no checksum of their chunk data (zarr3's CRC-32C
of a shard covers its index only): verify notes that their values are unchecked. (A
b-tree node that names itself as its child: ``ocdbt/test_index_walk.py``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import checkpointables as cp
import numpy as np
import pytest
import tensorstore as ts
from checkpointables import _verification
from checkpointables_pytree import _handler, _verify, ocdbt
from etils import epath


def _problems(checkpoint) -> list[str]:
    return [f.problem for f in _verification.verify_checkpoint(checkpoint) if f.problem]


def _verify_pytree(directory) -> tuple[list[str], list[str]]:
    """The problems and the notes of a verify of the pytree in ``directory``."""
    notes: list[str] = []
    problems = asyncio.run(
        _verify.verify_pytree(epath.Path(directory), _handler.leaf_registry(), notes)
    )
    return problems, notes


@pytest.fixture(scope="module")
def orbax_saved(tmp_path_factory):
    """An Orbax-written checkpoint of a 2x3 array (chunks [2, 3]) and a larger one."""
    from orbax.checkpoint import v1 as ocp_v1

    directory = tmp_path_factory.mktemp("orbax") / "ckpt"
    state = {
        "a": np.arange(6, dtype=np.int32).reshape(2, 3),
        "r": np.random.default_rng(0).standard_normal(50_000).astype(np.float32),
    }
    ocp_v1.save(directory, state)
    return directory, state


def _copy(orbax_saved, tmp_path):
    source, state = orbax_saved
    shutil.copytree(source, tmp_path / "ckpt")
    return tmp_path / "ckpt", state


def _edit_zarr_json(database, array: str, change) -> None:
    kvstore = ts.KvStore.open(ocdbt.kvstore_spec(database), context=ocdbt.make_context()).result()
    document = json.loads(kvstore.read(f"{array}/zarr.json").result().value)
    change(document)
    kvstore.write(f"{array}/zarr.json", json.dumps(document).encode()).result()


@pytest.mark.orbax
@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ([2**31, 2**31], "18,446,744,073,709,551,616"),  # Walked chunk by chunk: endless.
        ([2**62, 3], "55,340,232,221,128,654,848"),  # A MemoryError, reported as ''.
    ],
)
def test_a_zarr_json_claiming_more_chunks_than_stored_is_refused_before_any_walk(
    orbax_saved, tmp_path, shape, nbytes
) -> None:
    checkpoint, _ = _copy(orbax_saved, tmp_path)
    _edit_zarr_json(checkpoint / "state", "a", lambda z: z.update(shape=shape))
    (problem,) = _problems(checkpoint)
    assert "array 'a'" in problem
    assert f"({nbytes} bytes)" in problem
    assert "restore the checkpoint from a copy" in problem


@pytest.mark.orbax
def test_orbax_arrays_are_noted_as_unchecked_and_a_flipped_bit_in_them_is_not_a_failure(
    orbax_saved, tmp_path
) -> None:
    checkpoint, state = _copy(orbax_saved, tmp_path)
    (shard,) = asyncio.run(ocdbt.locate(checkpoint / "state", ["r/c/0"])).values()
    with open(shard.file, "r+b") as f:  # A bit in the middle of the zstd-compressed chunk.
        f.seek(shard.offset + shard.length // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))
    assert np.count_nonzero(cp.load_pytree(checkpoint)["r"] != state["r"]) == 1  # Silently.
    problems, notes = _verify_pytree(checkpoint / "state")
    assert problems == []
    (note,) = notes
    assert note.startswith("2 array(s) carry no checksum of their chunk data")
    assert "'a', 'r'" in note
    report = [f for f in _verification.verify_checkpoint(checkpoint) if f.subject == "state"]
    assert [(f.problem, f.note) for f in report] == [(None, f"ok; {note}")]  # Said by verify.


def test_our_arrays_carry_checksums_and_get_no_note(tmp_path) -> None:
    # Plain shards (read in batches), and compressed ones (read through the zarr3 driver).
    tree = {"a": np.arange(6), "b": np.ones((3, 4), np.float32)}
    compressed = cp.Context(array_options=cp.options.ArrayOptions(use_compression=True))
    with compressed:
        cp.save_pytree(tmp_path / "compressed", tree)
    cp.save_pytree(tmp_path / "plain", tree)
    for name in ("compressed", "plain"):
        assert _verify_pytree(tmp_path / name / "pytree") == ([], [])
