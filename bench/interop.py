"""Interop cases: loading Hugging Face safetensors files (issue 20).

    uv run python -m bench.run --case safetensors-1gib        # time and memory, with targets
    uv run python -m bench.run --case safetensors-2gib-mesh   # memory onto an 8-device mesh

``safetensors-1gib`` times ``cp.load_pytree("model.safetensors")`` (a tree of
``jax.Array``) against ``safetensors.numpy.load_file`` + ``jax.device_put``
on one 1 GiB file of 16 float32 tensors written by the safetensors package,
interleaved per repeat like the other cases, and measures each one's peak RSS
growth in a fresh process. Targets: at most 1.2x safetensors' time, and a
peak at most 1.1x the file's size (safetensors' loader holds the whole file
besides the arrays).

``safetensors-2gib-mesh`` measures memory only: a 2 GiB file loaded onto a
mesh of 8 CPU devices (each tensor sharded by rows) in a fresh process. On
CPU the loaded arrays are host memory, so the number that shows the load
never holds the file besides them is the *overhead*: peak growth minus the
bytes of the loaded arrays.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import cases, memory, report, timing

__all__ = ["CASES", "run_case"]

LIBRARIES = ("checkpointables", "safetensors")
FILE_NAME = "model.safetensors"
MESH_DEVICES = 8


def _tensors(total_bytes: int, scale: float) -> dict[str, Any]:
    arrays = cases.big_arrays(scale, total_bytes=total_bytes)
    return {f"model.layers.{i}.weight": a for i, a in enumerate(arrays.values())}


def write_file(path: str, total_bytes: int, scale: float) -> int:
    """Writes the case's file with the safetensors package; returns its size."""
    from safetensors.numpy import save_file

    save_file(_tensors(total_bytes, scale), path, {"format": "pt"})
    return os.path.getsize(path)


def _mesh_abstract(path: str) -> Any:
    """The file's abstract tree, each tensor sharded by rows over every device.

    (Replicated instead where the rows do not divide evenly: tiny ``--scale`` runs.)
    """
    import checkpointables as cp
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("x",))

    def sharded(s: Any) -> Any:
        spec = PartitionSpec("x") if s.shape[0] % mesh.size == 0 else PartitionSpec()
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(sharded, cp.pytree_metadata(path).metadata)


def load(library: str, path: str, mesh: bool = False) -> Any:
    """One load of ``path`` by ``library``, materialized (``block_until_ready``)."""
    import jax

    if library == "checkpointables":
        import checkpointables as cp

        return jax.block_until_ready(cp.load_pytree(path, _mesh_abstract(path) if mesh else None))
    from safetensors.numpy import load_file

    arrays = load_file(path)
    if not mesh:
        return jax.block_until_ready({k: jax.device_put(v) for k, v in arrays.items()})
    abstract = _mesh_abstract(path)
    shardings = {
        ".".join(str(k.key) for k in p): s.sharding
        for p, s in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    return jax.block_until_ready(
        {
            k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i])
            for k, v in arrays.items()
        }
    )


def _check(loaded: dict[str, Any], path: str) -> None:
    import jax
    import numpy as np
    from safetensors import safe_open

    with_paths = jax.tree_util.tree_flatten_with_path(loaded)[0]
    flat = {".".join(str(k.key) for k in p): v for p, v in with_paths}
    with safe_open(path, "numpy") as f:
        if sorted(flat) != sorted(f.keys()):
            raise AssertionError(f"the loaded keys differ from the file's: {sorted(flat)[:3]}")
        name = f.keys()[-1]
        if not np.array_equal(np.asarray(flat[name]), f.get_tensor(name)):
            raise AssertionError(f"the loaded {name} differs from the file's")


def _time(path: str, repeats: int, warmup: int, warm_bytes: int, say: Callable[..., None]) -> dict:
    seconds: dict[str, list[float]] = {lib: [] for lib in LIBRARIES}
    for round_no in range(warmup + repeats):
        for lib in LIBRARIES:
            timing.warm_free_memory(warm_bytes)
            timing.release_malloc_cache()
            start = time.perf_counter()
            loaded = load(lib, path)
            elapsed = time.perf_counter() - start
            if round_no == 0:
                _check(loaded, path)
            del loaded
            if round_no >= warmup:
                seconds[lib].append(elapsed)
        if round_no >= warmup:
            say(
                f"  repeat {round_no - warmup + 1}/{repeats} load s: "
                + ", ".join(f"{lib} {seconds[lib][-1]:.3f}" for lib in LIBRARIES)
            )
    return {lib: {"load_s": s, "median": statistics.median(s)} for lib, s in seconds.items()}


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One memory measurement in this fresh process (``python -m bench.interop '<json>'``)."""
    import gc

    import jax
    import numpy as np
    from safetensors.numpy import save_file

    # Warm-up on a tiny file: imports and thread pools are not what is measured.
    probe = os.path.join(os.path.dirname(args["path"]), f"probe-{os.getpid()}.safetensors")
    save_file({"a": np.ones((64, 8), np.float32)}, probe)
    try:
        load(args["library"], probe, args["mesh"])
    finally:
        os.remove(probe)
    gc.collect()
    time.sleep(0.1)
    baseline = memory.status_kib("VmRSS") * 1024
    exact = memory.reset_high_water_mark()
    with memory.Sampler() as sampler:
        start = time.perf_counter()
        loaded = load(args["library"], args["path"], args["mesh"])
        seconds = time.perf_counter() - start
    peak = max(memory.status_kib("VmHWM") * 1024 if exact else 0, sampler.peak)
    result_bytes = sum(x.nbytes for x in jax.tree.leaves(loaded))
    return {
        "growth": peak - baseline,
        "result_bytes": result_bytes,
        "overhead": peak - baseline - result_bytes,
        "seconds": seconds,
        "devices": jax.device_count(),
        "method": "VmHWM after clear_refs" if exact else "RSS sampled every 5 ms",
    }


def _measure(library: str, path: str, mesh: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if mesh:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={MESH_DEVICES}"
        env["JAX_PLATFORMS"] = "cpu"
    return memory.run_child(
        "bench.interop", {"library": library, "path": path, "mesh": mesh}, library, env
    )


def _memory(path: str, size: int, mesh: bool, say: Callable[..., None]) -> dict[str, Any]:
    out = {}
    for lib in LIBRARIES:
        try:
            m = _measure(lib, path, mesh)
            m["fraction"] = m["growth"] / size
            say(
                f"  memory {lib}{' (mesh)' if mesh else ''}: peak +{m['growth'] / 2**30:.3f} GiB "
                f"({m['fraction']:.2f}x of the file), overhead beyond the arrays "
                f"{m['overhead'] / 2**20:+.0f} MiB, {m['devices']} device(s), {m['method']}"
            )
        except Exception as e:
            m = {"error": f"{type(e).__name__}: {e}"}
            say(f"  memory {lib}: FAILED: {m['error']}")
        out[lib] = m
    return out


def _targets(name: str, times: dict | None, mem: dict) -> list[dict[str, Any]]:
    rows = []
    if times is not None:
        ratio = times["checkpointables"]["median"] / times["safetensors"]["median"]
        text = "load <= 1.2x safetensors load_file + device_put"
        rows.append(("load_vs_safetensors", 1.2, ratio, text))
    fraction = mem.get("checkpointables", {}).get("fraction")
    rows.append(("mem_load", 1.1, fraction, "peak RSS growth, load <= 1.1x file size"))
    return [
        report.target_row(name, metric, "<=", limit, value, text)
        for metric, limit, value, text in rows
    ]


def _run(
    name: str, total_bytes: int, mesh: bool, args: Any, scratch: str, say: Callable[..., None]
) -> dict[str, Any]:
    path = os.path.join(scratch, f"{name}-{FILE_NAME}")
    try:
        size = write_file(path, total_bytes, args.scale)
        say(f"\n== {name}: {size / 2**20:.1f} MiB file of 16 float32 tensors ==")
        times = None
        if not mesh:
            warm = int(args.warm_memory * size)
            times = _time(path, args.repeats, args.warmup, warm, say)
        mem = {} if args.no_memory else _memory(path, size, mesh, say)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"bytes": size, "times": times, "memory": mem, "targets": _targets(name, times, mem)}


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    "safetensors-1gib": lambda args, scratch, say: _run(
        "safetensors-1gib", cases.GIB, False, args, scratch, say
    ),
    "safetensors-2gib-mesh": lambda args, scratch, say: _run(
        "safetensors-2gib-mesh", 2 * cases.GIB, True, args, scratch, say
    ),
}


def run_case(name: str, args: Any, scratch: str, say: Callable[..., None]) -> dict[str, Any]:
    """Runs interop case ``name`` with the benchmark's settings; returns its results.

    The result's ``targets`` rows have the fields of ``report.evaluate``'s; a
    failure is recorded under ``error`` (and fails the run), not raised.
    """
    try:
        return CASES[name](args, scratch, say)
    except Exception as e:
        say(f"  {name}: FAILED: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}", "targets": []}


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
