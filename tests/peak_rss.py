"""Peak RSS of a child process: the prologue of child scripts that measure what an operation
stages on the host (``measured``), and running them.

``measured(fn, state)`` resets the peak (``/proc/self/clear_refs``), runs ``fn`` and
returns its result with the peak RSS growth minus ``state`` (what the result itself
occupies: on CPU devices, device memory is the host's).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.python_subprocess import run_python

PROLOGUE = """
import ctypes, gc, json, os, sys
def kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

def measured(fn, state):
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # Freed memory back first: else it looks free.
    base = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn()
    return out, kib("VmHWM") - base - state
"""

# The start of a budget test's child, run with the arguments (budget, state bytes, where):
# ``host``, a float32 state of about ``state_bytes``, sharded by rows over 8 devices
# (``saved``), and the sharding a resharded load puts it onto (``wanted``).
RESHARDED_STATE = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import checkpointables as cp

budget, state_bytes, where = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
devices = np.array(jax.devices())
rows = 1024
cols = state_bytes // 4 // rows
saved = NamedSharding(Mesh(devices.reshape(8, 1), ("a", "b")), P("a", None))
wanted = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("b", "a"))
host = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
"""


def run_child(code: str, *args: str, devices: int = 8, **env: str) -> dict:
    """Runs ``PROLOGUE + code`` with ``args`` on ``devices`` CPU devices; returns the JSON it
    prints last. Skips where Linux's ``/proc/self/clear_refs`` is missing."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    done = run_python(
        PROLOGUE + code,
        *args,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        **env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
