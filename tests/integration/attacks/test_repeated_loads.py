"""Loading the same checkpoint again and again keeps memory flat.

Before, TensorStore kept every b-tree node a load had dumped: a checkpoint of
10,000 small arrays grew the RSS by about 13 MiB per load, 100 MiB over the
eight loads measured here. The bound is generous (the benchmark measures the
real figure, see docs/performance.md): it fails on a leak, not on noise.
"""

from __future__ import annotations

import json

import pytest

from ...python_subprocess import run_python

pytestmark = pytest.mark.slow

LEAVES = 10_000
LOADS = 8
BOUND_MIB = 40

CHILD = """
    import ctypes, gc, json, sys
    import numpy as np
    import checkpointables as cp

    path, leaves, loads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = np.random.default_rng(0)
    cp.save_pytree(path, {
        f"g{g}": {f"w{i}": rng.random(16, dtype=np.float32) for i in range(100)}
        for g in range(leaves // 100)
    })

    def rss_mib():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    sizes = []
    for _ in range(loads):
        tree = cp.load_pytree(path)
        assert len(tree) == leaves // 100
        del tree
        sizes.append(rss_mib())
    print(json.dumps(sizes))
"""


def test_rss_stays_flat_over_repeated_loads(tmp_path) -> None:
    result = run_python(CHILD, str(tmp_path / "c"), str(LEAVES), str(LOADS))
    assert result.returncode == 0, result.stderr[-3000:]
    sizes = json.loads(result.stdout.strip().splitlines()[-1])
    growth = sizes[-1] - sizes[1]  # After a warm-up load.
    assert growth < BOUND_MIB, f"RSS after each load (MiB): {[round(s) for s in sizes]}"
