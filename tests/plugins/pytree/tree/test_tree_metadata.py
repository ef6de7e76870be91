"""``_METADATA``'s text: built by hand for speed, it must be the JSON encoder's text exactly."""

from __future__ import annotations

import json

import pytest
from checkpointables_pytree import tree
from checkpointables_pytree.tree import Entry, TreeMetadata


def _entries() -> list[Entry]:
    return [
        Entry(
            names=("params", "dense", "kernel"),
            key_types=(tree.DICT,) * 3,
            value_type="jax.Array",
            write_shape=(4, 2),
            extra={"shape": [4, 2], "dtype": "float32", "one_chunk_shards": True, "crc32": [7]},
        ),
        Entry(
            names=("layers", "0", 'quote"d \\ ünïcode'),
            key_types=(tree.DICT, tree.SEQUENCE, tree.DICT),
            value_type="np.ndarray",
            extra={"nested": {"a": [1.5, None, "x"]}, "nan": float("nan"), "flag": False},
        ),
        Entry(names=("step",), key_types=(tree.DICT,), value_type="scalar"),
        Entry(names=("empty",), key_types=(tree.DICT,), value_type="dict", skip_deserialize=True),
    ]


def _expected(metadata: TreeMetadata) -> str:
    text = metadata.to_json_text()
    document = json.loads(text)
    document["tree_metadata"] = {str(e.names): e.to_json() for e in metadata.entries}
    return json.dumps(document, separators=(",", ":"))


@pytest.mark.parametrize("c_encoder", [True, False])
def test_text_is_the_json_encoders(monkeypatch, c_encoder) -> None:
    if not c_encoder:  # A Python without the json C accelerator.
        monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    metadata = TreeMetadata(entries=_entries(), tuple_paths=frozenset({("layers",)}))
    assert metadata.to_json_text() == _expected(metadata)


def test_an_unencodable_extra_raises_type_error() -> None:
    entry = Entry(names=("x",), key_types=(tree.DICT,), value_type="scalar", extra={"o": object()})
    with pytest.raises(TypeError, match="not JSON serializable"):
        TreeMetadata(entries=[entry]).to_json_text()
