"""Saves and loads under ``cp.options.MemoryOptions(host_bytes=...)`` keep the budget.

A child process with 8 CPU devices saves and loads a state eight times the
budget and reports, per operation, its peak RSS growth (``VmHWM`` after
``/proc/self/clear_refs``) minus what the state itself occupies (on CPU the
devices' memory is the host's). The same child without a budget shows that
the measurement catches an unbounded load.
"""

from __future__ import annotations

import os

import checkpointables as cp
import numpy as np
import pytest
from checkpointables_pytree.io import UNBOUNDED_LIMIT, pieces
from checkpointables_pytree.leaves import FAST_PATH_ENVIRONMENT_VARIABLE, chunk_shape_within

from tests.peak_rss import RESHARDED_STATE, run_child

BUDGET = 64 << 20
STATE = 512 << 20
# Beyond the budget: XLA compiling the in-place updates, TensorStore's threads, the allocator.
SLACK = 64 << 20

CHILD = (
    RESHARDED_STATE
    + """
root = where
tree = {"w": jax.device_put(host, saved), "b": np.arange(1000, dtype=np.int64)}
abstract = {"w": jax.ShapeDtypeStruct((rows, cols), np.float32, sharding=wanted),
            "b": np.empty(1000, np.int64)}
options = cp.options.MemoryOptions(host_bytes=budget or None)
report = {}
with cp.Context(memory_options=options):
    small = {"w": jax.device_put(host[:64], saved)}  # Warm-up: imports, thread pools, compiles.
    cp.save_pytree(os.path.join(root, "warm"), small)
    warm = {"w": jax.ShapeDtypeStruct((64, cols), np.float32, sharding=wanted)}
    cp.load_pytree(os.path.join(root, "warm"), warm)
    path = os.path.join(root, "ckpt")
    _, report["save"] = measured(lambda: cp.save_pytree(path, tree), 0)
    _, report["save_async"] = measured(
        lambda: cp.save_pytree_async(path, tree, overwrite=True).result(), 0)
    del tree
    gc.collect()
    loaded, report["load_resharded"] = measured(lambda: cp.load_pytree(path, abstract), state_bytes)
    report["exact"] = bool(np.array_equal(np.asarray(loaded["w"]), host)
                           and np.array_equal(loaded["b"], np.arange(1000)))
    report["sharding_kept"] = loaded["w"].sharding == wanted
    # A checkpoint saved without a budget: one chunk of 64 MiB per shard, read in ranges.
    plain = os.path.join(root, "plain")
    with cp.Context(memory_options=cp.options.MemoryOptions()):
        cp.save_pytree(plain, {"w": loaded["w"]})
    del loaded
    gc.collect()
    again, report["load_unbudgeted_save"] = measured(
        lambda: cp.load_pytree(plain, {"w": abstract["w"]}), state_bytes)
    report["exact"] = report["exact"] and bool(np.array_equal(np.asarray(again["w"]), host))
print(json.dumps(report))
"""
)


def _run(tmp_path, budget: int) -> dict[str, int]:
    return run_child(CHILD, str(budget), str(STATE), str(tmp_path))


def test_save_and_resharded_load_stay_within_the_budget(tmp_path) -> None:
    report = _run(tmp_path, BUDGET)
    assert report["exact"] and report["sharding_kept"]
    for op in ("save", "save_async", "load_resharded"):
        assert report[op] <= BUDGET + SLACK, (op, report[op] >> 20, report)
    # Ranged reads need chunks our writer wrote; TensorStore's (the fast path off) are read
    # whole through its driver: one 64 MiB chunk besides the budget (docs/memory.md, Limits).
    whole_chunk = 64 << 20 if os.environ.get(FAST_PATH_ENVIRONMENT_VARIABLE) == "0" else 0
    assert report["load_unbudgeted_save"] <= BUDGET + SLACK + whole_chunk, report


@pytest.mark.fast_path  # Chunks located by our own index.
def test_without_a_budget_loads_stage_at_most_the_pieces_in_flight(tmp_path) -> None:
    """Without a budget, arrays this library wrote are read as byte ranges too: a load holds
    at most the reader's pieces in flight. The measurement can fail: it held the state twice
    more before (1023 MiB here), and holds it again with the fast path off (read whole)."""
    report = _run(tmp_path, 0)
    assert report["exact"] and report["sharding_kept"]
    for op in ("load_resharded", "load_unbudgeted_save"):
        assert report[op] <= UNBOUNDED_LIMIT + SLACK, (op, report[op] >> 20, report)


def test_streamed_pieces_and_chunks_cover_exactly() -> None:
    assert chunk_shape_within((128, 131072), 4, 8 << 20) == (16, 131072)
    # 3,000,001 = 853 * 3517: the largest divisor within 1 MiB of float32.
    assert chunk_shape_within((7, 3_000_001), 4, 1 << 20) == (1, 3517)
    assert chunk_shape_within((10, 10), 4, 1 << 20) == (10, 10)
    # A prime length: chunks of the most that fit where one shard spans the axis, else 1.
    assert chunk_shape_within((1_000_003,), 4, 1 << 20, whole_axes=[0]) == (262144,)
    assert chunk_shape_within((1_000_003,), 4, 1 << 20) == (1,)
    region = (slice(100, 612), slice(3, 4000))
    covered = np.zeros((612, 4000), np.int32)
    for piece in pieces(region, (64, 1000), 4, 64 << 10):
        shape = [s.stop - s.start for s in piece]
        assert np.prod(shape) * 4 <= 64 << 10
        # Each piece lies in one stored chunk.
        assert all(
            s.start // c == (s.stop - 1) // c for s, c in zip(piece, (64, 1000), strict=True)
        )
        covered[piece] += 1
    assert (covered[100:612, 3:4000] == 1).all() and covered.sum() == 512 * 3997


def test_a_budget_too_small_names_the_smallest() -> None:
    with pytest.raises(cp.errors.InvalidArgumentError, match="8388608"):
        cp.options.MemoryOptions(host_bytes=1 << 20)
