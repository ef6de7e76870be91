"""A process-local checkpoint (``primary_host=None``) whose arrays TensorStore's zarr3
driver reads (compressed ones) holds one process's shards: loading it elsewhere says
so (``InvalidArgumentError``), as for arrays the fast path reads, and never fills the
missing chunks with zeros."""

from __future__ import annotations

from pathlib import Path

import checkpointables as cp
import numpy as np
import pytest
from checkpointables._verification import verify_checkpoint

from ....integration.multiprocess.launcher import run_job

pytestmark = pytest.mark.multiprocess

SAVE = """
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4,), ("d",))
whole = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
w = jax.make_array_from_callback(whole.shape, NamedSharding(mesh, P("d")), lambda i: whole[i])
options = cp.options.MultiprocessingOptions(primary_host=None)
compressed = cp.options.ArrayOptions(use_compression=True)  # Written and read by the driver.
with cp.Context(multiprocessing_options=options, array_options=compressed):
    cp.save_pytree(sys.argv[1] + f"/process_{PROCESS_ID}", {"w": w, "n": np.arange(3)})
"""
PATHS = {
    "fast": cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=True)),
    "driver": cp.Context(array_options=cp.options.ArrayOptions(ocdbt_fast_path=False)),
}


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shared")
    for result in run_job(SAVE, args=[str(root)]):
        result.check()
    return root / "process_0"


@pytest.mark.parametrize("path", PATHS)
def test_a_compressed_process_local_array_is_not_whole_elsewhere(local, path) -> None:
    with PATHS[path], pytest.raises(cp.errors.InvalidArgumentError) as raised:
        cp.load_pytree(local)
    message = str(raised.value)
    assert "['w'] (array 'w') is not whole" in message and "saved process-locally" in message, (
        message
    )
    assert "by process 0 of 2" in message and "damaged" not in message, message


@pytest.mark.parametrize("path", PATHS)
def test_its_other_leaves_load(local, path) -> None:
    with PATHS[path]:
        loaded = cp.load_pytree(local, {"n": np.empty(3, np.int64)}, partial_load=True)
    assert loaded["n"].tolist() == [0, 1, 2]


def test_verify_checks_the_chunks_it_holds(local) -> None:
    findings = verify_checkpoint(local)
    assert not [f for f in findings if f.problem], findings
    assert any("'w' (2 of 4 chunks)" in str(f) for f in findings), findings
