"""``cp.safe_json``: untrusted JSON from checkpoints, and caller values checked before a save."""

from __future__ import annotations

import pickle

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
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


def test_numpy_and_jax_scalars_become_python_numbers():
    value = {
        "lr": np.float32(0.5),
        "steps": np.int64(5),
        "ok": np.bool_(True),
        "loss": jnp.float32(2.5),
        "zero_d": np.array(3),
        "cfg": {"betas": (np.float64(0.9), 0.99)},
    }
    ready = cp.safe_json.to_json_value(value, what="custom_metadata")
    assert ready == {
        "lr": 0.5,
        "steps": 5,
        "ok": True,
        "loss": 2.5,
        "zero_d": 3,
        "cfg": {"betas": [0.9, 0.99]},
    }
    assert [type(v) for v in ready.values()][:5] == [float, int, bool, float, int]
    assert cp.safe_json.dumps_checked({"lr": np.float32(0.5)}, what="custom_metadata") == (
        '{"lr": 0.5}'
    )
    one = cp.safe_json.to_json_value([np.ones(1)], what="metrics", one_element_arrays=True)
    assert one == [1.0]


def test_what_json_cannot_store_is_named_by_its_key_path():
    cases = [
        ({"cfg": {"lr": np.ones(3)}}, r"custom_metadata\['cfg'\]\['lr'\] is a ndarray of shape"),
        ({"a": [1, {1, 2}]}, r"custom_metadata\['a'\]\[1\] is a set"),
        ({"when": np.datetime64("2020-01-01")}, r"custom_metadata\['when'\] is a datetime64"),
        ({(1, 2): 3}, r"custom_metadata has the key \(1, 2\)"),
    ]
    for value, message in cases:
        with pytest.raises(cp.errors.InvalidArgumentError, match=message) as info:
            cp.safe_json.to_json_value(value, what="custom_metadata")
        assert "JSON-serializable" in str(info.value) and "tolist()" in str(info.value)


def test_save_stores_numpy_scalars_of_custom_metadata_and_names_a_bad_key(tmp_path):
    state = {"w": np.ones(2)}
    custom = {"lr": np.float32(0.25), "cfg": {"seed": jnp.int32(7)}}
    cp.save_pytree(tmp_path / "a", state, custom_metadata=custom)
    assert cp.pytree_metadata(tmp_path / "a").custom_metadata == {"lr": 0.25, "cfg": {"seed": 7}}
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"custom_metadata\['cfg'\]\['w'\]"):
        cp.save_pytree(tmp_path / "b", state, custom_metadata={"cfg": {"w": np.ones(2)}})
    assert not (tmp_path / "b").exists()


def test_string_keys_refuses_keys_json_would_give_back_as_strings():
    # custom_metadata keeps taking them (json.dumps writes 1 as "1"); metrics ask for strings.
    assert cp.safe_json.to_json_value({1: 2.0, None: 3}, what="custom_metadata") == {
        1: 2.0,
        None: 3,
    }
    for key in (1, 2.5, None):
        with pytest.raises(cp.errors.InvalidArgumentError, match=r"its keys must be strings") as e:
            cp.safe_json.to_json_value({"a": {key: 1}}, what="metrics", string_keys=True)
        assert f"metrics['a'] has the key {key!r}" in str(e.value)
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"\['a'\] is an ArrayImpl of shape"):
        cp.safe_json.to_json_value({"a": jnp.ones(2)}, what="x")
