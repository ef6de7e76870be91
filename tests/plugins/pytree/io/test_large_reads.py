"""Arrays read in groups by the reading threads (``_read``, ``_local_reads``)."""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables_pytree import io
from checkpointables_pytree.io import ArrayRead, StoredArray

from ..opens import load_recording_opens

# Tests of the OCDBT fast path itself: on even where CI turns it off.
pytestmark = pytest.mark.fast_path

_RNG = np.random.default_rng(11)


def _tree(count: int = 24) -> dict[str, np.ndarray]:
    # Over 256 KiB each: groups of a few arrays.
    return {f"w{i:02d}": _RNG.standard_normal(40_000 + 1000 * i) for i in range(count)}


def test_every_array_of_many_groups_is_read_and_each_data_file_opened_once(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "c", tree)
    loaded, data_opens = load_recording_opens(tmp_path / "c")
    assert data_opens, "the direct read path was not taken"
    assert len(data_opens) == len(set(data_opens)), "a data file was opened more than once"
    assert loaded.keys() == tree.keys()
    for key, value in tree.items():
        np.testing.assert_array_equal(loaded[key], value)


def test_arrays_sharing_a_group_buffer_are_aligned_writable_and_independent(tmp_path) -> None:
    tree = _tree(6)
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    for value in loaded.values():
        assert value.ctypes.data % 64 == 0  # jax.device_put aliases such buffers on CPU.
        assert value.flags.writeable
    loaded["w00"][:] = 0  # Writing one array leaves its neighbours in the buffer alone.
    for key in list(tree)[1:]:
        np.testing.assert_array_equal(loaded[key], tree[key])


def test_jax_arrays_of_a_group_come_back_on_the_default_device(tmp_path) -> None:
    tree = {k: jax.numpy.asarray(v) for k, v in _tree(8).items()}
    cp.save_pytree(tmp_path / "c", tree)
    loaded = cp.load_pytree(tmp_path / "c")
    for key, value in tree.items():
        assert isinstance(loaded[key], jax.Array)
        assert loaded[key].devices() == {jax.devices()[0]}
        np.testing.assert_array_equal(np.asarray(loaded[key]), np.asarray(value))


def test_a_damaged_array_in_one_group_is_named_alone(tmp_path) -> None:
    tree = _tree()
    cp.save_pytree(tmp_path / "c", tree)
    target = tree["w13"].tobytes()[8000:8064]
    for data_file in (tmp_path / "c" / "pytree" / "d").iterdir():
        raw = bytearray(data_file.read_bytes())
        at = raw.find(target)
        if at >= 0:
            raw[at + 5] ^= 0x10
            data_file.write_bytes(bytes(raw))
            break
    else:
        pytest.fail("the array's bytes were not found in any data file")
    with pytest.raises(cp.errors.IntegrityError, match=r"\['w13'\]") as raised:
        cp.load_pytree(tmp_path / "c")
    assert "w12" not in str(raised.value) and "w14" not in str(raised.value)


def _read(name: str, nbytes: int) -> ArrayRead:
    shape = (nbytes // 4,)
    stored = StoredArray(shape, np.dtype(np.float32), shape, direct=True)
    return ArrayRead(label=name, name=name, stored=stored, convert=lambda pieces: pieces[0])


@pytest.mark.parametrize(
    ("sizes", "expected_groups"),
    [
        ([1 << 20] * 64, 8),  # 64 MiB: 8 MiB groups give each of 2 threads 4 tasks.
        ([64 << 20] * 3, 3),  # Arrays larger than a group are groups of their own.
        ([300 << 10] * 4, 1),  # Under MIN_GROUP_BYTES in all: one task.
    ],
)
def test_groups_cover_every_read_once_in_similar_sizes(sizes, expected_groups) -> None:
    reads = [_read(f"a{i}", n) for i, n in enumerate(sizes)]
    groups = io.read_groups([(r, r.chunk_keys) for r in reads], {}, threads=2)
    assert [r for g in groups for r, _ in g] == reads
    assert len(groups) == expected_groups
