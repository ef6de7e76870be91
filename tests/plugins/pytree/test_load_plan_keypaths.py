"""A TreeMismatchError names key paths one way on both sides: as cp.pytree_metadata and
``checkpointables inspect`` show them (int dict keys ``[0]``, attributes ``['value']``)."""

from __future__ import annotations

import re

import checkpointables as cp
import jax
import numpy as np
import optax
import pytest
from flax import nnx


class _Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(2, 3, rngs=rngs)


def _mismatch(tmp_path, abstract) -> str:
    with pytest.raises(cp.errors.TreeMismatchError) as raised:
        cp.load_pytree(tmp_path / "c", abstract)
    return str(raised.value)


def _listed(message: str, what: str) -> list[str]:
    line = next(line for line in message.splitlines() if what in line)
    return line.split(": ", 1)[1].split(", ")


def test_a_changed_optimizer_is_named_as_inspect_names_the_stored_tree(tmp_path) -> None:
    model = _Model(nnx.Rngs(0))
    adam = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    cp.save_pytree(tmp_path / "c", nnx.state((model, adam)))
    chained = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(1e-3, momentum=0.9))
    message = _mismatch(tmp_path, nnx.state((model, nnx.Optimizer(model, chained, wrt=nnx.Param))))

    stored = _listed(message, "in the checkpoint but not in the abstract tree")
    assert "[1]['opt_state'][0]['mu']['lin']['bias']['value']" in stored
    extra = _listed(message, "in the abstract tree but not in the checkpoint")
    assert "[1]['opt_state'][1][0]['trace']['lin']['bias']['value']" in extra
    assert "['1']" not in message and "['0']" not in message and ".value" not in message
    # The stored side exactly as cp.pytree_metadata's tree names its leaves.
    metadata = cp.pytree_metadata(tmp_path / "c").metadata
    shown = {
        "".join(f"[{k.key!r}]" for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(metadata)[0]
    }
    assert set(stored) <= shown


def test_int_dict_keys_and_attributes_are_shown_alike_on_both_sides(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {0: {"w": np.ones(2)}, 1: [np.ones(1)]})
    abstract = {0: {"v": np.ones(2)}, 1: [np.ones(1), np.ones(1)]}
    message = _mismatch(tmp_path, abstract)
    assert _listed(message, "in the checkpoint but not") == ["[0]['w']"]
    assert sorted(_listed(message, "in the abstract tree but not")) == ["[0]['v']", "[1][1]"]
    assert not re.search(r"\['[01]'\]", message)


def test_a_save_names_unsupported_leaves_as_loads_do(tmp_path) -> None:
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=r"leaves \[0\]\['a'\] \(object\)"):
        cp.save_pytree(tmp_path / "c", {0: {"a": object()}, 1: np.ones(1)})
