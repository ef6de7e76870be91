"""Cold start: a fresh process imports the library and saves a tiny pytree.

    uv run python -m bench.coldstart [--repeats 7] [--python PATH/bin/python ...]

Each run is a new interpreter with ``PYTHONDONTWRITEBYTECODE=1`` (as in many
container images), timed from its start to the end of the first
``save_pytree`` (checkpointables) or ``ocp.save`` (Orbax) of 10 scalars and
arrays: what a short job or a test pays before its first checkpoint. With
``compile-bytecode`` (root ``pyproject.toml``) the environment holds
compiled modules; without it, every such process compiles JAX and the rest
from source. ``--python`` times other environments, e.g. one made with
``UV_PROJECT_ENVIRONMENT=/tmp/no-pyc uv sync --no-compile-bytecode``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import os, sys, tempfile
import numpy as np
tree = {"w": np.arange(100, dtype=np.float32), "b": np.zeros(10), "step": 1, "lr": 0.5}
path = os.path.join(tempfile.mkdtemp(prefix="coldstart-"), "c")
if sys.argv[1] == "checkpointables":
    import checkpointables as cp
    cp.save_pytree(path, tree)
else:
    from absl import logging
    logging.set_verbosity(logging.ERROR)
    from orbax.checkpoint import v1 as ocp
    ocp.save(path, tree)
"""
LIBRARIES = ("checkpointables", "orbax")


def time_once(python: str, library: str) -> float:
    """Seconds from starting a fresh interpreter until its first save returned."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    start = time.perf_counter()
    proc = subprocess.run(
        [python, "-c", CHILD, library], env=env, capture_output=True, text=True, check=False
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{library} with {python} failed:\n{proc.stderr[-2000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    """Prints the median cold start per environment and library."""
    p = argparse.ArgumentParser(prog="python -m bench.coldstart", description=__doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--python", action="append", help="interpreters to time (default: this one)")
    args = p.parse_args(argv)
    pythons = args.python or [sys.executable]
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):  # Interleaved, so drifts of the machine hit all alike.
        for python in pythons:
            for library in LIBRARIES:
                times.setdefault((python, library), []).append(time_once(python, library))
    for (python, library), seconds in times.items():
        print(
            f"{python}  {library}: median {statistics.median(seconds):.2f} s "
            f"(min {min(seconds):.2f}, max {max(seconds):.2f}, {len(seconds)} runs)"
        )
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
