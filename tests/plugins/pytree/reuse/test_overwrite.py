"""An overwrite of a Checkpointer's newest step with reuse on links its unchanged arrays.

On a local disk the step being replaced is the source: the new step is written in
a temporary directory, hard-linking the old one's files, and swapped in at its
commit. The old step stays whole and loadable until then (a SIGKILL at any moment
leaves a whole step), and the new one shares no name with it. On S3, where an
overwrite deletes the old step's objects as it starts, the newest other step is.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables_pytree import reuse

from ....integration.object_store.conftest import bucket, s3, s3_server  # noqa: F401
from ....python_subprocess import assert_verifies
from .helpers import assert_same, linked_names

pytestmark = pytest.mark.fast_path  # Linking is the fast path's.


def _tree(adapter: float = 0.0) -> dict:
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((64, 512), dtype=np.float32) for _ in range(3)]
    base = {f"w{i}": jnp.asarray(w) for i, w in enumerate(weights)}
    return {"base": base, "adapter": jnp.full((128, 256), adapter, jnp.float32)}


def _base_bytes(tree: dict) -> int:
    return sum(int(w.nbytes) for w in tree["base"].values())


def _checkpointer(root) -> cp.training.Checkpointer:
    return cp.training.Checkpointer(
        root,
        reuse_unchanged=True,
        preservation_policy=cp.training.preservation_policies.PreserveAll(),
    )


def test_overwriting_the_newest_step_links_its_unchanged_arrays(tmp_path) -> None:
    with _checkpointer(tmp_path) as ckptr:
        ckptr.save_pytree(0, _tree(0.0), force=True)
        ckptr.save_pytree(1, _tree(1.0), force=True)
        old_inode = os.stat(tmp_path / "1").st_ino
        changed = _tree(2.0)  # A tiny change: the adapter alone.
        ckptr.save_pytree(1, changed, force=True, overwrite=True)
        stats = ckptr.last_save_stats
    assert stats.bytes_reused == _base_bytes(changed)
    assert stats.bytes_written == changed["adapter"].nbytes
    assert os.stat(tmp_path / "1").st_ino != old_inode  # Replaced, not written into.
    assert linked_names(tmp_path / "1", "state") == {"base.w0", "base.w1", "base.w2"}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # Old step removed.
    shutil.rmtree(tmp_path / "0")  # No other step holds what it needs.
    assert_same(cp.load_pytree(tmp_path / "1"), changed)
    assert_verifies(tmp_path / "1")
    with _checkpointer(tmp_path) as ckptr:  # And it is a source as any other.
        ckptr.save_pytree(1, _tree(3.0), force=True, overwrite=True)
        assert ckptr.last_save_stats.bytes_reused == _base_bytes(changed)
    assert_same(cp.load_pytree(tmp_path / "1"), _tree(3.0))


def test_a_changed_array_of_the_replaced_step_is_written(tmp_path) -> None:
    tree = _tree(1.0)
    with _checkpointer(tmp_path) as ckptr:
        ckptr.save_pytree(5, tree, force=True)
        base = dict(tree["base"], w1=tree["base"]["w1"].at[3, 7].add(1.0))  # One element.
        changed = dict(tree, base=base)
        ckptr.save_pytree(5, changed, force=True, overwrite=True)
        assert ckptr.last_save_stats.bytes_reused == 3 * tree["base"]["w0"].nbytes
    assert linked_names(tmp_path / "5", "state") == {"base.w0", "base.w2", "adapter"}
    assert_same(cp.load_pytree(tmp_path / "5"), changed)
    assert_verifies(tmp_path / "5")


_KILLED_OVERWRITES = """
import sys, jax.numpy as jnp, numpy as np, checkpointables as cp
rng = np.random.default_rng(0)
base = {f"w{i}": jnp.asarray(rng.standard_normal((256, 256), dtype=np.float32)) for i in range(4)}
keep = cp.training.preservation_policies.PreserveAll()
with cp.training.Checkpointer(sys.argv[1], reuse_unchanged=True, preservation_policy=keep) as c:
    value = 0.0
    while True:
        tree = {"base": base, "adapter": jnp.full((256, 256), value, jnp.float32)}
        c.save_pytree(1, tree, force=True, overwrite=value > 0)
        print(value, flush=True)
        value += 1
"""


@pytest.mark.slow  # A JAX process started and killed: seconds.
def test_sigkill_while_overwriting_the_newest_step_leaves_it_whole(tmp_path) -> None:
    root = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_OVERWRITES), str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # Step 1 committed once; overwritten from now on.
    proc.stdout.readline()
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    with cp.training.Checkpointer(root) as ckptr:  # Removes the interrupted save's leftovers.
        assert [s.step for s in ckptr.steps()] == [1]
    loaded = cp.load_pytree(root / "1")
    adapter = np.asarray(loaded["adapter"])
    assert adapter.shape == (256, 256) and (adapter == adapter[0, 0]).all()  # One whole save.
    assert_verifies(root / "1")


def test_overwriting_the_newest_step_on_s3_links_from_the_step_before(bucket) -> None:  # noqa: F811
    run = f"{bucket}/run"
    with _checkpointer(run) as ckptr:
        ckptr.save_pytree(0, _tree(0.0), force=True)
        ckptr.save_pytree(1, _tree(1.0), force=True)
        changed = _tree(2.0)
        ckptr.save_pytree(1, changed, force=True, overwrite=True)
        assert ckptr.last_save_stats.bytes_reused == _base_bytes(changed)
    assert_same(cp.load_pytree(f"{run}/1"), changed)
    # Linked from step 0 (copied on the server): the replaced step was deleted as it began.
    report = reuse.reuse_report(cp.path.as_path(f"{run}/1/state"))
    assert {n: s for n, s in report.items() if s is not None} == {
        "base.w0": "0",
        "base.w1": "0",
        "base.w2": "0",
    }
