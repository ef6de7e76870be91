"""The OCDBT fast path behind one switch: off, TensorStore writes and reads every key.

``ArrayOptions.ocdbt_fast_path`` (or ``CHECKPOINTABLES_OCDBT_FAST_PATH=0``) decides
once per save and once per load. These tests make the fast path's entry points fail
loudly: with the switch off nothing of it may run, and the checkpoints of either
setting load bit-exact with the other and with Orbax.
"""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from checkpointables.cli import main as cli_main
from checkpointables_pytree import FAST_PATH_ENVIRONMENT_VARIABLE, ocdbt

OFF = cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=False))
ON = cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=True))


def _tree() -> dict:
    rng = np.random.default_rng(3)
    return {
        "small": {f"w{i}": rng.standard_normal(i + 1).astype(np.float32) for i in range(40)},
        "big": rng.standard_normal((512, 300)),  # Over the 1 KiB inline limit: a data file.
        "jax": jax.numpy.arange(1000, dtype=jax.numpy.bfloat16),
        "step": 7,
        "name": "run",
    }


def _assert_same(loaded, expected) -> None:
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(expected)
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(loaded), leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture
def fast_path_forbidden(monkeypatch) -> None:
    """Every entry point of the fast path raises: the database written here, its index."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the OCDBT fast path ran although it is off")

    monkeypatch.setattr(ocdbt.DatabaseFiles, "open", forbidden)
    monkeypatch.setattr(ocdbt.DatabaseLayout, "__init__", forbidden)
    monkeypatch.setattr(ocdbt.DatabaseIndex, "find", forbidden)
    monkeypatch.setattr(ocdbt.DatabaseIndex, "prefetch", forbidden)
    monkeypatch.setattr(ocdbt.OpenedDatabase, "start", forbidden)


def test_off_nothing_of_the_fast_path_runs_and_the_tree_round_trips(
    tmp_path, fast_path_forbidden
) -> None:
    tree = _tree()
    with OFF:
        cp.save_pytree(tmp_path / "c", tree)
        _assert_same(cp.load_pytree(tmp_path / "c"), tree)
        assert cp.load_pytree(tmp_path / "c", {"step": 0}, partial_load=True) == {"step": 7}
        with cp.Context(pytree_options=cp.options.PyTreeOptions(partial_load=True)):
            assert cp.load_pytree(tmp_path / "c", {"step": 0}) == {"step": 7}


def test_the_fast_path_does_run_when_on(tmp_path, fast_path_forbidden) -> None:
    # The guard above is real: with the switch on, the same save reaches the fast path.
    with ON, pytest.raises(AssertionError, match="fast path ran"):
        cp.save_pytree(tmp_path / "c", _tree())


@pytest.mark.parametrize(("saving", "loading"), [(ON, OFF), (OFF, ON)])
def test_checkpoints_of_either_setting_load_with_the_other(tmp_path, saving, loading) -> None:
    tree = _tree()
    with saving:
        cp.save_pytree(tmp_path / "c", tree)
    with loading:
        _assert_same(cp.load_pytree(tmp_path / "c"), tree)
    with loading:
        assert cli_main(["verify", str(tmp_path / "c")]) == 0


@pytest.mark.orbax
def test_orbax_loads_what_tensorstore_wrote_with_the_fast_path_off(tmp_path) -> None:
    tree = {"w": np.arange(3000, dtype=np.float32).reshape(30, 100), "b": np.ones(3)}
    with OFF:
        cp.save_pytree(tmp_path / "c", tree)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "c" / "pytree")
    _assert_same(restored, tree)


def test_the_environment_variable_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv(FAST_PATH_ENVIRONMENT_VARIABLE, "0")
    assert cp.options.ArrayOptions().ocdbt_fast_path is False
    monkeypatch.setenv(FAST_PATH_ENVIRONMENT_VARIABLE, "1")
    assert cp.options.ArrayOptions().ocdbt_fast_path is True
