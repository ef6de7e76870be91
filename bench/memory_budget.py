"""Peak staging memory and time of saves and loads with and without a host-memory budget.

    uv run python -m bench.memory_budget [--size-mib 2048] [--budget-mib 256] [--output FILE]

The cases of issue 30: one array of ``--size-mib`` and the same bytes in 64
arrays (float32, random), each saved (``save``, ``save_async(...).result()``)
and loaded onto one device and onto an 8-device CPU mesh with another
sharding (saved 8x1 by rows, loaded 2x4), without a budget and with
``cp.options.MemoryOptions(host_bytes=--budget-mib)``; ``load_unbudgeted_save``
loads onto the mesh a checkpoint saved without a budget (one chunk per shard). Every measurement
runs in a fresh process (``python -m bench.memory_budget --child``) with 8
CPU devices: a warm-up save and load of a small tree, then the operation
with the kernel's high-water mark reset (``bench.memory``). Staging memory
is the peak RSS growth minus what the state itself occupies (on CPU the
devices' memory is the host's: a load's result counts as state). Prints a
Markdown table (the one in docs/memory.md) and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.memory import _trimmed_rss, reset_high_water_mark, status_kib

MIB = 1 << 20
OPS = ("save", "save_async", "load", "load_resharded", "load_unbudgeted_save")
CASES = {"one-array": 1, "64-arrays": 64}


def _tree(size: int, count: int) -> tuple[dict[str, Any], Any, Any]:
    """The case's tree (sharded by rows over 8 devices), and the abstract trees of a load
    onto one device and onto a 2x4 mesh."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    saved = NamedSharding(Mesh(devices.reshape(8, 1), ("a", "b")), P("a", None))
    wanted = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("b", "a"))
    rows = 1024
    cols = max(8, size // 4 // count // rows // 8 * 8)
    rng = np.random.default_rng(30)
    tree = {
        f"w{i:02d}": jax.device_put(rng.random((rows, cols), dtype=np.float32), saved)
        for i in range(count)
    }
    one = {k: jax.ShapeDtypeStruct((rows, cols), np.float32) for k in tree}
    mesh = {k: jax.ShapeDtypeStruct((rows, cols), np.float32, sharding=wanted) for k in tree}
    return tree, one, mesh


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this fresh process."""
    import checkpointables as cp
    import jax

    budget = args["budget"]
    options = cp.options.MemoryOptions(host_bytes=budget * MIB if budget else None)
    tree, one, mesh = _tree(args["size"] * MIB, args["count"])
    state = sum(x.nbytes for x in jax.tree.leaves(tree))
    root = args["root"]
    with cp.Context(memory_options=options):
        small = {"w": tree[next(iter(tree))][:64]}
        cp.save_pytree(os.path.join(root, "warm"), small, overwrite=True)
        cp.load_pytree(os.path.join(root, "warm"))
        path = os.path.join(root, "ckpt")
        op = args["op"]
        if op == "load_unbudgeted_save":  # One chunk per shard, many pieces large.
            with cp.Context(memory_options=cp.options.MemoryOptions()):
                cp.save_pytree(path, tree, overwrite=True)
            del tree
        elif op.startswith("load"):
            cp.save_pytree(path, tree, overwrite=True)
            del tree
        time.sleep(0.1)
        # Freed memory handed back first: else a load reusing the freed tree looks free.
        baseline = _trimmed_rss()
        if not reset_high_water_mark():
            raise SystemExit("needs /proc/self/clear_refs")
        start = time.perf_counter()
        if op == "save":
            cp.save_pytree(path, tree, overwrite=True)
        elif op == "save_async":
            cp.save_pytree_async(path, tree, overwrite=True).result()
        else:
            result = cp.load_pytree(path, mesh if op.startswith("load_") else one)
            jax.block_until_ready(result)
        seconds = time.perf_counter() - start
        growth = status_kib("VmHWM") * 1024 - baseline
    held = state if op.startswith("load") else 0  # The loaded state is not staging.
    return {"staging": growth - held, "seconds": seconds, "state": state}


def measure(case: str, op: str, budget: int, size: int, root: str) -> dict[str, Any]:
    """Runs one measurement in a fresh process with 8 CPU devices."""
    args = {"count": CASES[case], "op": op, "budget": budget, "size": size, "root": root}
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench.memory_budget", "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]], budget: int) -> str:
    """The Markdown table of ``rows``."""
    lines = [
        f"| case | operation | staging, no budget | staging, budget {budget} MiB "
        f"| time, no budget | time, budget | ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["budget"]["seconds"] / r["none"]["seconds"]
        lines.append(
            f"| {r['case']} | {r['op']} | {r['none']['staging'] / MIB:.0f} MiB "
            f"| {r['budget']['staging'] / MIB:.0f} MiB | {r['none']['seconds']:.2f} s "
            f"| {r['budget']['seconds']:.2f} s | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    """Runs every case and operation, with and without the budget."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=2048, help="bytes of each case's state")
    parser.add_argument("--budget-mib", type=int, default=256, help="host_bytes of the budget")
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: both")
    parser.add_argument("--op", choices=OPS, action="append", help="default: all")
    parser.add_argument("--output", help="JSON file of the numbers")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for case in args.case or list(CASES):
            for op in args.op or OPS:
                none = measure(case, op, 0, args.size_mib, root)
                within = measure(case, op, args.budget_mib, args.size_mib, root)
                rows.append({"case": case, "op": op, "none": none, "budget": within})
                print(f"{case} {op}: {none} / {within}", file=sys.stderr)
    print(f"State {args.size_mib} MiB, 8 CPU devices.\n")
    print(table(rows, args.budget_mib))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"size_mib": args.size_mib, "budget_mib": args.budget_mib, "rows": rows}, f)


if __name__ == "__main__":
    main()
