"""The peak host memory a pytree save stages (``io.Staging``, reported through ``cp.staging``):
in ``Checkpointer.last_save_stats``, in ``_CHECKPOINT_METADATA`` and in ``inspect``.

On the CPU devices of these tests a jax.Array's host form is a view of its device buffer
(no staging): the cases that stage are a stored dtype other than the array's (a cast on
the host, as a device-to-host copy is on an accelerator) and NumPy leaves of an
asynchronous save (copied before the call returns).
"""

from __future__ import annotations

import subprocess
import sys

import checkpointables as cp
import jax.numpy as jnp
import numpy as np
import pytest

STATE = 32 << 20  # float32 bytes of the array saved
BUDGET = 8 << 20
AS_BF16 = cp.options.ArrayOptions(
    storage_options=cp.options.ArrayStorageOptions(dtype=jnp.bfloat16)
)


def _saved_stats(tmp_path, tree, *, asynchronous: bool = True, **context) -> cp.training.SaveStats:
    with cp.training.Checkpointer(tmp_path / "run", context=cp.Context(**context)) as ckptr:
        if asynchronous:
            assert ckptr.save_pytree_async(0, tree).result()
        else:
            ckptr.save_pytree(0, tree)
        stats = ckptr.last_save_stats
    assert stats is not None
    return stats


def _big() -> jnp.ndarray:
    return jnp.arange(STATE // 4, dtype=jnp.float32).reshape(2048, -1)


def test_a_budgeted_save_reports_a_peak_within_the_budget(tmp_path) -> None:
    budget = cp.options.MemoryOptions(host_bytes=BUDGET)
    stats = _saved_stats(tmp_path, {"w": _big()}, array_options=AS_BF16, memory_options=budget)
    # Streamed chunks of an eighth of the budget, each counted twice (fetched and encoded).
    assert 0 < stats.peak_staging_bytes <= BUDGET
    assert stats.as_dict()["checkpoint/peak_staging_bytes"] == stats.peak_staging_bytes


def test_an_unbudgeted_save_reports_the_whole_copy(tmp_path) -> None:
    stats = _saved_stats(tmp_path, {"w": _big()}, array_options=AS_BF16)
    assert stats.peak_staging_bytes == STATE // 2  # The whole array cast to bfloat16 at once.


@pytest.mark.parametrize("asynchronous, staged", [(True, STATE), (False, 0)])
def test_numpy_leaves_stage_only_when_copied(tmp_path, asynchronous, staged) -> None:
    tree = {"n": np.ones(STATE // 4, np.float32), "step": 3}
    stats = _saved_stats(tmp_path, tree, asynchronous=asynchronous)
    # The scalar's few bytes are a host array the save made.
    assert staged <= stats.peak_staging_bytes <= staged + 64


def test_views_of_cpu_devices_are_not_staged(tmp_path) -> None:
    stats = _saved_stats(tmp_path, {"w": _big()})
    assert stats.peak_staging_bytes == 0


def test_the_peak_is_recorded_and_inspect_shows_it(tmp_path) -> None:
    path = tmp_path / "ckpt"
    with cp.Context(array_options=AS_BF16):
        cp.save_pytree(path, {"w": _big()})
    text = (path / "_CHECKPOINT_METADATA").read_text()
    assert f'"performance_metrics": {{"peak_staging_bytes": {STATE // 2}}}' in text
    shown = subprocess.run(
        [sys.executable, "-m", "checkpointables", "inspect", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert f"peak staging memory of the save: {STATE // 2:,} bytes (16.0 MiB)" in shown
