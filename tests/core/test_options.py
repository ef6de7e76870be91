"""Core's option classes check every field when they are built, naming the class, the field,
the value and what the field takes (``cp.errors.InvalidArgumentError``)."""

from __future__ import annotations

import math
import warnings

import attrs
import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

OPT = cp.options

# (class, field, a value it refuses, words of what it takes), as a user would get them wrong.
BAD = [
    (OPT.AsyncOptions, "timeout_secs", -1, "seconds > 0"),
    (OPT.AsyncOptions, "timeout_secs", "10", "seconds > 0"),
    (OPT.AsyncOptions, "timeout_secs", math.inf, "finite"),  # Waits overflow on inf.
    (OPT.AsyncOptions, "timeout_secs", math.nan, "finite"),
    (OPT.AsyncOptions, "timeout_secs", True, "seconds > 0"),
    (OPT.FileOptions, "path_permission_mode", "0o750", "not the string '0o750'"),
    (OPT.FileOptions, "path_permission_mode", -1, "from 0 to 0o7777"),
    (OPT.FileOptions, "path_permission_mode", 0o10000, "from 0 to 0o7777"),
    (OPT.FileOptions, "path_permission_mode", 7.5, "from 0 to 0o7777"),
    (OPT.MultiprocessingOptions, "primary_host", -1, "int >= 0 or None"),
    (OPT.MultiprocessingOptions, "primary_host", "0", "int >= 0 or None"),
    (OPT.MultiprocessingOptions, "active_processes", 3, "process indices"),
    (OPT.MultiprocessingOptions, "active_processes", [0, -1], "process indices"),
    (OPT.MultiprocessingOptions, "active_processes", "01", "process indices"),
    (OPT.MultiprocessingOptions, "barrier_sync_key_prefix", 7, "a str or None"),
    (OPT.PyTreeOptions, "partial_load", "no", "True or False"),
    (OPT.PyTreeOptions, "partial_load", 1, "True or False"),
    (OPT.MemoryOptions, "host_bytes", 1 << 20, str(OPT.MIN_HOST_BYTES)),
    (OPT.MemoryOptions, "host_bytes", 1.5e9, str(OPT.MIN_HOST_BYTES)),
    (OPT.CheckpointablesOptions, "handlers", {"state": 3}, "handler class"),
    (OPT.CheckpointablesOptions, "handlers", {1: "json"}, "checkpointable name"),
    (OPT.CheckpointablesOptions, "handlers", ["json"], "a dict"),
]


@pytest.mark.parametrize(("cls", "field", "value", "allowed"), BAD)
def test_a_bad_option_is_refused_where_it_is_built(cls, field, value, allowed) -> None:
    with pytest.raises(cp.errors.InvalidArgumentError) as info:
        cls(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{cls.__name__}.{field}={value!r} ")
    assert allowed in message


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (OPT.AsyncOptions, "timeout_secs", "10"),
        (OPT.FileOptions, "path_permission_mode", "0o750"),
        (OPT.PyTreeOptions, "partial_load", "no"),
        (OPT.MemoryOptions, "host_bytes", 1.5),
    ],
)
def test_a_value_of_the_wrong_type_is_a_type_error_too(cls, field, value) -> None:
    # As Python's own checks raise (and MemoryOptions did): both kinds of except catch it.
    with pytest.raises(cp.errors.InvalidArgumentTypeError):
        cls(**{field: value})
    with pytest.raises(TypeError):
        cls(**{field: value})


def test_good_options_are_kept_as_given() -> None:
    assert OPT.AsyncOptions(timeout_secs=np.float32(2.5)).timeout_secs == 2.5
    assert OPT.FileOptions(path_permission_mode=0o750).path_permission_mode == 0o750
    assert OPT.FileOptions(path_permission_mode=np.int64(0o700)).path_permission_mode == 0o700
    multi = OPT.MultiprocessingOptions(primary_host=None, active_processes=range(3))
    assert multi.active_processes == frozenset({0, 1, 2})
    assert OPT.MultiprocessingOptions(barrier_sync_key_prefix="run1").barrier_sync_key_prefix
    assert OPT.PyTreeOptions(partial_load=np.True_).partial_load
    assert OPT.MemoryOptions(host_bytes=OPT.MIN_HOST_BYTES).host_bytes == OPT.MIN_HOST_BYTES
    handlers = OPT.CheckpointablesOptions.create_with_handlers(extra="json").handlers
    assert handlers == {"extra": "json"}
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        OPT.AsyncOptions().timeout_secs = -1  # type: ignore[misc]


def test_a_bad_permission_mode_fails_before_a_save(tmp_path) -> None:
    # It used to be accepted, and the save then failed on a bare TypeError.
    bad = {"path_permission_mode": "0o750"}
    with (
        pytest.raises(cp.errors.InvalidArgumentError, match="not the string '0o750'"),
        cp.Context(file_options=OPT.FileOptions(**bad)),
    ):
        cp.save_pytree(tmp_path / "c", {"a": np.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_plugins_build_their_checks_from_the_public_validators() -> None:
    @attrs.frozen
    class LevelOptions:
        level: int = attrs.field(
            default=3,
            validator=OPT.option_validator(
                "an int from 1 to 9", kind=int, test=lambda v: 1 <= v <= 9
            ),
        )
        token: str | None = attrs.field(default=None, repr=False, validator=OPT.text_or_none())

    with pytest.raises(cp.errors.InvalidArgumentError, match=r"LevelOptions.level=12 \(int\)"):
        LevelOptions(level=12)
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="an int from 1 to 9"):
        LevelOptions(level=True)
    with pytest.raises(cp.errors.InvalidArgumentError) as info:
        LevelOptions(token=b"s3cr3t")  # type: ignore[arg-type]
    assert "s3cr3t" not in str(info.value) and "<a bytes>" in str(info.value)


# Values of the wrong type for every field that takes numbers, and numbers out of range.
_NOT_NUMBERS = st.one_of(
    st.text(max_size=5), st.binary(max_size=3), st.booleans(), st.lists(st.integers(), max_size=2)
)


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.tuples(
            st.just((OPT.AsyncOptions, "timeout_secs")), st.floats(max_value=0) | _NOT_NUMBERS
        ),
        st.tuples(
            st.just((OPT.MultiprocessingOptions, "primary_host")),
            st.integers(max_value=-1) | st.floats(allow_nan=True) | _NOT_NUMBERS,
        ),
        st.tuples(
            st.just((OPT.FileOptions, "path_permission_mode")),
            st.integers(min_value=0o10000) | st.integers(max_value=-1) | _NOT_NUMBERS,
        ),
        st.tuples(
            st.just((OPT.MemoryOptions, "host_bytes")),
            st.integers(max_value=OPT.MIN_HOST_BYTES - 1) | st.floats() | _NOT_NUMBERS,
        ),
        st.tuples(
            st.just((OPT.PyTreeOptions, "partial_load")),
            st.integers() | st.text(max_size=3) | st.none(),
        ),
    )
)
def test_any_bad_value_is_an_invalid_argument_naming_the_field(case) -> None:
    (cls, field), value = case
    with pytest.raises(cp.errors.InvalidArgumentError) as info:
        cls(**{field: value})
    assert f"{cls.__name__}.{field}=" in str(info.value) and "must be" in str(info.value)


# -- NumPy and JAX scalars ------------------------------------------------------------------
# A JAX user's numbers are 0-d jax.Arrays (jnp.int32(5), a config read through jnp); NumPy's
# are scalars. Every numeric field takes both, as the Python number they hold.

_INT_MAKERS = [np.int8, np.uint16, np.int32, np.int64, np.array, jnp.int32, jnp.uint8, jnp.asarray]
_REAL_MAKERS = [*_INT_MAKERS, np.float16, np.float32, np.float64, jnp.float32, jnp.bfloat16]

# (class, field, good Python values, makers of scalars holding them).
NUMERIC = [
    (OPT.AsyncOptions, "timeout_secs", st.integers(1, 100), _REAL_MAKERS),
    (OPT.MultiprocessingOptions, "primary_host", st.integers(0, 100), _INT_MAKERS),
    (OPT.FileOptions, "path_permission_mode", st.integers(0, 0o177), _INT_MAKERS),
    (OPT.MemoryOptions, "host_bytes", st.integers(OPT.MIN_HOST_BYTES, 2**31 - 1), _INT_MAKERS),
]


def _fits(maker, value) -> bool:
    # An int8 cannot hold 300: such a draw says nothing about the option.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return bool(np.asarray(maker(value)).item() == value)
    except (OverflowError, ValueError, RuntimeWarning, DeprecationWarning):
        return False


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_numpy_and_jax_scalars_are_taken_as_python_numbers(data) -> None:
    cls, field, values, makers = data.draw(st.sampled_from(NUMERIC))
    value = data.draw(values)
    maker = data.draw(st.sampled_from([m for m in makers if _fits(m, value)]))
    options = cls(**{field: maker(value)})
    stored = getattr(options, field)
    assert type(stored) in (int, float) and stored == value
    assert options == cls(**{field: value}) and hash(options) == hash(cls(**{field: value}))
    assert "Array(" not in repr(options) and "np." not in repr(options)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_an_array_that_is_not_0d_is_refused_naming_its_shape(data) -> None:
    cls, field, values, _ = data.draw(st.sampled_from(NUMERIC))
    shape = data.draw(st.sampled_from([(1,), (3,), (1, 1), (2, 0)]))
    make = data.draw(st.sampled_from([np.full, jnp.full]))
    array = make(shape, data.draw(values.filter(lambda v: v < 2**31)))
    with pytest.raises(cp.errors.InvalidArgumentTypeError) as info:
        cls(**{field: array})
    message = str(info.value)
    assert message.startswith(f"{cls.__name__}.{field}=") and f"has shape {shape}" in message


def test_a_jax_scalar_is_checked_as_the_number_it_holds() -> None:
    assert OPT.AsyncOptions(timeout_secs=jnp.float32(2.5)).timeout_secs == 2.5
    assert OPT.PyTreeOptions(partial_load=jnp.bool_(True)).partial_load is True
    multi = OPT.MultiprocessingOptions(active_processes=jnp.arange(3), primary_host=jnp.int32(2))
    assert multi.active_processes == frozenset({0, 1, 2}) and multi.primary_host == 2
    refused = [
        (OPT.AsyncOptions, "timeout_secs", jnp.float32(-1), "seconds > 0"),
        (OPT.AsyncOptions, "timeout_secs", jnp.float32(math.inf), "finite"),
        (OPT.AsyncOptions, "timeout_secs", jnp.bool_(True), "seconds > 0"),  # Not a number.
        (OPT.AsyncOptions, "timeout_secs", np.complex64(1), "seconds > 0"),
        (OPT.MemoryOptions, "host_bytes", jnp.int32(1 << 20), str(OPT.MIN_HOST_BYTES)),
        (OPT.PyTreeOptions, "partial_load", jnp.int32(1), "True or False"),
        (OPT.MultiprocessingOptions, "active_processes", jnp.int32(3), "process indices"),
        (OPT.MultiprocessingOptions, "active_processes", jnp.array([0, -1]), "process indices"),
    ]
    for cls, field, value, allowed in refused:
        with pytest.raises(cp.errors.InvalidArgumentError) as info:
            cls(**{field: value})
        # The value is named as given, not as the number it was checked as.
        assert str(info.value).startswith(f"{cls.__name__}.{field}={value!r} ")
        assert allowed in str(info.value)


def test_a_plugins_numeric_field_takes_jax_scalars_through_the_public_validators() -> None:
    @attrs.frozen
    class LevelOptions:
        level: int = attrs.field(
            default=3,
            validator=OPT.option_validator("an int", kind=int, test=lambda v: 1 <= v <= 9),
        )

    assert type(LevelOptions(level=jnp.int32(4)).level) is int
    assert OPT.python_scalar(jnp.float32(0.5)) == 0.5
    assert OPT.python_scalar("5") == "5" and OPT.python_scalar(np.ones(2)).shape == (2,)
