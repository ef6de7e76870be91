"""How long ``save_pytree_async`` holds its caller, and the garbage collections of the save.

    uv run python -m bench.stall --case small-jax [--repeats 20] [--checkpointer]

Saves the case's tree ``--repeats`` times after three untimed saves, each
after the previous one committed and a 50 ms rest, and prints the median and
best of the stall (until ``save_pytree_async`` returns; with
``--checkpointer``, ``Checkpointer.save_pytree_async``) in wall time and in
CPU time of the calling thread (``time.thread_time``: what other work on the
machine changes least), and the collections of each generation that Python's
garbage collector ran from the call until the commit (they hold the GIL: a
training loop running meanwhile waits for them) with their total time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
from typing import Any

from bench import cases, libraries


class _Collections:
    """Counts the collections of each generation, and their time, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self._started = 0.0
        self.reset()

    def reset(self) -> None:
        """Starts counting again."""
        self.counts = [0, 0, 0]
        self.seconds = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.counts[info["generation"]] += 1


def main(argv: list[str] | None = None) -> None:
    """Prints the stall and the collections of ``--repeats`` async saves of ``--case``."""
    p = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__)
    p.add_argument("--case", default="small-jax", choices=[c.name for c in cases.CASES])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--checkpointer", action="store_true")
    p.add_argument("--tmp-dir", default=None)
    args = p.parse_args(argv)

    import checkpointables as cp

    tree = cases.get_case(args.case).tree(1.0)
    root = libraries.scratch_dir(args.tmp_dir)
    collections = _Collections()
    gc.callbacks.append(collections)
    walls, cpus, counts, gc_ms = [], [], [], []
    with contextlib.ExitStack() as stack:
        stack.callback(libraries.remove, root)
        if args.checkpointer:
            ckptr = stack.enter_context(cp.training.Checkpointer(os.path.join(root, "run")))

            def save(n: int) -> Any:
                return ckptr.save_pytree_async(n, tree, force=True)
        else:

            def save(n: int) -> Any:
                return cp.save_pytree_async(os.path.join(root, str(n)), tree)

        for n in range(3 + args.repeats):
            collections.reset()
            wall, cpu = time.perf_counter(), time.thread_time()
            response = save(n)
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            response.result()
            if n >= 3:
                walls.append(wall * 1e3)
                cpus.append(cpu * 1e3)
                counts.append(tuple(collections.counts))
                gc_ms.append(collections.seconds * 1e3)
            if not args.checkpointer:
                libraries.remove(os.path.join(root, str(n)))
            time.sleep(0.05)
    gc.callbacks.remove(collections)
    median = statistics.median
    print(f"{args.case}: async save stall, {args.repeats} saves (load {os.getloadavg()[0]:.2f})")
    print(f"  wall  median {median(walls):6.1f} ms, best {min(walls):6.1f} ms")
    print(f"  CPU   median {median(cpus):6.1f} ms, best {min(cpus):6.1f} ms (calling thread)")
    print(f"  GC during the save: median {median(gc_ms):.1f} ms; collections per generation")
    print(f"  (young, middle, full), per save: {counts}")


if __name__ == "__main__":
    main()
