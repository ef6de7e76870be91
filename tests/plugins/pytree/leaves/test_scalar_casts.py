"""A scalar abstract leaf of another type converts a stored scalar only where the value survives.

``2.0`` loads as ``2`` given ``0``, ``3`` as ``3.0`` given ``0.0``; ``2.5`` given
``0`` (or ``300`` given ``np.int8(0)``, ``1+2j`` given ``0.0``) raises
``TreeMismatchError`` naming the key path and the cast to ask for: a 0-d
array abstract leaf, which casts as arrays do.
"""

from __future__ import annotations

import math

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_STORED = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-1e6, 1e6).map(round).map(float),  # Whole floats: they convert to ints.
    st.complex_numbers(allow_nan=False, allow_infinity=False, max_magnitude=1e300),
    st.integers(-300, 300).map(np.int16),
    st.floats(-1e5, 1e5, width=32).map(np.float32),
)
_TARGETS = [0, 0.0, False, 0j, int, float, np.int8(0), np.uint16(0), np.int64(0)]
_TARGETS += [np.float16(0), np.float32(0), np.float64(0), np.complex64(0)]


def _number(x) -> complex | int:
    return int(x) if isinstance(x, (int, np.integer, np.bool_)) else complex(x)


def _kept(stored, loaded, target_type) -> bool:
    """Whether ``loaded`` is ``stored`` (rounded to the precision of a float type)."""
    a, b = _number(stored), _number(loaded)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    a, b = complex(a), complex(b)
    if np.dtype(target_type).kind in "fc":
        eps = np.finfo(target_type).eps
        tiny = np.finfo(target_type).smallest_subnormal
        return math.isclose(a.real, b.real, rel_tol=eps, abs_tol=tiny) and math.isclose(
            a.imag, b.imag, rel_tol=eps, abs_tol=tiny
        )
    return a == b


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stored=_STORED)
def test_a_scalar_loads_as_another_type_only_with_its_value(tmp_path_factory, stored) -> None:
    path = tmp_path_factory.mktemp("c") / "c"
    cp.save_pytree(path, {"x": stored})
    for target in _TARGETS:
        target_type = target if isinstance(target, type) else type(target)
        try:
            loaded = cp.load_pytree(path, {"x": target})["x"]
        except cp.errors.TreeMismatchError as e:
            assert "['x']" in str(e) and "np.empty((), " in str(e)
            continue
        assert type(loaded) is target_type
        assert _kept(stored, loaded, target_type), (stored, target, loaded)


@pytest.mark.parametrize(
    ("stored", "abstract", "why"),
    [
        (2.5, 0, "not a whole number"),
        (2.5, int, "not a whole number"),
        (300, np.int8(0), "outside"),
        (-1, np.uint16(0), "outside"),
        (1 + 2j, 0.0, "imaginary part"),
        (2, False, "not 0 or 1"),
        (1e300, np.float32(0), "outside"),
        (float("nan"), 0, "not a whole number"),
    ],
)
def test_a_conversion_that_changes_the_value_raises(tmp_path, stored, abstract, why) -> None:
    cp.save_pytree(tmp_path / "c", {"opt": {"lr": stored}})
    with pytest.raises(cp.errors.TreeMismatchError, match=why) as raised:
        cp.load_pytree(tmp_path / "c", {"opt": {"lr": abstract}})
    assert "['opt']['lr']" in str(raised.value)


def test_a_zero_d_array_abstract_leaf_asks_for_the_cast(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"lr": 2.5, "step": 300})
    loaded = cp.load_pytree(
        tmp_path / "c",
        {"lr": np.empty((), np.int64), "step": jax.ShapeDtypeStruct((), jnp.int8)},
    )
    assert int(loaded["lr"]) == 2 and loaded["step"].dtype == jnp.int8
    # Whole values convert as scalars too.
    assert cp.load_pytree(tmp_path / "c", {"lr": 0.0, "step": 0.0}) == {"lr": 2.5, "step": 300.0}
