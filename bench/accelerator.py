"""Host staging memory and the save stall on an accelerator, where device memory is not host memory.

    python -m bench.accelerator [--size-mib 2048] [--budget-mib 256] [--output FILE]

On CPU devices a state lives in host memory, so the bounded-memory harness
(``bench.memory_budget``) must subtract it from the RSS; on a GPU or TPU the
RSS growth of a save or load *is* its host staging. Each measurement runs in
a fresh process on the default backend's first device:

* ``staging``: the issue-30 cases (one array of ``--size-mib`` and the same
  bytes in 64 arrays), saved (``save_pytree``, ``save_pytree_async(...)
  .result()``) and loaded onto the device, without a budget and with
  ``MemoryOptions(host_bytes=--budget-mib)``: peak RSS growth, the growth
  still held after the call (the caller keeps its arrays), and time.
* ``stall``: a state of ``--stall-mib`` (1 GiB) in 8 arrays: the device-to-host copy alone
  (``jax.device_get``), the time ``save_pytree_async`` holds its caller, and
  the time a Checkpointer with a local tier holds it (issue 32's stall target
  is 1.1x the copy).

Prints one JSON line per measurement and writes them all to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.memory import trimmed_rss
from bench.memory_budget import measured_operation

MIB = 1 << 20
CASES = {"one-array": 1, "64-arrays": 64}
OPS = ("save", "save_async", "load")


def _tree(size: int, count: int) -> dict[str, Any]:
    import jax
    import numpy as np

    rows = 1024
    cols = max(8, size // 4 // count // rows)
    key = jax.random.key(30)
    return {
        f"w{i:02d}": jax.random.normal(jax.random.fold_in(key, i), (rows, cols), np.float32)
        for i in range(count)
    }


def staging_child(args: dict[str, Any]) -> dict[str, Any]:
    """One staging measurement, in this fresh process."""
    import checkpointables as cp
    import jax

    budget = args["budget"]
    options = cp.options.MemoryOptions(host_bytes=budget * MIB if budget else None)
    tree = jax.block_until_ready(_tree(args["size"] * MIB, args["count"]))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    root, op = args["root"], args["op"]
    path = os.path.join(root, "ckpt")
    with cp.Context(memory_options=options):
        warm = os.path.join(root, "warm")
        cp.save_pytree(warm, {"w": tree[next(iter(tree))][:64]}, overwrite=True)
        jax.block_until_ready(cp.load_pytree(warm))
        if op == "load":
            cp.save_pytree(path, tree, overwrite=True)
            tree = None  # Freed before the load: not held beside its result.
        measured = measured_operation(op, root, tree, abstract, abstract)
        # Host memory still held once the call is over while the caller keeps its arrays
        # (a training loop's frozen weights): a jax.Array keeps a host copy made of it.
        after = trimmed_rss() - measured["baseline"]
        same = tree is None or _same(tree, cp.load_pytree(path, abstract))
    growth = measured["growth"]
    return {
        "staging_mib": growth / MIB,
        "held_after_mib": after / MIB,
        "seconds": measured["seconds"],
        "roundtrip_ok": same,
    }


def _same(tree: dict[str, Any], loaded: dict[str, Any]) -> bool:
    """Whether a save wrote ``tree`` bit for bit (compared on the device)."""
    import jax.numpy as jnp

    return all(bool(jnp.array_equal(tree[k], loaded[k])) for k in tree)


def _fresh(tree: dict[str, Any]) -> dict[str, Any]:
    """New arrays of the same values: a jax.Array keeps the host copy ``device_get`` made, so
    copying or saving the same arrays twice would time nothing."""
    import jax

    return jax.block_until_ready(jax.tree.map(lambda x: x * 1.0, tree))


def stall_child(args: dict[str, Any]) -> dict[str, Any]:
    """The device-to-host copy of a state in 8 arrays against what each save holds its caller."""
    import checkpointables as cp
    import jax
    from checkpointables.training import save_decision_policies as policies

    tree = jax.block_until_ready(_tree(args["mib"] * MIB, 8))
    root, repeats = args["root"], args["repeats"]
    copies, stalls, tier = [], [], []
    for i in range(repeats + 1):
        tree = _fresh(tree)
        start = time.perf_counter()
        jax.device_get(tree)
        copies.append(time.perf_counter() - start)
        tree = _fresh(tree)
        start = time.perf_counter()
        response = cp.save_pytree_async(os.path.join(root, f"a{i}"), tree, overwrite=True)
        stalls.append(time.perf_counter() - start)
        response.result()
    same = _same(tree, cp.load_pytree(os.path.join(root, f"a{repeats}")))
    local = cp.training.LocalTier(
        os.path.join(root, "local"),
        save_decision_policy=policies.EveryNStepsPolicy(1),
        replicas=0,
    )
    with cp.training.Checkpointer(
        os.path.join(root, "persistent"),
        save_decision_policy=policies.EveryNStepsPolicy(1000),
        local_tier=local,
    ) as ckptr:
        for step in range(1, repeats + 2):
            tree = _fresh(tree)
            start = time.perf_counter()
            ckptr.save_pytree_async(step, tree)
            tier.append(time.perf_counter() - start)
            ckptr.wait()
    # The first of each is a warm-up.
    med = {
        k: statistics.median(v[1:])
        for k, v in (("copy", copies), ("async", stalls), ("tier", tier))
    }
    return {
        "device_get_s": med["copy"],
        "save_async_stall_s": med["async"],
        "local_tier_stall_s": med["tier"],
        "async_over_copy": med["async"] / med["copy"],
        "tier_over_copy": med["tier"] / med["copy"],
        "roundtrip_ok": same,
    }


def _child(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.accelerator", "--child", kind, json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if done.returncode:
        return {"error": done.stderr[-1500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Runs the staging cases, then the stall case; one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="stall repeats")
    parser.add_argument("--stall-mib", type=int, default=1024, help="the stall case's state")
    parser.add_argument("--only", choices=("staging", "stall"))
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: both")
    parser.add_argument("--op", choices=OPS, action="append", help="default: all")
    parser.add_argument("--output", help="JSON file of the numbers")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = staging_child if args.child[0] == "staging" else stall_child
        print(json.dumps(child(json.loads(args.child[1]))), flush=True)
        return
    import jax

    rows: list[dict[str, Any]] = [{"device": str(jax.devices()[0].device_kind)}]
    print(json.dumps(rows[0]), flush=True)
    with tempfile.TemporaryDirectory() as root:
        if args.only != "stall":
            for case in args.case or CASES:
                for op in args.op or OPS:
                    for budget in (None, args.budget_mib):
                        spec = {
                            "count": CASES[case],
                            "op": op,
                            "budget": budget,
                            "size": args.size_mib,
                        }
                        row = {"case": case, "op": op, "budget_mib": budget}
                        row.update(_child("staging", {**spec, "root": root}))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        if args.only != "staging":
            spec = {"root": root, "repeats": args.repeats, "mib": args.stall_mib}
            row = {"case": f"stall-{args.stall_mib}mib", **_child("stall", spec)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
