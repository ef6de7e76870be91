"""docs/multi-host.md: the example of "Restoring, on any topology" runs as written on an
ordinary training state (scalars, a bias no mesh axis divides, an optimizer's state).

The page's other examples need a job of several processes (``jax.distributed``): the
multi-process tests run those steps themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import optax

PAGE = Path(__file__).resolve().parents[3] / "docs" / "multi-host.md"


def _restore_block() -> str:
    section = PAGE.read_text().split("## Restoring, on any topology", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def _train_state() -> dict:
    params = {"w": jnp.arange(32.0).reshape(8, 4), "b": jnp.array([1.0, 2.0, 3.0])}
    return {"step": jnp.array(7), "params": params, "opt": optax.adam(1e-3).init(params)}


def test_restoring_on_any_topology_runs_on_a_train_state(tmp_path) -> None:
    saved = _train_state()
    cp.save_pytree(tmp_path / "step_7", saved)
    namespace: dict = {
        "cp": cp,
        "jax": jax,
        "path": tmp_path / "step_7",
        "abstract_state": jax.eval_shape(_train_state),
    }
    exec(compile(_restore_block(), str(PAGE), "exec", dont_inherit=True), namespace)
    state, mesh = namespace["state"], namespace["mesh"]
    assert mesh.shape["data"] == jax.device_count() // 2 == 4  # The tests' 8 CPU devices.
    for restored, original in zip(jax.tree.leaves(state), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(restored, original)
        assert restored.sharding.mesh == mesh
    P = jax.sharding.PartitionSpec
    assert state["params"]["w"].sharding.spec == P("data")  # 8 rows over 4
    assert state["params"]["b"].sharding.spec == P()  # 3 rows: replicated
    assert state["step"].sharding.spec == P()  # A scalar
