"""The pytree plugin's option classes check their fields when they are built, and
``shard_axes`` against each array when a save chunks it."""

from __future__ import annotations

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

OPT = cp.options


def _not_a_dtype(text: str) -> bool:
    try:
        np.dtype(text)
    except (TypeError, ValueError):
        return True
    return False


@pytest.mark.parametrize(
    ("cls", "field", "value", "allowed"),
    [
        (OPT.ArrayStorageOptions, "dtype", "floaty", "a dtype zarr3 can store"),
        (OPT.ArrayStorageOptions, "dtype", object, "a dtype zarr3 can store"),
        (OPT.ArrayStorageOptions, "chunk_byte_size", -5, "an int >= 1"),
        (OPT.ArrayStorageOptions, "chunk_byte_size", 0, "an int >= 1"),
        (OPT.ArrayStorageOptions, "chunk_byte_size", "1MB", "an int >= 1"),
        (OPT.ArrayStorageOptions, "shard_axes", 1, "a tuple of array axes"),
        (OPT.ArrayStorageOptions, "shard_axes", (0.5,), "a tuple of array axes"),
        (OPT.ArrayOptions, "storage_options", {"dtype": "int8"}, "ArrayStorageOptions"),
        (OPT.ArrayOptions, "storage_options_creator", "float16", "a function"),
        (OPT.ArrayOptions, "use_compression", "zstd", "True or False"),
        (OPT.ArrayOptions, "verify_checksums", 0, "True or False"),
        (OPT.StorageOptions, "request_concurrency", 0, "int >= 1"),
        (OPT.StorageOptions, "request_timeout_secs", -1, "seconds > 0"),
        (OPT.StorageOptions, "region", 1, "a str or None"),
        (OPT.StorageOptions, "anonymous", "yes", "True or False"),
        (OPT.StorageOptions, "endpoint", "minio:9000", "http:// or https://"),
    ],
)
def test_a_bad_option_is_refused_where_it_is_built(cls, field, value, allowed) -> None:
    with pytest.raises(cp.errors.InvalidArgumentError) as info:
        cls(**{field: value})
    assert str(info.value).startswith(f"{cls.__name__}.{field}={value!r} ")
    assert allowed in str(info.value)


def test_secrets_are_not_shown_in_errors() -> None:
    with pytest.raises(cp.errors.InvalidArgumentError, match="secret_access_key=<a bytes>") as info:
        OPT.StorageOptions(access_key_id="id", secret_access_key=b"s3cr3t")  # type: ignore[arg-type]
    assert "s3cr3t" not in str(info.value)


def test_good_options_are_kept() -> None:
    storage = OPT.ArrayStorageOptions(
        dtype=jnp.bfloat16, chunk_byte_size=np.int64(4096), shard_axes=[0, -1]
    )
    assert storage.shard_axes == (0, -1) and storage.chunk_byte_size == 4096
    assert OPT.ArrayStorageOptions(dtype="int8").dtype == "int8"
    options = OPT.ArrayOptions(storage_options=storage, storage_options_creator=lambda k, v: None)
    assert options.storage_options is storage


def test_a_dtype_that_is_not_one_fails_before_the_save_not_on_a_leaf(tmp_path) -> None:
    # It used to be accepted, and the save blamed the first leaf's own dtype.
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"ArrayStorageOptions.dtype='floaty'"):
        OPT.ArrayOptions(storage_options=OPT.ArrayStorageOptions(dtype="floaty"))


def test_shard_axes_an_array_lacks_name_its_key_path_at_save_time(tmp_path) -> None:
    storage = OPT.ArrayStorageOptions(chunk_byte_size=64, shard_axes=(5,))
    state = {"params": {"w": np.ones((8, 8), np.float32)}}
    with (
        cp.Context(array_options=OPT.ArrayOptions(storage_options=storage)),
        pytest.raises(cp.errors.InvalidArgumentError) as info,
    ):
        cp.save_pytree(tmp_path / "c", state)
    message = str(info.value)
    assert "['params']['w']" in message and "2-d array" in message
    assert "shard_axes=(5,)" in message and "storage_options_creator" in message
    assert not cp.is_checkpoint(tmp_path / "c")
    # Negative axes count from the end; arrays that fit one chunk (a bias, a step) are not
    # split, so global options may name axes they lack.
    storage = OPT.ArrayStorageOptions(chunk_byte_size=64, shard_axes=(-1, 1))
    small = {"b": np.ones(4, np.float32), "step": np.int32(3)}
    with cp.Context(array_options=OPT.ArrayOptions(storage_options=storage)):
        cp.save_pytree(tmp_path / "d", {**state, **small})
    np.testing.assert_array_equal(
        cp.load_pytree(tmp_path / "d")["params"]["w"], state["params"]["w"]
    )


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.tuples(
            st.just("chunk_byte_size"),
            st.integers(max_value=0) | st.floats() | st.text(max_size=3) | st.booleans(),
        ),
        st.tuples(
            st.just("shard_axes"),
            st.integers() | st.lists(st.floats() | st.text(max_size=2), min_size=1, max_size=2),
        ),
        st.tuples(st.just("dtype"), st.text(min_size=1, max_size=6).filter(_not_a_dtype)),
    )
)
def test_any_bad_storage_value_is_an_invalid_argument(case) -> None:
    field, value = case
    with pytest.raises(cp.errors.InvalidArgumentError, match=f"ArrayStorageOptions.{field}="):
        OPT.ArrayStorageOptions(**{field: value})


# The plugin's numeric fields, with makers of NumPy and JAX scalars of each kind they take.
_INTS = [np.int16, np.int64, np.array, jnp.int32, jnp.uint16, jnp.asarray]
NUMERIC = [
    (OPT.ArrayStorageOptions, "chunk_byte_size", st.integers(1, 30000), _INTS),
    (OPT.StorageOptions, "request_concurrency", st.integers(1, 1000), _INTS),
    (OPT.StorageOptions, "request_retries", st.integers(1, 1000), _INTS),
    (OPT.StorageOptions, "request_timeout_secs", st.integers(1, 1000), [*_INTS, jnp.float32]),
]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_numpy_and_jax_scalars_are_taken_as_python_numbers(data) -> None:
    cls, field, values, makers = data.draw(st.sampled_from(NUMERIC))
    value, make = data.draw(values), data.draw(st.sampled_from(makers))
    options = cls(**{field: make(value)})
    assert type(getattr(options, field)) in (int, float) and getattr(options, field) == value
    assert options == cls(**{field: value}) and "Array(" not in repr(options)
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=r"has shape \(2,\)"):
        cls(**{field: jnp.asarray([value, value])})


def test_shard_axes_may_be_jax_scalars_or_a_jax_array() -> None:
    storage = OPT.ArrayStorageOptions(chunk_byte_size=jnp.int32(64), shard_axes=jnp.array([0, -1]))
    assert storage == OPT.ArrayStorageOptions(chunk_byte_size=64, shard_axes=(0, -1))
    assert [type(a) for a in storage.shard_axes] == [int, int]
    assert OPT.ArrayStorageOptions(shard_axes=[np.int8(1), jnp.int32(2)]).shard_axes == (1, 2)
    for bad in (jnp.int32(1), [jnp.float32(0.5)], [jnp.ones(2, int)]):
        with pytest.raises(cp.errors.InvalidArgumentError, match="a tuple of array axes"):
            OPT.ArrayStorageOptions(shard_axes=bad)
