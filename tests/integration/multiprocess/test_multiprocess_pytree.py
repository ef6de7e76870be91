"""Multi-process saves and restores of sharded pytrees, with real jax.distributed processes.

Every test spawns its own processes on 127.0.0.1 (free ports, bounded time).
A module-scoped job saves one checkpoint with 2 processes x 2 devices; the
other tests restore it on other topologies: this test process (one process,
8 devices), 2 processes x 4 devices with another mesh, and Orbax.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import time

import checkpointables as cp
import jax
import numpy as np
import pytest
import tensorstore as ts

from .launcher import run_job

pytestmark = pytest.mark.multiprocess
P = jax.sharding.PartitionSpec


def values() -> dict[str, np.ndarray]:
    """The global arrays: identical in the test process and in every job's processes."""
    return {
        # 512 KiB: written in batches of encoded chunks, not through the zarr3 driver.
        "sharded": np.arange(64 * 2048, dtype=np.float32).reshape(64, 2048),
        "replicated": np.arange(32, dtype=np.int32).reshape(4, 8),
        "by_row": np.arange(8 * 300, dtype=np.float32).reshape(8, 300) / 7,
        "by_column": -np.arange(4 * 600, dtype=np.float32).reshape(4, 600),
        # 8 MiB: written through TensorStore's zarr3 driver, read as byte ranges of its chunks.
        "large": np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024),
    }


VALUES = "import numpy as np\n" + inspect.getsource(values)

# In a job: the global arrays over a 2x2 mesh whose rows are the two processes.
SAVE_TREE = (
    VALUES
    + """
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
SPECS = {"sharded": P("x", "y"), "replicated": P(), "by_row": P("x"), "by_column": P(None, "y"),
         "large": P("x")}

def global_tree():
    tree = {}
    for name, value in values().items():
        sharding = NamedSharding(MESH, SPECS[name])
        tree[name] = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
    tree["host"] = {"table": np.linspace(0, 1, 7), "step": 12, "lr": 0.5, "run": "exp-7"}
    return tree
"""
)

# Records which files of the checkpoint format this process opens for writing
# (Python's audit hooks see every open, including pathlib's and os.open's).
WRITE_AUDIT = """
import json as _json
SHARED_FILES = {"_CHECKPOINT_METADATA", "orbax.checkpoint", "commit_success.txt", "_METADATA",
                "_sharding", "_strings.json", "data.json"}
WRITTEN = set()

def _audit(event, args):
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path, mode, flags = args
    writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
        flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    name = os.path.basename(os.fsdecode(path))
    if writing and name in SHARED_FILES:
        WRITTEN.add(name)

sys.addaudithook(_audit)
"""

SAVE_BODY = (
    SAVE_TREE
    + WRITE_AUDIT
    + """
root = sys.argv[1]
tree = global_tree()
cp.save_pytree(root + "/pytree_ckpt", tree, custom_metadata={"saved_by": NUM_PROCESSES})
# Each process returns only once the checkpoint is committed: it loads at once.
loaded = cp.load_pytree(root + "/pytree_ckpt")
assert loaded["host"]["run"] == "exp-7"
np.testing.assert_array_equal(np.asarray(loaded["sharded"]), values()["sharded"])

cp.save_checkpointables(root + "/two_items", {"state": tree, "extra": {"note": "hello"}})
assert cp.load_checkpointables(root + "/two_items")["extra"] == {"note": "hello"}

policy = cp.training.preservation_policies.LatestN(2)
with cp.training.Checkpointer(root + "/run", preservation_policy=policy) as checkpointer:
    for step in range(3):
        state = {"w": tree["sharded"] + step, "r": tree["replicated"] + step}
        assert checkpointer.save_pytree(step, state, force=True)
    checkpointer.wait()
    print("STEPS", [s.step for s in checkpointer.steps()], flush=True)
print("WRITTEN", _json.dumps(sorted(WRITTEN)), flush=True)
"""
)


def _output(result, tag: str) -> str:
    for line in result.stdout.splitlines():
        if line.startswith(tag + " "):
            return line[len(tag) + 1 :]
    raise AssertionError(f"process {result.process_id} printed no {tag} line:\n{result.stdout}")


def _keys(database) -> set[str]:
    store = ts.KvStore.open(
        {"driver": "ocdbt", "base": {"driver": "file", "path": str(database)}}
    ).result()
    return {k.decode() for k in store.list().result()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints saved by 2 processes x 2 devices, and what each process printed."""
    root = tmp_path_factory.mktemp("saved_by_two")
    results = [r.check() for r in run_job(SAVE_BODY, args=[str(root)])]
    return root, results


def test_each_process_writes_the_shards_it_owns_once(saved) -> None:
    root, _ = saved
    directory = root / "pytree_ckpt" / "pytree"
    mine, theirs = _keys(directory / "ocdbt.process_0"), _keys(directory / "ocdbt.process_1")
    chunks = lambda keys, name: {k for k in keys if k.startswith(name + "/c")}  # noqa: E731
    # P("x", "y"): each process writes the two quarters its devices hold.
    assert chunks(mine, "sharded") == {"sharded/c/0/0", "sharded/c/0/1"}
    assert chunks(theirs, "sharded") == {"sharded/c/1/0", "sharded/c/1/1"}
    # P("x"), partially replicated: one row block each, each written once.
    assert chunks(mine, "by_row") == {"by_row/c/0/0"} and chunks(theirs, "by_row") == {
        "by_row/c/1/0"
    }
    assert chunks(mine, "large") == {"large/c/0/0"} and chunks(theirs, "large") == {"large/c/1/0"}
    # P(None, "y") is replicated across the processes; P() everywhere: process 0 holds replica 0.
    assert chunks(mine, "by_column") == {"by_column/c/0/0", "by_column/c/0/1"}
    assert chunks(mine, "replicated") == {"replicated/c/0/0"}
    # Host values and every zarr.json: the primary host only.
    assert {"host.table/c/0", "host.step/c", "host.lr/c", "replicated/zarr.json"} <= mine
    assert theirs == {"sharded/c/1/0", "sharded/c/1/1", "by_row/c/1/0", "large/c/1/0"}
    # The root database is the merge of both, and copied no array data.
    assert _keys(directory) == mine | theirs
    root_bytes = sum(f.stat().st_size for f in (directory / "d").iterdir())
    assert root_bytes < 64 << 10, "the merged root must reference, not copy, the processes' data"


def test_only_the_primary_host_writes_metadata_and_commits(saved) -> None:
    root, (primary, other) = saved
    written = set(json.loads(_output(primary, "WRITTEN")))
    assert {
        "_CHECKPOINT_METADATA",
        "orbax.checkpoint",
        "commit_success.txt",
        "_METADATA",
    } <= written
    assert {"_sharding", "_strings.json", "data.json"} <= written
    assert json.loads(_output(other, "WRITTEN")) == []
    # array_metadatas are per process, as in Orbax's format.
    names = sorted(p.name for p in (root / "pytree_ckpt" / "pytree" / "array_metadatas").iterdir())
    assert names == ["process_0", "process_1"]
    assert cp.pytree_metadata(root / "pytree_ckpt").custom_metadata == {"saved_by": 2}


def test_checkpointer_and_save_checkpointables_on_every_process(saved) -> None:
    root, results = saved
    for result in results:
        assert _output(result, "STEPS") == "[1, 2]"
    with cp.training.Checkpointer(root / "run") as checkpointer:
        assert [s.step for s in checkpointer.steps()] == [1, 2]
        state = checkpointer.load_pytree(2)
    np.testing.assert_array_equal(np.asarray(state["w"]), values()["sharded"] + 2)
    loaded = cp.load_checkpointables(root / "two_items")
    assert loaded["extra"] == {"note": "hello"}
    np.testing.assert_array_equal(np.asarray(loaded["state"]["large"]), values()["large"])
    assert sorted(os.listdir(root)) == ["pytree_ckpt", "run", "two_items"]  # No leftovers.


def _assert_tree(loaded) -> None:
    for name, value in values().items():
        assert isinstance(loaded[name], jax.Array)
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)
    np.testing.assert_array_equal(loaded["host"]["table"], np.linspace(0, 1, 7))
    assert loaded["host"]["step"] == 12 and loaded["host"]["lr"] == 0.5
    assert loaded["host"]["run"] == "exp-7"


def _assert_nodes_recorded(pytree) -> None:
    """Every node of the final b-tree (after the merges) is in ``_btree_checksums``, which
    ``_CHECKSUMS`` covers: a forged node is refused (tests/plugins/pytree/test_forged_nodes)."""
    from checkpointables_pytree import ocdbt

    listed = json.loads((pytree / ocdbt.NODE_CHECKSUMS_FILE).read_text())["nodes"]
    assert set(listed) == set(ocdbt.node_checksums(pytree)) != set()
    checksums = (pytree.parent / cp.metadata_checksums.CHECKSUMS_FILE).read_text()
    assert f"{pytree.name}/{ocdbt.NODE_CHECKSUMS_FILE}" in checksums


def test_loads_in_one_process_with_eight_devices(saved) -> None:
    root, _ = saved
    # No abstract tree: the saving topology (devices 0, 1, 2048, 2049) is not needed.
    loaded = cp.load_pytree(root / "pytree_ckpt")
    _assert_tree(loaded)
    assert loaded["sharded"].sharding.device_set == {jax.devices()[0]}
    # Onto a 4x2 mesh of this process's devices.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    abstract = cp.pytree_metadata(root / "pytree_ckpt").metadata
    for name in values():
        abstract[name] = jax.ShapeDtypeStruct(
            abstract[name].shape,
            abstract[name].dtype,
            sharding=jax.sharding.NamedSharding(mesh, P("a", "b")),
        )
    resharded = cp.load_pytree(root / "pytree_ckpt", abstract)
    _assert_tree(resharded)
    assert resharded["large"].sharding.spec == P("a", "b")
    # Every chunk of the merged database is reachable and matches its checksum.
    handler = cp.handlers.get("pytree")()
    assert asyncio.run(handler.verify(root / "pytree_ckpt" / "pytree")) == []
    _assert_nodes_recorded(root / "pytree_ckpt" / "pytree")


@pytest.mark.filterwarnings("ignore::UserWarning")  # Orbax warns that it does not know our typestr.
def test_orbax_loads_a_checkpoint_saved_by_two_processes(saved) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    root, _ = saved
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    abstract = {
        name: jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=jax.sharding.NamedSharding(mesh, P("x"))
        )
        for name, value in values().items()
    }
    # Orbax needs an abstract tree here: it rebuilds no sharding whose devices are missing.
    abstract["host"] = {"table": np.empty(7), "step": 0, "lr": 0.0, "run": ""}
    _assert_tree(ocp_v1.load(root / "pytree_ckpt", abstract))


RESTORE_BODY = (
    VALUES
    + """
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
path = sys.argv[1]

def bytes_read():
    # Every byte this process read from files: TensorStore's reads and the ranged reads'
    # preadv alike (a process's part of a large array is read as byte ranges).
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

def restore(mesh, spec, names=tuple(values())):
    abstract = {name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec))
                if name in names else cp.PLACEHOLDER for name, v in values().items()}
    abstract["host"] = cp.PLACEHOLDER
    before = bytes_read()
    loaded = cp.load_pytree(path, abstract)
    read = bytes_read() - before
    for name in names:
        array, value = loaded[name], values()[name]
        assert array.sharding == abstract[name].sharding and not array.is_fully_addressable
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    return read

# 2 processes x 4 devices on a 4x2 mesh: each process needs half of every
# array, and reads only the chunks holding that half.
devices = np.array(jax.devices())
aligned = Mesh(devices.reshape(4, 2), ("a", "b"))
restore(aligned, P("a", "b"))
for name in ("sharded", "large"):
    print("READ", name, restore(aligned, P("a", "b"), [name]), values()[name].nbytes, flush=True)
# A transposed mesh and spec: each process holds a column block.
restore(Mesh(devices.reshape(2, 4).T, ("a", "b")), P("b", "a"))
# With no abstract tree every process loads the whole tree onto its own device.
loaded = cp.load_pytree(path)
assert loaded["host"]["run"] == "exp-7"
assert loaded["large"].sharding.device_set == {jax.local_devices()[0]}
print("RESTORED", flush=True)
"""
)


def test_restores_on_two_processes_with_another_mesh(saved) -> None:
    root, _ = saved
    results = run_job(RESTORE_BODY, devices_per_process=4, args=[str(root / "pytree_ckpt")])
    for result in results:
        result.check()
        reads = [
            line.split()[1:] for line in result.stdout.splitlines() if line.startswith("READ ")
        ]
        assert [name for name, _, _ in reads] == ["sharded", "large"]
        for name, read, nbytes in reads:
            # Each process reads the half its devices hold (plus metadata), not the whole array.
            assert int(nbytes) * 0.45 < int(read) < int(nbytes) * 0.6, (name, read, nbytes)
        assert "RESTORED" in result.stdout


LOCAL_BODY = (
    SAVE_TREE
    + """
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
path = sys.argv[1] + f"/local{PROCESS_ID}"
local_mesh = Mesh(np.array(jax.local_devices()), ("d",))
mine = {
    "local": jax.device_put(
        np.full((4, 6), PROCESS_ID, np.float32), NamedSharding(local_mesh, P("d"))),
    "numpy": np.arange(3) * (PROCESS_ID + 1),
    "who": f"process {PROCESS_ID}",
    # A global array: each process stores the shards its own devices hold.
    "global": global_tree()["sharded"],
}
options = cp.options.MultiprocessingOptions(primary_host=None)
with cp.Context(multiprocessing_options=options):
    cp.save_pytree(path, mine)
    # The same global sharding restores from this process's own storage.
    global_array = mine["global"]
    abstract = {"local": None, "numpy": np.empty(3, np.int64), "who": "",
                "global": jax.ShapeDtypeStruct(global_array.shape, global_array.dtype,
                                               sharding=global_array.sharding)}
    restored = cp.load_pytree(path, abstract)["global"]
for shard in restored.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), values()["sharded"][shard.index])
back = cp.load_pytree(path, {**abstract, "global": None, "local": jax.ShapeDtypeStruct(
    (4, 6), np.float32, sharding=mine["local"].sharding)})
assert back["local"].sharding == mine["local"].sharding
np.testing.assert_array_equal(np.asarray(back["local"]), np.full((4, 6), PROCESS_ID))
assert back["who"] == f"process {PROCESS_ID}"
print("LOCAL OK", flush=True)
"""
)


def test_process_local_storage_with_no_primary_host(tmp_path) -> None:
    for result in run_job(LOCAL_BODY, args=[str(tmp_path)]):
        result.check()
        assert "LOCAL OK" in result.stdout
    assert sorted(os.listdir(tmp_path)) == ["local0", "local1"]
    for i in (0, 1):
        # Each is a complete checkpoint of its own, written by its process alone.
        loaded = cp.load_pytree(
            tmp_path / f"local{i}",
            partial_load=True,
            abstract_pytree={
                "local": None,
                "numpy": np.empty(3, np.int64),
                "who": "",
                "global": None,
            },
        )
        np.testing.assert_array_equal(loaded["numpy"], np.arange(3) * (i + 1))
        assert loaded["who"] == f"process {i}"
        assert sorted(os.listdir(tmp_path / f"local{i}" / "pytree" / "array_metadatas")) == [
            f"process_{i}"
        ]


KILL_BODY = (
    SAVE_TREE
    + """
import asyncio

class Stalls:
    \"\"\"Keeps process 1's save from finishing: it is killed while it writes.\"\"\"
    async def save(self, directory):
        async def write():
            await directory.await_creation()
            if PROCESS_ID == 1:
                await asyncio.sleep(120)  # The arrays are written meanwhile.
        return write()
    async def load(self, directory):
        return None

tree = global_tree()
tree["big"] = jax.make_array_from_callback(
    (8192, 4096), NamedSharding(MESH, P("x", "y")), lambda i: np.ones((4096, 2048), np.float32))
with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=6)):
    try:
        cp.save_checkpointables(sys.argv[1], {"state": tree, "stalls": Stalls()})
    except Exception as e:
        print("FAILED", type(e).__name__, e, flush=True)
        os._exit(0)  # The coordination service would wait for the dead peer at exit.
print("SAVED", flush=True)
os._exit(0)
"""
)


def test_a_process_killed_while_writing_arrays_never_commits(tmp_path) -> None:
    target = tmp_path / "ckpt"

    def kill_process_1_while_it_writes(procs) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            # Process 1's own database appears once it starts writing its shards.
            if any(
                p.name.startswith("ckpt.") and (p / "state" / "ocdbt.process_1").exists()
                for p in tmp_path.iterdir()
            ):
                break
            time.sleep(0.002)
        procs[1].send_signal(signal.SIGKILL)

    results = run_job(
        KILL_BODY, args=[str(target)], on_started=kill_process_1_while_it_writes, timeout=120
    )
    survivor, killed = results
    assert killed.returncode == -signal.SIGKILL
    assert "FAILED BarrierTimeoutError" in survivor.stdout, (
        survivor.stdout + survivor.stderr[-3000:]
    )
    assert "processes [1]" in survivor.stdout and "written" in survivor.stdout
    assert not target.exists()
    assert not any(cp.is_checkpoint(p) for p in tmp_path.iterdir())


ONE_PROCESS_BODY = """
import numpy as np
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
value = np.arange(4 * 3000, dtype=np.float32).reshape(4, 3000)
small = np.arange(6, dtype=np.int32)
# Global arrays whose every device belongs to process 1 (the primary is process 0).
ones = np.array([d for d in jax.devices() if d.process_index == 1])
mesh = Mesh(ones, ("x",))
tree = {
    "on_process_1": jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, P("x")), lambda i: value[i], dtype=value.dtype),
    "replicated_on_process_1": jax.make_array_from_callback(
        small.shape, NamedSharding(mesh, P()), lambda i: small[i], dtype=small.dtype),
    # A process-local array: each process has its own; the primary's is saved.
    "local": jnp.arange(5) + 10 * PROCESS_ID,
}
cp.save_pytree(sys.argv[1], tree)
print("SAVED", flush=True)
"""


def test_arrays_held_only_by_a_non_primary_process_are_saved(tmp_path) -> None:
    for result in run_job(ONE_PROCESS_BODY, args=[str(tmp_path / "ckpt")], timeout=90):
        result.check()
    loaded = cp.load_pytree(tmp_path / "ckpt")
    np.testing.assert_array_equal(
        np.asarray(loaded["on_process_1"]), np.arange(4 * 3000, dtype=np.float32).reshape(4, 3000)
    )
    np.testing.assert_array_equal(
        np.asarray(loaded["replicated_on_process_1"]), np.arange(6, dtype=np.int32)
    )
    np.testing.assert_array_equal(np.asarray(loaded["local"]), np.arange(5))


PARTIAL_BODY = (
    SAVE_TREE
    + """
root = sys.argv[1]
tree = global_tree()
# Two partial saves of global arrays and one of host values, then finalize.
cp.partial.save(root + "/partial", {"params": {"sharded": tree["sharded"]}})
cp.partial.save(root + "/partial", {"params": {"large": tree["large"]}, "host": tree["host"]})
# A replacement: the second value of by_row wins.
cp.partial.save(root + "/partial", {"by_row": tree["by_row"] * 0})
cp.partial.save(root + "/partial", {"by_row": tree["by_row"]})
# Process 1 comes late to finalize: it must not take the primary's finished checkpoint
# for one that was there before (it did, and the primary hung at the next barrier).
if PROCESS_ID == 1:
    import time
    time.sleep(3)
cp.partial.finalize(root + "/partial")
loaded = cp.load_pytree(root + "/partial")
np.testing.assert_array_equal(np.asarray(loaded["params"]["large"]), values()["large"])
print("PARTIAL OK", flush=True)
"""
)


def test_partial_saves_by_two_processes(tmp_path) -> None:
    for result in run_job(PARTIAL_BODY, args=[str(tmp_path)], timeout=120):
        result.check()
        assert "PARTIAL OK" in result.stdout
    loaded = cp.load_pytree(tmp_path / "partial")
    np.testing.assert_array_equal(np.asarray(loaded["params"]["sharded"]), values()["sharded"])
    np.testing.assert_array_equal(np.asarray(loaded["params"]["large"]), values()["large"])
    np.testing.assert_array_equal(np.asarray(loaded["by_row"]), values()["by_row"])
    assert loaded["host"]["run"] == "exp-7"
    assert not (tmp_path / "partial.partial_save").exists()
    _assert_nodes_recorded(tmp_path / "partial" / "pytree")


# Each process's shards of two global arrays, in inner chunks (so TensorStore's zarr3
# driver writes them): more than one group per process, so each process commits them
# through several writers, merges those into its own database, and the primary merges
# the processes' databases.
SEVERAL_WRITERS_BODY = """
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from checkpointables_pytree import ocdbt
columns = ocdbt.LARGE_GROUP_BYTES // 4 + 1024
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
tree = {}
for name, offset in (("a", 0.0), ("b", 0.5)):
    value = np.arange(2 * columns, dtype=np.float32).reshape(2, columns) + offset
    tree[name] = jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, P("x")), lambda i, v=value: v[i])
storage = cp.options.ArrayStorageOptions(chunk_byte_size=8 << 20)
with cp.Context(array_options=cp.options.ArrayOptions(storage_options=storage)):
    cp.save_pytree(sys.argv[1], tree)
print("SAVED", flush=True)
"""


def test_several_writers_in_every_process(tmp_path) -> None:
    from checkpointables_pytree import ocdbt

    for result in run_job(SEVERAL_WRITERS_BODY, args=[str(tmp_path / "ckpt")], timeout=120):
        result.check()
    pytree = tmp_path / "ckpt" / "pytree"
    assert list(pytree.glob(f"ocdbt.process_1/{ocdbt.WRITER_PREFIX}*"))
    loaded = cp.load_pytree(tmp_path / "ckpt")
    columns = ocdbt.LARGE_GROUP_BYTES // 4 + 1024
    for name, offset in (("a", 0.0), ("b", 0.5)):
        expected = np.arange(2 * columns, dtype=np.float32).reshape(2, columns) + offset
        np.testing.assert_array_equal(np.asarray(loaded[name]), expected)
    handler = cp.handlers.get("pytree")()
    assert cp._asyncio.run_sync(handler.verify(pytree)) == []
    _assert_nodes_recorded(pytree)
