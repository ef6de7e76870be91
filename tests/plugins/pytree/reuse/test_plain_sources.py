"""Reuse from a checkpoint saved without reuse (no record of fingerprints).

On a local disk without compression, an array on CPU devices whose bytes the
source stores as exactly what this save would write is linked: the probe of
the stored chunk, then its shard index and its bytes in full are compared.
Everything else is written, and the save records fingerprints for the next.
"""

from __future__ import annotations

import logging
import shutil

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ....python_subprocess import assert_verifies
from .helpers import linked_names

pytestmark = pytest.mark.fast_path


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tree = {f"w{i}": jnp.asarray(rng.standard_normal((64, 512), np.float32)) for i in range(3)}
    tree["host"] = rng.standard_normal(1 << 15).astype(np.float32)  # NumPy: not compared.
    return tree


def _assert_loads(checkpoint, tree: dict) -> None:
    loaded = cp.load_pytree(checkpoint)
    assert all(np.asarray(loaded[k]).tobytes() == np.asarray(v).tobytes() for k, v in tree.items())


def test_unchanged_arrays_link_from_a_plain_checkpoint_and_stay_whole(tmp_path, caplog) -> None:
    tree = _tree(0)
    cp.save_pytree(tmp_path / "base", tree)
    changed = dict(tree, w1=tree["w1"].at[3, 7].add(1.0))
    with caplog.at_level(logging.INFO, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "1", changed, reuse_from=tmp_path / "base")
    assert linked_names(tmp_path / "1") == {"w0", "w2"}
    said = [r.getMessage() for r in caplog.records if r.name == "checkpointables.reuse"]
    assert any("links the arrays on CPU devices whose bytes equal" in m for m in said), said
    # Fingerprints recorded: the next save links from this one by them.
    cp.save_pytree(tmp_path / "2", changed, reuse_from=tmp_path / "1")
    assert linked_names(tmp_path / "2") == {"w0", "w1", "w2", "host"}
    shutil.rmtree(tmp_path / "base")
    shutil.rmtree(tmp_path / "2")
    _assert_loads(tmp_path / "1", changed)
    assert_verifies(tmp_path / "1")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(size=st.integers(16 * 1024, 40 * 1024), data=st.data())
def test_a_single_bit_changed_since_a_plain_source_is_never_linked(
    tmp_path_factory, size, data
) -> None:
    root = tmp_path_factory.mktemp("plain")
    values = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    cp.save_pytree(root / "base", {"w": jnp.asarray(values)})
    changed = values.copy()
    index = data.draw(st.integers(0, size - 1))
    changed.view(np.uint32)[index] ^= np.uint32(1 << data.draw(st.integers(0, 31)))
    cp.save_pytree(root / "1", {"w": jnp.asarray(changed)}, reuse_from=root / "base")
    assert linked_names(root / "1") == set()
    assert np.asarray(cp.load_pytree(root / "1")["w"]).tobytes() == changed.tobytes()


def test_a_damaged_or_compressed_source_links_nothing(tmp_path) -> None:
    tree = _tree(1)
    cp.save_pytree(tmp_path / "base", tree)
    data = tmp_path / "base" / "pytree" / "d"
    target = max(data.iterdir(), key=lambda f: f.stat().st_size)  # The arrays' data file.
    raw = bytearray(target.read_bytes())
    for at in range(5000, len(raw), 10007):  # A few bytes of every array, sizes unchanged.
        raw[at] ^= 0xFF
    target.write_bytes(bytes(raw))
    cp.save_pytree(tmp_path / "1", tree, reuse_from=tmp_path / "base")
    assert linked_names(tmp_path / "1") == set()
    _assert_loads(tmp_path / "1", tree)
    assert_verifies(tmp_path / "1")
    with cp.Context(array_options=cp.options.ArrayOptions(use_compression=True)):
        cp.save_pytree(tmp_path / "zipped", tree)
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "zipped")
    assert linked_names(tmp_path / "2") == set()


def test_a_source_of_another_shape_links_only_identical_chunks(tmp_path) -> None:
    # The same bytes under another shape are the same chunk value: linking them is writing
    # them. Another dtype's bytes differ, and so does a chunk of another size.
    values = np.random.default_rng(2).standard_normal((64, 512)).astype(np.float32)
    cp.save_pytree(tmp_path / "base", {"w": jnp.asarray(values.reshape(128, 256))})
    tree = {"w": jnp.asarray(values)}
    cp.save_pytree(tmp_path / "1", tree, reuse_from=tmp_path / "base")
    _assert_loads(tmp_path / "1", tree)
    cp.save_pytree(tmp_path / "other", {"w": jnp.asarray(values[:32])})
    cp.save_pytree(tmp_path / "2", tree, reuse_from=tmp_path / "other")
    assert linked_names(tmp_path / "2") == set()
    _assert_loads(tmp_path / "2", tree)
    assert_verifies(tmp_path / "1")


def test_a_subtree_of_a_plain_source_is_written_with_a_warning(tmp_path, caplog) -> None:
    # A downloaded base saved plainly, then reused by a save of its subtree: its names
    # lack the prefix, nothing is found under them, and the log says why (once).
    cp.save_pytree(tmp_path / "1", {"base": _tree(0)})
    with caplog.at_level(logging.WARNING, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "2", _tree(0), reuse_from=tmp_path / "1")
        cp.save_pytree(tmp_path / "3", _tree(0), reuse_from=tmp_path / "1")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "stores none of this save's arrays" in warned[0], warned
    assert "'w0'" in warned[0] and "save {'params': params}" in warned[0]
    assert linked_names(tmp_path / "2") == set()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="checkpointables.reuse"):
        cp.save_pytree(tmp_path / "4", {"base": _tree(0)}, reuse_from=tmp_path / "1")
    assert not caplog.records and len(linked_names(tmp_path / "4")) == 3
