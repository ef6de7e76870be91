"""``cp.safe_json``: untrusted JSON from checkpoints, and caller values checked before a save."""

from __future__ import annotations

import pickle

import checkpointables as cp
import pytest


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\xff\xfe{}", "not UTF-8 text"),
        (pickle.dumps({"a": 1}), "not UTF-8 text"),
        (b"{not json", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_garbage_is_a_metadata_error_naming_the_source(data, problem):
    with pytest.raises(cp.errors.MetadataError, match=problem) as info:
        cp.safe_json.loads(data, source="/ckpt/_METADATA")
    assert str(info.value).startswith("/ckpt/_METADATA ")
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_objects_are_parsed_and_other_values_refused():
    assert cp.safe_json.loads_object(b'{"a": [1, 2.5, null]}', source="f") == {"a": [1, 2.5, None]}
    with pytest.raises(cp.errors.MetadataError, match="holds a JSON list, expected an object"):
        cp.safe_json.loads_object("[1]", source="f")


def test_values_to_save_must_be_json():
    assert cp.safe_json.dumps_checked({"a": [1]}, what="custom_metadata") == '{"a": [1]}'
    looped: dict = {}
    looped["self"] = looped
    for value in ({"a": object()}, looped):
        with pytest.raises(cp.errors.InvalidArgumentError, match="custom_metadata"):
            cp.safe_json.dumps_checked(value, what="custom_metadata")
