"""The safetensors plugin keeps ``cp.options.MemoryOptions(host_bytes=...)``.

A child process with 8 CPU devices loads a safetensors file onto a 2x4 mesh and
exports a checkpoint of the same tensors (one tensor many times the budget, and
smaller ones), and reports each operation's peak RSS growth minus what the
result occupies on the devices (on CPU devices, the host's memory): the loaded
state, or for the export the large tensor (loaded onto the default device and
written from there in pieces). The same child without a budget shows that the
measurement catches the unbounded windows, batches and copies.
"""

from __future__ import annotations

import checkpointables as cp
import jax
import numpy as np
from checkpointables_safetensors import _reads, import_safetensors, save_pytree
from checkpointables_safetensors._files import open_tensor_set
from checkpointables_safetensors._reads import THREADS, Limits, pieces
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file

from tests.peak_rss import run_child
from tests.plugins.safetensors.files import BF16, random_bits

BUDGET = 8 << 20
LARGE = 256 << 20  # One float32 tensor of 32x the budget; and 32 tensors of 4 MiB.
SMALL, SMALL_COUNT = 4 << 20, 32
# Beyond the budget, per operation. The export compiles XLA updates (its slices of
# jax.Arrays); a load onto CPU devices compiles nothing (regions are aliased, not
# streamed), so only the threads' stacks and the allocator's rounding remain.
# Measured on the 2-core CI machine, 10 runs each: budgeted, load 7-9 MiB and export
# 5-13 MiB; unbudgeted, load 30-102 MiB (at least about one 32 MiB window of mapped
# pages) and export 97-130 MiB. The bounds sit between, with room on both sides.
SLACK = {"load_on_mesh": 8 << 20, "export": 24 << 20}

CHILD = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import checkpointables as cp
from checkpointables_safetensors import export_checkpoint, save_pytree

budget, large, small, count = map(int, sys.argv[1:5])
root = sys.argv[5]
rows = 1024
tensors = {"big": np.arange(large // 4, dtype=np.float32).reshape(rows, -1)}
for i in range(count):
    tensors[f"s{i}"] = np.full((rows, small // 4 // rows), i, np.float32)
file = os.path.join(root, "model.safetensors")
save_pytree(file, tensors)
options = cp.options.MemoryOptions(host_bytes=budget or None)
with cp.Context(memory_options=options):  # Chunks a budgeted load streams (docs/memory.md).
    cp.save_pytree(os.path.join(root, "ckpt"), tensors)
expected = {k: (v.sum(dtype=np.float64), v.shape) for k, v in tensors.items()}
del tensors
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
sharding = NamedSharding(mesh, P("b", "a"))
abstract = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=sharding) for k, (_, s) in
            expected.items()}
report = {}
with cp.Context(memory_options=options):
    # Warm-up: imports, thread pools, compiles.
    with cp.Context(pytree_options=cp.options.PyTreeOptions(partial_load=True)):
        cp.load_pytree(file, {"s0": abstract["s0"]})
    export_checkpoint(os.path.join(root, "ckpt"), os.path.join(root, "w"), subtree="s0")
    total = large + small * count
    loaded, report["load_on_mesh"] = measured(lambda: cp.load_pytree(file, abstract), total)
    report["exact"] = all(float(np.asarray(loaded[k]).sum(dtype=np.float64)) == float(s)
                          for k, (s, _) in expected.items())
    report["on_mesh"] = all(v.sharding == sharding for v in loaded.values())
    del loaded
    out = os.path.join(root, "out.safetensors")
    _, report["export"] = measured(
        lambda: export_checkpoint(os.path.join(root, "ckpt"), out), large)
    from safetensors.numpy import load_file
    back = load_file(out)
    report["exported_exact"] = all(float(back[k].sum(dtype=np.float64)) == float(s)
                                   for k, (s, _) in expected.items())
print(json.dumps(report))
"""


def _run(tmp_path, budget: int) -> dict[str, int]:
    return run_child(CHILD, str(budget), str(LARGE), str(SMALL), str(SMALL_COUNT), str(tmp_path))


def test_load_onto_a_mesh_and_export_stay_within_the_budget(tmp_path) -> None:
    report = _run(tmp_path, BUDGET)
    assert report["exact"] and report["on_mesh"] and report["exported_exact"], report
    for op in ("load_on_mesh", "export"):
        assert report[op] <= BUDGET + SLACK[op], (op, report[op] >> 20, report)


def test_without_a_budget_they_stage_more(tmp_path) -> None:
    """The measurement can fail: without a budget the reading windows and the export's
    batches (the large tensor whole on the host) exceed the bound."""
    report = _run(tmp_path, 0)
    assert report["exact"] and report["exported_exact"], report
    for op in ("load_on_mesh", "export"):
        assert report[op] > BUDGET + SLACK[op], (op, report[op] >> 20, report)


def test_the_limits_fit_the_budget() -> None:
    limits = Limits.of(BUDGET)
    assert THREADS * (limits.piece + limits.window) <= BUDGET * 3 // 4
    assert limits.streamed and not Limits.of(None).streamed
    # A tensor larger than the budget is read in row ranges of at most a piece.
    shape = (1024, LARGE // 4 // 1024)
    assert all(
        np.prod([s.stop - s.start for s in p]) * 4 <= limits.piece
        for p in pieces(shape, 4, limits.piece)
    )


def test_budgeted_exports_and_imports_are_bit_exact(tmp_path) -> None:
    """In-memory exports write jax.Arrays in pieces (sharded ones sliced on their devices);
    imports read within the budget: the bytes are those of the unbudgeted round trip."""
    host = {"w": random_bits((1024, 4096), np.float32), "h": random_bits((64, 8192), BF16)}
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    tree = {
        "w": jax.device_put(host["w"], NamedSharding(mesh, PartitionSpec("x"))),
        "h": jax.device_put(host["h"], jax.devices()[0]),
    }
    with cp.Context(memory_options=cp.options.MemoryOptions(host_bytes=BUDGET)):
        save_pytree(tmp_path / "m.safetensors", tree)
        import_safetensors(tmp_path / "m.safetensors", tmp_path / "ckpt")
    back = load_file(tmp_path / "m.safetensors")
    imported = cp.load_pytree(tmp_path / "ckpt")
    for name, values in host.items():
        assert back[name].tobytes() == values.tobytes(), name
        assert np.asarray(imported[name]).tobytes() == values.tobytes(), name


def test_regions_streamed_onto_devices_are_assembled_exactly(tmp_path) -> None:
    """What a budgeted load does on accelerators (here forced onto CPU devices): each region
    built on its devices from pieces of at most ``Limits.piece``, cast there."""
    # Rows of 273 KiB: 3 rows a piece of 1 MiB; finite values, cast alike by NumPy and XLA.
    values = np.random.default_rng(1).standard_normal((300, 70_001), dtype=np.float32)
    save_pytree(tmp_path / "m.safetensors", {"w": values})
    tensor = open_tensor_set(tmp_path / "m.safetensors").tensors["w"]
    files = _reads._OpenFiles(Limits.of(BUDGET))
    read = _reads.ArrayRead(tensor, np.dtype(BF16))
    region = (slice(7, 299), slice(0, 70_001))
    try:
        on_devices = _reads._to_devices(files, read, region, jax.devices()[:2])
    finally:
        files.close()
    expected = values[region].astype(BF16)
    for array, device in zip(on_devices, jax.devices()[:2], strict=True):
        assert array.devices() == {device}
        assert np.asarray(array).tobytes() == expected.tobytes()
