"""An array's ``zarr.json`` edited to contradict its stored chunks (a data type or chunk
shape of another size, codecs the chunks were not written with, a fill value or rank
against itself).

Loads raise ``MetadataError`` (or ``IntegrityError`` where the chunk, which carries no
checksum in Orbax's checkpoints, may be the damaged one) through every read path, never
a bare ``CheckpointError``, and never return other values of a checkpoint this library
wrote; ``pytree_metadata`` refuses what the zarr.json alone shows is wrong.
"""

from __future__ import annotations

import json
import shutil

import checkpointables as cp
import checkpointables_pytree
import numpy as np
import pytest
import tensorstore as ts
from checkpointables_pytree import ocdbt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

STATE = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int32)}
PATHS = {
    "fast": cp.Context(),
    "driver": cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=False)),
    "budget": cp.Context(memory_options=cp.options.MemoryOptions(host_bytes=8 << 20)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same tree written by Orbax, by this library, and by it compressed (read by the
    zarr3 driver): ``{kind: (checkpoint, pytree directory)}``."""
    from orbax.checkpoint import v1 as ocp_v1

    root = tmp_path_factory.mktemp("saved")
    ocp_v1.save(root / "orbax", STATE)
    cp.save_pytree(root / "own", STATE)
    with cp.Context(array_options=cp.options.ArrayOptions(use_compression=True)):
        cp.save_pytree(root / "compressed", STATE)
    return {
        k: (root / k, "state" if k == "orbax" else "pytree") for k in ("orbax", "own", "compressed")
    }


def _edited(saved, kind: str, target, change) -> str:
    """A copy of the ``kind`` checkpoint whose ``a/zarr.json`` ``change`` edited (checksums
    recorded again for ours: the edit is vouched for, as an attacker would)."""
    source, pytree = saved[kind]
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    spec = ocdbt.kvstore_spec(target / pytree)
    kvstore = ts.KvStore.open(spec, context=ocdbt.make_context()).result()
    document = json.loads(kvstore.read("a/zarr.json").result().value)
    change(document)
    kvstore.write("a/zarr.json", json.dumps(document).encode()).result()
    if kind != "orbax":
        checkpointables_pytree.record_checksums_again(target)
    return str(target)


def _chunk(shape):
    def change(document):
        document["chunk_grid"]["configuration"]["chunk_shape"] = shape
        document["codecs"][0]["configuration"]["chunk_shape"] = shape

    return change


def _load(checkpoint: str, how: str):
    with PATHS[how]:
        return cp.load_pytree(checkpoint)


@pytest.mark.orbax
@pytest.mark.parametrize("how", sorted(PATHS))
@pytest.mark.parametrize(
    ("change", "held", "needed"),
    [
        (lambda d: d.update(data_type="int64", fill_value=0), "48", "96"),
        (_chunk([100, 100]), "48", "40,000"),
        (lambda d: d.update(data_type="int16", fill_value=0), "48", "24"),
    ],
    ids=["int64", "chunk_100x100", "int16"],
)
def test_a_zarr_json_claiming_chunks_of_another_size_is_a_metadata_error(
    saved, tmp_path, how, change, held, needed
) -> None:
    checkpoint = _edited(saved, "orbax", tmp_path / "c", change)
    with pytest.raises(cp.errors.MetadataError) as raised:
        _load(checkpoint, how)
    message = str(raised.value)
    for part in (checkpoint, "['a']", "a/zarr.json", f"holds {held} bytes", f"needs {needed}"):
        assert part in message
    assert "restore the checkpoint from a copy" in message


@pytest.mark.orbax
@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda d: d.update(data_type="bool"), "fill_value"),
        (lambda d: d.update(shape=[3, 4, 1]), "rank"),
    ],
    ids=["bool_with_a_float_fill", "rank3"],
)
def test_a_zarr_json_against_itself_is_refused_by_loads_and_metadata(
    saved, tmp_path, change, said
) -> None:
    checkpoint = _edited(saved, "orbax", tmp_path / "c", change)
    for how in PATHS:
        with pytest.raises(cp.errors.MetadataError, match=r"a/zarr\.json .* is malformed"):
            _load(checkpoint, how)
    with pytest.raises(cp.errors.MetadataError, match=said) as info:
        cp.pytree_metadata(checkpoint)
    assert str(checkpoint) in str(info.value) and "['a']" in str(info.value)


def test_ours_with_a_big_endian_or_transposing_codec_is_refused_not_misread(
    saved, tmp_path
) -> None:
    def big_endian(document):
        document["codecs"][0]["configuration"]["codecs"][0]["configuration"] = {"endian": "big"}

    def transpose(document):
        codecs = document["codecs"][0]["configuration"]["codecs"]
        codecs.insert(0, {"name": "transpose", "configuration": {"order": [1, 0]}})

    for n, change in enumerate((big_endian, transpose)):
        checkpoint = _edited(saved, "compressed", tmp_path / f"c{n}", change)
        for how in PATHS:
            with pytest.raises(cp.errors.MetadataError, match="never writes") as raised:
                _load(checkpoint, how)
            assert "['a']" in str(raised.value)


def test_ours_uncompressed_ignores_its_zarr_json_and_metadata_reports_metadata(
    saved, tmp_path
) -> None:
    # Its chunks are read as _METADATA (checksummed) records them: the edit changes nothing.
    checkpoint = _edited(saved, "own", tmp_path / "c", lambda d: d.update(data_type="int64"))
    for how in PATHS:
        np.testing.assert_array_equal(_load(checkpoint, how)["a"], STATE["a"])
    found = cp.pytree_metadata(checkpoint).metadata["a"]
    assert (found.shape, found.dtype) == ((3, 4), np.float32)


_EDITS = st.one_of(
    st.tuples(
        st.just("data_type"),
        st.sampled_from(["int64", "bool", "int16", "int32", "uint8", "float64", "int4"]),
    ),
    st.tuples(st.just("fill_value"), st.sampled_from([0, 0.0, False, [0.0, 0.0], "NaN"])),
    st.tuples(st.just("shape"), st.lists(st.integers(1, 8), min_size=1, max_size=3)),
    st.tuples(st.just("chunk_shape"), st.lists(st.integers(1, 9), min_size=2, max_size=2)),
    st.tuples(st.just("codec"), st.sampled_from(["big", "zstd", "gzip", "no_zstd", "no_crc32c"])),
)


def _apply(document, edit) -> None:
    field, value = edit
    inner = document["codecs"][0]["configuration"]["codecs"]
    if field == "chunk_shape":
        _chunk(value)(document)
    elif field != "codec":
        document[field] = value
    elif value == "big":
        inner[0]["configuration"] = {"endian": "big"}
    elif value in ("zstd", "gzip"):
        inner.insert(1, {"name": value, "configuration": {"level": 1}})
    else:
        inner[:] = [c for c in inner if c["name"] != value[3:]]


@pytest.mark.orbax
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["orbax", "own", "compressed"]),
    edits=st.lists(_EDITS, min_size=1, max_size=2),
)
def test_random_zarr_json_edits_raise_a_documented_error_or_load_what_was_saved(
    saved, tmp_path, kind, edits
) -> None:
    checkpoint = _edited(saved, kind, tmp_path / "c", lambda d: [_apply(d, e) for e in edits])
    for how in ("fast", "driver"):
        try:
            loaded = _load(checkpoint, how)["a"]
        except (cp.errors.MetadataError, cp.errors.IntegrityError):
            continue
        if kind != "orbax":  # Orbax records no layout, nor a checksum of its data.
            assert loaded.dtype == np.float32
            np.testing.assert_array_equal(loaded, STATE["a"])
