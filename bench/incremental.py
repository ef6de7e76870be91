"""Incremental saves on a LoRA-shaped tree (issue 31): bytes written and wall time per save.

A frozen base of float32 weights in many arrays, trainable adapters, and Adam
state for the adapters (mu, nu, count), saved at successive steps by a
Checkpointer with ``reuse_unchanged`` on and off. Bytes written are counted
from the files each step created (``du``-style: an inode already seen in an
earlier step, a hard link, counts once). The default size is scaled down for
a 2-core machine (``--base-mib``)::

    uv run python -m bench.incremental                       # 256 MiB base, 10 steps
    uv run python -m bench.incremental --base-mib 1024 --arrays 200 --adapter-mib 16
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np

MiB = 1 << 20


def _tree(base_mib: int, arrays: int, adapter_mib: int) -> dict:
    rng = np.random.default_rng(0)
    per = base_mib * MiB // arrays // 4
    base = {
        f"layer{i:03d}": jnp.asarray(rng.standard_normal(per, np.float32)) for i in range(arrays)
    }
    adapter = {
        f"lora{i}": jnp.asarray(rng.standard_normal(adapter_mib * MiB // 8 // 4, np.float32))
        for i in range(8)
    }
    zeros = jax.tree_util.tree_map(jnp.zeros_like, adapter)
    return {"base": base, "adapter": adapter, "opt": {"mu": zeros, "nu": zeros, "count": 0}}


@jax.jit
def _train_step(tree: dict) -> dict:
    """Changes the adapters and their Adam state; the base passes through (new buffers)."""
    adapter = jax.tree_util.tree_map(lambda a: a * 0.999 + 0.001, tree["adapter"])
    mu = jax.tree_util.tree_map(lambda m, a: 0.9 * m + 0.1 * a, tree["opt"]["mu"], adapter)
    nu = jax.tree_util.tree_map(lambda n, a: 0.99 * n + 0.01 * a * a, tree["opt"]["nu"], adapter)
    return {"base": tree["base"], "adapter": adapter, "opt": {"mu": mu, "nu": nu, "count": 0}}


def _new_bytes(step_dir: str, seen: set[tuple[int, int]]) -> int:
    total = 0
    for directory, _, names in os.walk(step_dir):
        for name in names:
            st = os.stat(os.path.join(directory, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _disk_bytes(root: str) -> int:
    return _new_bytes(root, set())


def _run(tree: dict, steps: int, keep, reuse: bool, root: str) -> dict:
    seen: set[tuple[int, int]] = set()
    written, times = [], []
    decide = cp.training.save_decision_policies.EveryNStepsPolicy(1)
    with cp.training.Checkpointer(
        root, save_decision_policy=decide, preservation_policy=keep, reuse_unchanged=reuse
    ) as ckptr:
        for step in range(steps):
            tree = _train_step(tree)
            jax.block_until_ready(tree)
            start = time.perf_counter()
            ckptr.save_pytree(step, tree)
            times.append(time.perf_counter() - start)
            written.append(_new_bytes(os.path.join(root, str(step)), seen))
    return {"written": written, "times": times, "disk": _disk_bytes(root)}


def _frozen_base(name: str) -> bool:
    """The leaves a LoRA run declares frozen (``reuse_unchanged=<predicate>``)."""
    return name.startswith("base.")


def _changed_alone(tree: dict, root: str) -> float:
    """Wall time of a plain save of the arrays that change (the adapters and their state)."""
    part = {"adapter": tree["adapter"], "opt": tree["opt"]}
    times = []
    for k in range(3):
        start = time.perf_counter()
        cp.save_pytree(os.path.join(root, f"part{k}"), part)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fingerprint_secs(tree: dict) -> tuple[float, float]:
    """Seconds to fingerprint every array: as a save does here, and by the device reduction
    (an accelerator's method) run on this backend."""
    from checkpointables_pytree import reuse

    arrays = jax.tree_util.tree_leaves(tree)
    arrays = [a for a in arrays if isinstance(a, jax.Array)]
    times = []
    for method in (reuse.fingerprint_shards, reuse.fingerprint_lanes):
        method(arrays)  # Compiled once per structure.
        start = time.perf_counter()
        method(arrays)
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-mib", type=int, default=256)
    parser.add_argument("--arrays", type=int, default=50)
    parser.add_argument("--adapter-mib", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    tree = _tree(args.base_mib, args.arrays, args.adapter_mib)
    trainable = 3 * args.adapter_mib * MiB
    work = tempfile.mkdtemp(prefix="bench-incremental-")
    try:
        rows = []
        policies = {
            "LatestN(3)": cp.training.preservation_policies.LatestN(3),
            "PreserveAll": cp.training.preservation_policies.PreserveAll(),
        }
        for name, keep in policies.items():
            for reuse in (False, True, _frozen_base):
                root = os.path.join(work, f"{name}-{reuse}")
                rows.append((name, reuse, _run(tree, args.steps, keep, reuse, root)))
                shutil.rmtree(root)
        alone = _changed_alone(tree, work)
        fingerprint = _fingerprint_secs(tree)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"base {args.base_mib} MiB in {args.arrays} arrays, trainable (adapters + mu + nu) "
        f"{trainable / MiB:.0f} MiB, {args.steps} steps, jax {jax.default_backend()}"
    )
    print(
        "| policy | reuse | bytes written, later saves (median) | save wall s (median) | "
        "disk after all steps |"
    )
    print("|---|---|---|---|---|")
    for name, reuse, r in rows:
        mode = "frozen base declared" if callable(reuse) else ("on" if reuse else "off")
        print(
            f"| {name} | {mode} | "
            f"{statistics.median(r['written'][1:]) / MiB:.2f} MiB | "
            f"{statistics.median(r['times'][1:]):.3f} | {r['disk'] / MiB:.0f} MiB |"
        )
    print(
        f"saving the changed arrays alone: {alone:.3f} s; fingerprints of the whole tree: "
        f"{fingerprint[0]:.3f} s (the device reduction on {jax.default_backend()}: "
        f"{fingerprint[1]:.3f} s)"
    )


if __name__ == "__main__":
    main()
