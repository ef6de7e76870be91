"""Every kind of leaf in one tree, saved by two real jax.distributed processes (issue 29).

A tree holding a global ``jax.Array`` and a typed PRNG key made the two leaf
handlers ask the primary host for the same key of JAX's key-value store: the
primary raised ``ALREADY_EXISTS`` and the other process hung. Real training
states hold every kind at once, so one tree does here, in a whole save and in a
partial save of two pieces.
"""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
import pytest

from .launcher import run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

BODY = """
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
data, three = np.arange(32, dtype=np.float32).reshape(8, 4), np.arange(3.0)
tree = {
    "w": jax.make_array_from_callback(data.shape, NamedSharding(MESH, P("x")), lambda i: data[i]),
    "rep": jax.make_array_from_callback((3,), NamedSharding(MESH, P()), lambda i: three[i]),
    "rng": jax.random.key(0),
    "keys": jax.random.split(jax.random.key(1, impl="rbg"), 4),
    "local": jax.numpy.ones(5, jax.numpy.bfloat16),
    "text": "run-7",
    "raw": b"\\x00\\x01bytes",
    "step": 12345,
    "lr": 2.5,
    "flag": True,
    "np": np.arange(6, dtype=np.int16).reshape(2, 3),
    "np_scalar": np.float32(1.5),
    "empty": {},
    "nothing": (),
    "nested": {"t": (1, "a"), "l": [np.zeros(2), {}]},
}
first = {k: tree[k] for k in ("w", "rng", "text", "empty", "np")}
second = {k: v for k, v in tree.items() if k not in first}
if sys.argv[2] == "whole":
    cp.save_pytree(sys.argv[1], tree)
else:
    cp.partial.save(sys.argv[1], first)
    cp.partial.save(sys.argv[1], second)
    cp.partial.finalize(sys.argv[1])
loaded = cp.load_pytree(sys.argv[1])
assert loaded["step"] == 12345 and loaded["text"] == "run-7" and loaded["raw"] == tree["raw"]
assert loaded["empty"] == {} and loaded["nothing"] == () and loaded["nested"]["t"] == (1, "a")
np.testing.assert_array_equal(np.asarray(loaded["w"]), data)
np.testing.assert_array_equal(
    np.asarray(jax.random.key_data(loaded["rng"])), np.asarray(jax.random.key_data(tree["rng"])))
print("LEAF KINDS OK", flush=True)
"""


def _expected() -> dict:
    return {
        "w": np.arange(32, dtype=np.float32).reshape(8, 4),
        "rep": np.arange(3.0),
        "keys": jax.random.key_data(jax.random.split(jax.random.key(1, impl="rbg"), 4)),
        "local": np.ones(5, jax.numpy.bfloat16),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
    }


@pytest.mark.parametrize("how", ["whole", "partial"])
def test_every_leaf_kind_saved_by_two_processes(tmp_path, how) -> None:
    path = tmp_path / "c"
    for result in run_job(BODY, args=[str(path), how], timeout=240):
        result.check()
        assert "LEAF KINDS OK" in result.stdout
    # Loaded again by this single process, with no abstract tree: every kind as saved.
    loaded = cp.load_pytree(path)
    expected = _expected()
    for key in ("w", "rep", "local", "np"):
        np.testing.assert_array_equal(np.asarray(loaded[key]), expected[key])
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(loaded["keys"])), expected["keys"])
    assert jax.random.uniform(loaded["rng"]) == jax.random.uniform(jax.random.key(0))
    assert (loaded["text"], loaded["raw"], loaded["step"], loaded["lr"]) == (
        "run-7",
        b"\x00\x01bytes",
        12345,
        2.5,
    )
    assert loaded["flag"] is True and loaded["np_scalar"] == np.float32(1.5)
    assert type(loaded["np_scalar"]) is np.float32
    assert loaded["empty"] == {} and loaded["nothing"] == ()
    assert loaded["nested"]["t"] == (1, "a") and loaded["nested"]["l"][1] == {}
