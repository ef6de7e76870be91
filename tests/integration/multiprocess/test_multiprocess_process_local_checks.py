"""A process-local checkpoint (``primary_host=None``) holds one process's shards of each
global array by design: loading it elsewhere says so, and ``verify`` checks the chunks
it holds instead of calling the others' absence damage."""

from __future__ import annotations

import os
from pathlib import Path

import checkpointables as cp
import jax
import numpy as np
import pytest
from checkpointables._verification import verify_checkpoint

from .launcher import run_job

pytestmark = pytest.mark.multiprocess

SAVE = """
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4,), ("d",))
whole = np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024)  # Chunks not inlined.
w = jax.make_array_from_callback(whole.shape, NamedSharding(mesh, P("d")), lambda i: whole[i])
options = cp.options.MultiprocessingOptions(primary_host=None)
with cp.Context(multiprocessing_options=options):
    cp.save_pytree(sys.argv[1] + f"/step_1000/process_{PROCESS_ID}", {"w": w, "n": np.arange(3)})
"""


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shared") / "local"
    for result in run_job(SAVE, args=[str(root)]):
        result.check()
    return root / "step_1000" / "process_0"


def test_a_load_elsewhere_says_it_was_saved_process_locally(local) -> None:
    with pytest.raises(cp.errors.InvalidArgumentError) as raised:
        cp.load_pytree(local)
    message = str(raised.value)
    assert "['w'] is not whole" in message and "saved process-locally" in message
    assert "by process 0 of 2" in message and "Restore it in a job of 2 processes" in message
    assert "damaged" not in message
    # Its other leaves load.
    loaded = cp.load_pytree(local, {"n": np.empty(3, np.int64)}, partial_load=True)
    assert loaded["n"].tolist() == [0, 1, 2]


def test_verify_checks_the_chunks_it_holds(local) -> None:
    findings = verify_checkpoint(local)
    assert not [f for f in findings if f.problem], findings
    assert any("process-locally by process 0 of 2" in str(f) for f in findings), findings


def test_verify_still_finds_a_damaged_chunk_it_holds(local, tmp_path) -> None:
    import shutil

    copy = tmp_path / "process_0"
    shutil.copytree(local, copy)
    first_chunk = np.arange(2 * 1024, dtype=np.float32).tobytes()  # Process 0's rows 0-1.
    files = [Path(d) / f for d, _, names in os.walk(copy / "pytree") for f in names]
    target = next(p for p in files if first_chunk in p.read_bytes())
    raw = bytearray(target.read_bytes())
    raw[raw.find(first_chunk) + 100] ^= 0xFF
    target.write_bytes(bytes(raw))
    problems = [f.problem for f in verify_checkpoint(copy) if f.problem]
    assert len(problems) == 1 and "['w']" in problems[0], problems
    assert jax.process_count() == 1
