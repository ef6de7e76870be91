"""Incremental saves on a LoRA-shaped tree (issue 31): bytes written and wall time per save.

A frozen base of float32 weights in many arrays, trainable adapters, and Adam
state for the adapters (mu, nu, count), saved at successive steps by a
Checkpointer with ``reuse_unchanged`` on and off. Bytes written are counted
from the files each step created that no other retained step holds (``du``-style:
a hard link to another step's file is not new). A full fine-tune (every array
changed at every step) times what a reusing save spends on finding that out.
The default size is scaled down for a 2-core machine (``--base-mib``)::

    uv run python -m bench.incremental                       # 256 MiB base, 10 steps
    uv run python -m bench.incremental --base-mib 1024 --arrays 200 --adapter-mib 16
    uv run python -m bench.incremental --s3                  # bytes uploaded to moto's S3 server
    uv run python -m bench.run --case incremental            # the issue's sizes, with targets
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np

from bench import report

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


def _files(root: str, skip: str | None = None) -> dict[tuple[int, int], int]:
    """The disk bytes of each file under ``root`` (but not under ``skip``), by (device,
    inode): a hard-linked file once."""
    out = {}
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if os.path.join(directory, d) != skip]
        for name in names:
            try:
                st = os.stat(os.path.join(directory, name))
            except FileNotFoundError:  # A step the preservation policy is deleting now.
                continue
            out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return out


def _new_bytes(root: str, step_dir: str) -> int:
    """Bytes of ``step_dir``'s files that no other step under ``root`` holds now (not "not
    seen before": a deleted step's inode numbers are given to new files)."""
    others = _files(root, skip=step_dir)
    return sum(size for key, size in _files(step_dir).items() if key not in others)


def _disk_bytes(root: str) -> int:
    return sum(_files(root).values())


def _run(tree: dict, steps: int, keep, reuse: bool, root: str) -> dict:
    """Saves ``steps`` steps; with reuse, each save is followed by a plain save of the
    arrays that changed (``alone``), so that the two are compared under the same load."""
    written, times, alone = [], [], []
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
            written.append(_new_bytes(root, os.path.join(root, str(step))))
            if reuse:
                alone.append(_changed_alone(tree, f"{root}-alone", repeats=1))
    return {"written": written, "times": times, "alone": alone, "disk": _disk_bytes(root)}


def _frozen_base(name: str) -> bool:
    """The leaves a LoRA run declares frozen (``reuse_unchanged=<predicate>``)."""
    return name.startswith("base.")


def _changed_alone(tree: dict, root: str, repeats: int = 3) -> float:
    """Wall time of a plain save of the arrays that change (the adapters and their state)
    into ``root`` (removed after), the median of ``repeats``."""
    part = {"adapter": tree["adapter"], "opt": tree["opt"]}
    times = []
    for k in range(repeats):
        start = time.perf_counter()
        cp.save_pytree(os.path.join(root, f"part{k}"), part)
        times.append(time.perf_counter() - start)
    shutil.rmtree(root)
    return statistics.median(times)


@jax.jit
def _change_everything(tree: dict) -> dict:
    """A full fine-tune's step: every floating-point array changes (the base too)."""
    return jax.tree_util.tree_map(
        lambda a: a * 0.999 + 0.001 if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


@contextlib.contextmanager
def _timed_plans():
    """Collects the wall time of each ``reuse.plan_reuse`` call made inside (the handler
    looks it up on the ``reuse`` package at each save): the detection a reusing save pays,
    all of it in its blocking phase."""
    from checkpointables_pytree import reuse

    original, spent = reuse.plan_reuse, []

    async def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    reuse.plan_reuse = timed
    try:
        yield spent
    finally:
        reuse.plan_reuse = original


def measure_full_change(tree: dict, steps: int, scratch: str) -> dict:
    """Every array changed at every step: a Checkpointer with reuse on (the default) and one
    with it off save the same steps in turn (the order alternating), ``LatestN(2)``. The
    medians of their save times and of the reusing saves' detection (``plan_reuse``)."""
    roots = [tempfile.mkdtemp(prefix="bench-full-change-", dir=scratch) for _ in range(2)]
    decide = cp.training.save_decision_policies.EveryNStepsPolicy(1)
    keep = cp.training.preservation_policies.LatestN(2)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        with (
            _timed_plans() as plans,
            cp.training.Checkpointer(
                roots[0], save_decision_policy=decide, preservation_policy=keep
            ) as on,
            cp.training.Checkpointer(
                roots[1],
                save_decision_policy=decide,
                preservation_policy=keep,
                reuse_unchanged=False,
            ) as off,
        ):
            for step in range(steps):
                tree = _change_everything(tree)
                jax.block_until_ready(tree)
                for reusing, ckptr in ((True, on), (False, off))[:: 1 if step % 2 else -1]:
                    start = time.perf_counter()
                    ckptr.save_pytree(step, tree)
                    times[reusing].append(time.perf_counter() - start)
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "on": statistics.median(times[True][1:]),
        "off": statistics.median(times[False][1:]),
        "plan": statistics.median(plans[1:]),
    }


def _fingerprint_secs(tree: dict) -> tuple[float, float]:
    """Seconds to fingerprint every array: as a save does here for the arrays it cannot
    probe (NumPy arrays, S3, compression; ``reuse.probe``), and by the device reduction
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


def measure(base_mib: int, arrays: int, adapter_mib: int, steps: int, scratch: str) -> dict:
    """Every policy and reuse mode on the LoRA-shaped tree; the rows, the changed arrays'
    own save time and the fingerprint times."""
    tree = _tree(base_mib, arrays, adapter_mib)
    work = tempfile.mkdtemp(prefix="bench-incremental-", dir=scratch)
    try:
        rows = []
        policies = {
            "LatestN(3)": cp.training.preservation_policies.LatestN(3),
            "PreserveAll": cp.training.preservation_policies.PreserveAll(),
        }
        for name, keep in policies.items():
            for reuse in (False, True, _frozen_base):
                root = os.path.join(work, f"{name}-{reuse}")
                rows.append((name, reuse, _run(tree, steps, keep, reuse, root)))
                shutil.rmtree(root)
        full_change = measure_full_change(tree, steps, work)
        alone = _changed_alone(tree, work)  # Removes ``work``.
        fingerprint = _fingerprint_secs(tree)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"rows": rows, "alone": alone, "fingerprint": fingerprint, "full_change": full_change}


def measure_s3(tree: dict, steps: int) -> dict:
    """Bytes uploaded per save of a reusing Checkpointer on moto's S3 server (``LatestN(2)``:
    the server keeps its objects in memory), counted at the server by a proxy in front of it
    (the request bodies it receives), and the saves' wall times. Save 0 writes everything."""
    from bench.object_store import LocalS3, delete
    from tests.object_store_server import S3Proxy

    server = LocalS3()
    proxy = S3Proxy(server.endpoint)
    uploaded, times = [], []
    root = f"s3://{server.bucket}/incremental"
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # botocore's copies read it too.
    try:
        keep = cp.training.preservation_policies.LatestN(2)
        decide = cp.training.save_decision_policies.EveryNStepsPolicy(1)
        with cp.training.Checkpointer(
            root, save_decision_policy=decide, preservation_policy=keep, reuse_unchanged=True
        ) as ckptr:
            for step in range(steps):
                tree = _train_step(tree)
                jax.block_until_ready(tree)
                with proxy.counting() as counts:
                    start = time.perf_counter()
                    ckptr.save_pytree(step, tree)
                    times.append(time.perf_counter() - start)
                uploaded.append(counts.bytes_sent["PUT"] + counts.bytes_sent["POST"])
        delete(root)
    finally:
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        proxy.stop()
        server.stop()
    return {"uploaded": uploaded, "times": times}


def _s3_line(s3: dict, trainable: int) -> str:
    later = statistics.median(s3["uploaded"][1:])
    return (
        f"S3 (moto, bytes uploaded counted at the server): full save {s3['uploaded'][0] / MiB:.2f} "
        f"MiB in {s3['times'][0]:.2f} s; reusing saves {later / MiB:.2f} MiB (median; changed "
        f"{trainable / MiB:.2f} MiB) in {statistics.median(s3['times'][1:]):.2f} s"
    )


def _mode(reuse: object) -> str:
    return "frozen base declared" if callable(reuse) else ("on" if reuse else "off")


def _summary(rows: list) -> dict[tuple[str, str], dict[str, float]]:
    return {
        (name, _mode(reuse)): {
            "written": statistics.median(r["written"][1:]),
            "secs": statistics.median(r["times"][1:]),
            # The changed arrays saved alone right after each of those saves (reuse on).
            "alone": statistics.median(r["alone"][1:]) if r["alone"][1:] else None,
            "disk": r["disk"],
        }
        for name, reuse, r in rows
    }


def _targets(result: dict, base: int, trainable: int, steps: int) -> list[dict]:
    """The issue's targets, as ``report.targets_table`` rows (values are ratios)."""
    s = _summary(result["rows"])
    full, on = s[("LatestN(3)", "off")], s[("LatestN(3)", "on")]
    frozen = s[("LatestN(3)", "frozen base declared")]
    changed = result["full_change"]
    rows = [
        (
            "written_vs_changed",
            "<=",
            1.0,
            on["written"] / (trainable + MiB),
            "reusing save writes <= changed bytes + 1 MiB",
        ),
        (
            "fewer_bytes",
            ">=",
            50.0,
            full["written"] / on["written"],
            "reusing save writes >= 50x fewer bytes than a full save",
        ),
        (
            "time_vs_changed",
            "<=",
            1.2,
            on["secs"] / (on["alone"] or result["alone"]),
            "reusing save <= 1.2x saving the changed arrays alone",
        ),
        (
            "time_vs_changed_frozen",
            "<=",
            1.2,
            frozen["secs"] / (frozen["alone"] or result["alone"]),
            "same, frozen base declared",
        ),
        (
            "faster_than_full",
            ">=",
            20.0,
            full["secs"] / on["secs"],
            "reusing save >= 20x faster than a full save",
        ),
        (
            "faster_than_full_frozen",
            ">=",
            20.0,
            full["secs"] / frozen["secs"],
            "reusing save >= 20x faster than a full save, frozen base declared",
        ),
        (
            "disk_preserve_all",
            "<=",
            1.0,
            s[("PreserveAll", "on")]["disk"] / (base + steps * (trainable + MiB)),
            "PreserveAll: disk <= base + steps x (trainable + 1 MiB)",
        ),
        (
            "fingerprint_cost",
            "<=",
            0.05,
            changed["plan"] / changed["off"],
            "every array changed: detection (plan_reuse) <= 5% of a full save",
        ),
    ]
    return [
        report.target_row("incremental", metric, op, limit, value, text)
        for metric, op, limit, value, text in rows
    ]


def run_case(args: argparse.Namespace, scratch: str, say) -> dict:
    """``python -m bench.run --case incremental``: the issue's sizes times ``--scale``
    (1 GiB of base in 200 arrays, 16 MiB of adapters), 10 steps."""
    base_mib = max(16, int(1024 * args.scale))
    adapter_mib = max(1, int(16 * args.scale))
    arrays = 200 if args.scale >= 0.25 else 50
    say(f"\n== incremental: {base_mib} MiB base in {arrays} arrays, {adapter_mib} MiB adapters ==")
    steps = 4 if args.quick else 10
    result = measure(base_mib, arrays, adapter_mib, steps, scratch)
    say(_table(result))
    trainable = 3 * adapter_mib * MiB
    s3 = measure_s3(_tree(base_mib, arrays, adapter_mib), 4)
    say(_s3_line(s3, trainable))
    summary = {f"{k[0]} / {k[1]}": v for k, v in _summary(result["rows"]).items()}
    targets = _targets(result, base_mib * MiB, trainable, steps)
    uploaded = statistics.median(s3["uploaded"][1:]) / (trainable + MiB)
    targets.append(
        {
            **targets[0],
            "metric": "s3_uploaded_vs_changed",
            "text": "S3 server: a reusing save uploads <= changed bytes + 1 MiB",
            "value": uploaded,
            "verdict": "PASS" if uploaded <= 1.0 else "FAIL",
        }
    )
    return {
        "s3_uploaded": s3["uploaded"],
        "s3_save_s": s3["times"],
        "bytes": base_mib * MiB + trainable,
        "rows": summary,
        "changed_alone_s": result["alone"],
        "fingerprint_s": result["fingerprint"][0],
        "device_reduction_s": result["fingerprint"][1],
        "full_change_s": result["full_change"],
        "targets": targets,
    }


def _table(result: dict) -> str:
    lines = [
        "| policy | reuse | bytes written, later saves (median) | save wall s (median) | "
        "changed arrays alone, after each save (median) | disk after all steps |",
        "|---|---|---|---|---|---|",
    ]
    for (name, mode), r in _summary(result["rows"]).items():
        alone = "" if r["alone"] is None else f"{r['alone']:.3f}"
        lines.append(
            f"| {name} | {mode} | {r['written'] / MiB:.2f} MiB | {r['secs']:.3f} | {alone} | "
            f"{r['disk'] / MiB:.0f} MiB |"
        )
    fingerprint = result["fingerprint"]
    lines.append(
        f"saving the changed arrays alone, at the end: {result['alone']:.3f} s; fingerprints of "
        f"the whole tree: {fingerprint[0]:.3f} s (the device reduction on {jax.default_backend()}: "
        f"{fingerprint[1]:.3f} s)"
    )
    changed = result["full_change"]
    lines.append(
        f"every array changed at each step (median): reuse on {changed['on']:.3f} s, off "
        f"{changed['off']:.3f} s; the reusing save's detection (plan_reuse) {changed['plan']:.4f} s"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-mib", type=int, default=256)
    parser.add_argument("--arrays", type=int, default=50)
    parser.add_argument("--adapter-mib", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--s3", action="store_true", help="only the S3 case (moto's server)")
    args = parser.parse_args()
    trainable = 3 * args.adapter_mib * MiB
    if args.s3:
        tree = _tree(args.base_mib, args.arrays, args.adapter_mib)
        print(_s3_line(measure_s3(tree, min(args.steps, 4)), trainable))
        return
    result = measure(
        args.base_mib, args.arrays, args.adapter_mib, args.steps, tempfile.gettempdir()
    )
    print(
        f"base {args.base_mib} MiB in {args.arrays} arrays, trainable (adapters + mu + nu) "
        f"{trainable / MiB:.0f} MiB, {args.steps} steps, jax {jax.default_backend()}"
    )
    print(_table(result))


if __name__ == "__main__":
    main()
