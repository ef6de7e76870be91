"""Peak staging memory and time of saves and loads with and without a host-memory budget.

    uv run python -m bench.memory_budget [--size-mib 2048] [--budget-mib 256] [--output FILE]

The cases of issue 30: one array of ``--size-mib`` and the same bytes in 64
arrays (float32, random), each saved (``save``, ``save_async(...).result()``)
and loaded onto one device and onto an 8-device CPU mesh with another
sharding (saved 8x1 by rows, loaded 2x4); ``load_unbudgeted_save`` loads onto
the mesh a checkpoint saved without a budget (one chunk per shard); the same
tensors as a safetensors file loaded onto that mesh (``st_load_resharded``),
and the checkpoint exported as safetensors (``st_export``); without a budget
and with ``cp.options.MemoryOptions(host_bytes=--budget-mib)``. Every measurement
runs in a fresh process (``python -m bench.memory_budget --child``) with 8
CPU devices: a warm-up save and load of a small tree, then the operation
with the kernel's high-water mark reset (``bench.memory``). Staging memory
is the peak RSS growth minus what the state itself occupies (on CPU the
devices' memory is the host's: a load's result counts as state, and so do
the tensors a budgeted export loads onto the default device). A save's row
also gives the peak it reported (``_CHECKPOINT_METADATA``, ``cp.staging``).
Prints a Markdown table (the one in docs/memory.md) and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from bench.memory import peak_growth

MIB = 1 << 20
OPS = (
    "save",
    "save_async",
    "load",
    "load_resharded",
    "load_unbudgeted_save",
    "st_load_resharded",
    "st_export",
)
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


def _prepare(op: str, tree: dict[str, Any], root: str) -> None:
    """What a load or an export reads: the checkpoint (saved under the same budget, so that
    its chunks stream) and, for the safetensors operations, the same tensors as a file."""
    import checkpointables as cp
    from checkpointables_safetensors import save_pytree

    if op == "load_unbudgeted_save":  # One chunk per shard, many pieces large.
        with cp.Context(memory_options=cp.options.MemoryOptions()):
            cp.save_pytree(os.path.join(root, "ckpt"), tree, overwrite=True)
    elif op.startswith(("load", "st_")):
        cp.save_pytree(os.path.join(root, "ckpt"), tree, overwrite=True)
    if op == "st_load_resharded":
        save_pytree(os.path.join(root, "model.safetensors"), tree, overwrite=True)


def _run(op: str, root: str, tree: dict[str, Any] | None, one: Any, mesh: Any) -> None:
    """The measured operation (``tree``: what a save writes)."""
    import checkpointables as cp
    import jax
    from checkpointables_safetensors import export_checkpoint

    path = os.path.join(root, "ckpt")
    if op == "st_export":
        export_checkpoint(path, os.path.join(root, "out.safetensors"), overwrite=True)
    elif op == "st_load_resharded":
        jax.block_until_ready(cp.load_pytree(os.path.join(root, "model.safetensors"), mesh))
    elif op.startswith("load"):
        jax.block_until_ready(cp.load_pytree(path, one if op == "load" else mesh))
    elif op == "save":
        cp.save_pytree(path, tree, overwrite=True)
    else:
        cp.save_pytree_async(path, tree, overwrite=True).result()


def _held(op: str, tree: dict[str, Any], budget: int | None) -> int:
    """What the operation's result occupies on the (CPU) devices, not counted as staging:
    a load's state; a budgeted export's tensors larger than its batches (loaded onto the
    default device and written from there)."""
    sizes = [x.nbytes for x in tree.values()]
    if op.startswith("load") or op == "st_load_resharded":
        return sum(sizes)
    if op == "st_export" and budget is not None:
        return max(n for n in sizes if n > budget // 4) if max(sizes) > budget // 4 else 0
    return 0


def _reported_peak(root: str) -> int | None:
    """The peak staging memory the save recorded in its ``_CHECKPOINT_METADATA``."""
    import checkpointables as cp

    with open(os.path.join(root, "ckpt", "_CHECKPOINT_METADATA")) as f:
        return cp.staging.recorded_peak(json.load(f))


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this fresh process."""
    import checkpointables as cp

    budget = args["budget"] * MIB if args["budget"] else None
    tree, one, mesh = _tree(args["size"] * MIB, args["count"])
    state = sum(x.nbytes for x in tree.values())
    held = _held(args["op"], tree, budget)
    root, op = args["root"], args["op"]
    with cp.Context(memory_options=cp.options.MemoryOptions(host_bytes=budget)):
        small = {"w": tree[next(iter(tree))][:64]}
        cp.save_pytree(os.path.join(root, "warm"), small, overwrite=True)
        cp.load_pytree(os.path.join(root, "warm"))
        _prepare(op, tree, root)
        saved = tree if op.startswith("save") else None
        tree = None  # Freed before the load: not held beside its result.
        # Freed memory handed back first (peak_growth): else a load reusing the freed tree
        # looks free.
        measured = measured_operation(op, root, saved, one, mesh)
    reported = _reported_peak(root) if op.startswith("save") else None
    staging, seconds = measured["growth"] - held, measured["seconds"]
    return {"staging": staging, "seconds": seconds, "state": state, "reported": reported}


def measured_operation(
    op: str, root: str, tree: dict[str, Any] | None, one: Any, mesh: Any
) -> dict[str, float]:
    """Runs ``op`` (see ``_run``) under ``bench.memory.peak_growth``; its measurements."""
    with peak_growth() as measured:
        _run(op, root, tree, one, mesh)
    return measured


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


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.0f} MiB"


def table(rows: list[dict[str, Any]], budget: int) -> str:
    """The Markdown table of ``rows`` (``reported``: a save's recorded peak staging)."""
    lines = [
        f"| case | operation | staging, no budget | staging, budget {budget} MiB "
        f"| reported, no budget | reported, budget | time, no budget | time, budget | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        none, within = r["none"], r["budget"]
        lines.append(
            f"| {r['case']} | {r['op']} | {_mib(none['staging'])} | {_mib(within['staging'])} "
            f"| {_mib(none.get('reported'))} | {_mib(within.get('reported'))} "
            f"| {none['seconds']:.2f} s | {within['seconds']:.2f} s "
            f"| {within['seconds'] / none['seconds']:.2f}x |"
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
