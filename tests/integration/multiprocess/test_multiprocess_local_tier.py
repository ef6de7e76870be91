"""The local tier with real jax.distributed processes on 127.0.0.1: local saves of each
host's shards (and its own dataset iterator), replication to peers, restores decided from
what the hosts report, with a host's directory wiped and with process ids permuted across
the restart: the iterator resumes exactly, also from a peer's copy."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
from checkpointables.training.local_tier._owner import OWNER_FILE

from .launcher import run_job

pytestmark = pytest.mark.multiprocess

# argv: root, local base, mode ("save", "restore", "half": a restore without the dataset),
# the host directory of each process
# (a permutation: "1,0" gives process 0 the directory process 1 wrote before).
BODY = """
import json
import time
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

root, base, mode, hosts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
local_every, persistent_every = map(int, sys.argv[5].split(","))
MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
SPECS = {"sharded": P("x", "y"), "by_row": P("x"), "replicated": P()}
if mode == "half":  # Another sharding too: a device's rows span two saved shards.
    SPECS["sharded"] = P("x")

def value(name, step):
    return {"sharded": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step,
            "by_row": np.arange(8 * 3, dtype=np.int32).reshape(8, 3) * (step + 1),
            "replicated": np.full((4,), step, np.float32)}[name]

import grain

def dataset():  # Each process reads its own shard of the data, in its own order.
    return grain.MapDataset.range(1000).shuffle(seed=PROCESS_ID).to_iter_dataset()

def tree(step):
    out = {name: jax.make_array_from_callback(value(name, 0).shape, NamedSharding(MESH, spec),
                                              lambda i, n=name: value(n, step)[i])
           for name, spec in SPECS.items()}
    out["host_numpy"] = np.arange(3) + step
    return out

policy = cp.training.save_decision_policies.EveryNStepsPolicy

class Held:  # Its persistent save of step 10 (the drain of a step both tiers choose) hangs.
    def __init__(self, step=-1):
        self.step = step

    async def save(self, directory):
        async def write():
            path = await directory.await_creation()
            (path / "step").write_text(str(self.step))
            if self.step == 10 and str(path).startswith(root):
                open(f"{base}/draining{PROCESS_ID}", "w").close()
                time.sleep(600)  # Until the test kills the job.
        return write()

    async def load(self, directory):
        async def read():
            self.step = int((directory / "step").read_text())
        return read()

def checkpointer():
    tier = cp.training.LocalTier(f"{base}/host{hosts[PROCESS_ID]}",
                                 save_decision_policy=policy(local_every),
                                 replicas=1, keep=2, timeout_secs=3 if mode == "lonely" else 30)
    return cp.training.Checkpointer(root, save_decision_policy=policy(persistent_every),
                                    local_tier=tier)

def restore(ckptr, tag):
    abstract = {name: jax.ShapeDtypeStruct(value(name, 0).shape, value(name, 0).dtype,
                                           sharding=NamedSharding(MESH, spec))
                for name, spec in SPECS.items()}
    abstract["host_numpy"] = np.empty(3, np.int64)
    # Grain's iterator states are per process: another process count starts the data afresh.
    resumed = iter(dataset()) if mode != "half" else None
    items = {"state": abstract, "config": None}
    if resumed is not None:
        items["dataset"] = resumed
    try:
        restored = ckptr.load_checkpointables(None, items)
    except cp.training.errors.StepNotFoundError:
        print(tag, json.dumps({"step": -1}), flush=True)
        os._exit(0)
    stats = ckptr.last_restore_stats
    step = restored["config"]["step"]
    for name in SPECS:
        for shard in restored["state"][name].addressable_shards:
            expected = value(name, step)[shard.index]
            np.testing.assert_array_equal(np.asarray(shard.data), expected)
    np.testing.assert_array_equal(restored["state"]["host_numpy"], np.arange(3) + step)
    # The iterator resumes exactly after the step's element of this process's shard.
    assert resumed is None or next(resumed) == list(dataset())[step + 1]
    print(tag, json.dumps({"step": stats.step, "tier": stats.tier,
                           "local": stats.bytes_from_local, "peers": stats.bytes_from_peers,
                           "persistent": stats.bytes_from_persistent}), flush=True)

if mode == "lonely":  # Process 1 never takes part in the restore.
    import time
    if PROCESS_ID == 1:
        time.sleep(20)
        os._exit(0)
    began = time.monotonic()
    try:
        checkpointer().load_checkpointables()
    except cp.multihost.BarrierTimeoutError as e:
        print("TIMEOUT", json.dumps({"secs": time.monotonic() - began, "message": str(e)}))
    os._exit(0)

with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=60)):
    ckptr = checkpointer()
    iterator = iter(dataset())
    if mode == "train":  # Until killed; the test watches the progress file.
        for step in range(100000):
            next(iterator)
            ckptr.save_checkpointables(
                step, {"state": tree(step), "config": {"step": step}, "dataset": iterator})
            with open(f"{base}/progress{PROCESS_ID}", "w") as f:
                f.write(str(step))
    if mode == "drain":  # Local 0, 5, 10; persistent 0, then 10, which never commits.
        for step in range(11):
            next(iterator)
            ckptr.save_checkpointables(step, {"state": tree(step), "config": {"step": step},
                                              "dataset": iterator, "held": Held(step)})
        ckptr.wait()  # Killed in here.
    if mode == "save":
        for step in range(31):
            next(iterator)
            ckptr.save_checkpointables(
                step, {"state": tree(step), "config": {"step": step}, "dataset": iterator})
        ckptr.wait()
        print("LOCAL", json.dumps([s.step for s in ckptr.steps(tier="local")]), flush=True)
        ckptr.close()
        # Another Checkpointer of the same job: its reports are its own.
        with checkpointer() as again:
            restore(again, "AGAIN")
    else:
        restore(ckptr, "STATS")
    ckptr.close()
"""


def _tagged(results, tag: str) -> list:
    found = []
    for result in results:
        result.check()
        line = next(x for x in result.stdout.splitlines() if x.startswith(tag + " "))
        found.append(json.loads(line[len(tag) + 1 :]))
    return found


def _job(tmp_path, mode: str, hosts: str = "0,1", cadences: str = "10,25", n: int = 2) -> list:
    """Runs BODY in ``mode``: "save", "restore", or "half" (a restore without the dataset)."""
    args = [str(tmp_path / "persistent"), str(tmp_path / "local"), mode, hosts, cadences]
    results = run_job(BODY, args=args, timeout=150, num_processes=n, devices_per_process=4 // n)
    return _tagged(results, "LOCAL" if mode == "save" else "STATS")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run's two tiers after 31 steps: persistent 0, 25; local 20, 30 on each host."""
    tmp = tmp_path_factory.mktemp("local_tier")
    results = run_job(
        BODY, args=[str(tmp / "persistent"), str(tmp / "local"), "save", "0,1", "10,25"]
    )
    assert _tagged(results, "LOCAL") == [[20, 30], [20, 30]]
    for stats in _tagged(results, "AGAIN"):
        assert (stats["step"], stats["tier"], stats["peers"], stats["persistent"]) == (
            30,
            "local",
            0,
            0,
        )
    for host in (0, 1):
        # Each host holds its own copy and its peer's (replicas=1).
        names = sorted(os.listdir(tmp / "local" / f"host{host}" / "30"))
        assert names == ["p0-of-2", "p0-of-2.manifest.json", "p1-of-2", "p1-of-2.manifest.json"]
    return tmp


@pytest.fixture
def run_dir(saved, tmp_path):
    """A fresh copy of the saved run, for a test to damage."""
    return moved(saved, tmp_path / "run")


def moved(run: Path, target: Path) -> Path:
    """The run (its persistent root and local directories) copied to ``target``: each local
    directory's record of the root it serves is removed, as docs/local-tier.md says to."""
    shutil.copytree(run, target, dirs_exist_ok=True)
    for record in target.glob(f"local/host*/{OWNER_FILE}"):
        record.unlink()
    return target


def test_restore_from_own_disks_reads_nothing_elsewhere(run_dir) -> None:
    for stats in _job(run_dir, "restore"):
        assert (stats["step"], stats["tier"], stats["peers"], stats["persistent"]) == (
            30,
            "local",
            0,
            0,
        )
        assert stats["local"] > 0


def test_a_wiped_host_fetches_from_its_peer_and_reads_nothing_from_persistent(run_dir) -> None:
    shutil.rmtree(run_dir / "local" / "host1")
    first, second = _job(run_dir, "restore")
    assert (first["step"], first["peers"], first["persistent"]) == (30, 0, 0)
    assert (second["step"], second["local"], second["persistent"]) == (30, 0, 0)
    assert second["peers"] > 0


def test_permuted_process_ids_with_a_wiped_host_restore_from_data(run_dir) -> None:
    # Process 1 now runs on the host that was process 0's, whose disk was replaced.
    shutil.rmtree(run_dir / "local" / "host0")
    first, second = _job(run_dir, "restore", hosts="1,0")
    assert (first["step"], first["tier"], first["peers"], first["persistent"]) == (
        30,
        "local",
        0,
        0,
    )
    assert (second["step"], second["tier"], second["persistent"]) == (30, "local", 0)
    assert second["peers"] > 0


@pytest.fixture(scope="module")
def saved_by_four(tmp_path_factory):
    """A run of 4 processes: persistent 0, 25; local 20, 30, each host holding its own copy
    and the copy of the process before it (host 2's files are on host 3), and the small
    items (JSON, iterator) of every process."""
    tmp = tmp_path_factory.mktemp("local_tier_four")
    assert _job(tmp, "save", hosts="0,1,2,3", n=4)[0] == [20, 30]
    for host in range(4):
        step = tmp / "local" / f"host{host}" / "30"
        manifests = {
            w: json.loads((step / f"{w}.manifest.json").read_text())
            for w in ("p0-of-4", "p1-of-4", "p2-of-4", "p3-of-4")
        }
        # Its own copy and its buddy's whole; every other process's small items only.
        whole = {f"p{host}-of-4", f"p{(host - 1) % 4}-of-4"}
        assert {w for w, m in manifests.items() if not m["partial"]} == whole
        for writer, manifest in manifests.items():
            assert manifest["small"] == ["config", "dataset"]
            items = {p.name for p in (step / writer).iterdir() if p.is_dir()}
            assert items == (
                {"config", "dataset", "state"} if writer in whole else {"config", "dataset"}
            )
    return tmp


def test_four_processes_in_a_ring_restore_a_wiped_host_from_its_buddy(
    saved_by_four, tmp_path
) -> None:
    moved(saved_by_four, tmp_path)
    shutil.rmtree(tmp_path / "local" / "host2")
    stats = _job(tmp_path, "restore", hosts="0,1,2,3", n=4)
    assert [(s["step"], s["tier"], s["persistent"]) for s in stats] == [(30, "local", 0)] * 4
    assert [s["peers"] > 0 for s in stats] == [False, False, True, False]


def test_half_the_processes_restore_from_several_hosts_copies(saved_by_four, tmp_path) -> None:
    # 2 processes on the hosts of 0 and 2: each needs the shards of two of the 4 writers
    # (process 0: p0 and p1, on hosts 0 and 2; process 1: p2 and p3, on hosts 2 and 0),
    # and its own index's items (p1-of-4's are on host 2, its buddy's copy); "sharded" is
    # now split by rows only, so each device needs parts of two saved shards.
    moved(saved_by_four, tmp_path)
    first, second = _job(tmp_path, "half", hosts="0,2", n=2)
    for stats in (first, second):
        assert (stats["step"], stats["tier"], stats["persistent"]) == (30, "local", 0)
        assert stats["local"] > 0 and stats["peers"] > 0
    # With the hosts of 0 and 1 no host holds p2-of-4's files: the persistent step.
    shutil.rmtree(tmp_path)
    moved(saved_by_four, tmp_path)
    for stats in _job(tmp_path, "half", hosts="0,1", n=2):
        assert (stats["step"], stats["tier"], stats["local"], stats["peers"]) == (
            25, "persistent", 0, 0)  # fmt: skip


def test_a_host_that_does_not_answer_is_named_within_the_timeout(run_dir) -> None:
    args = [str(run_dir / "persistent"), str(run_dir / "local"), "lonely", "0,1", "10,25"]
    first, _ = run_job(BODY, args=args, timeout=60)  # Process 1 dies with the coordinator.
    (line,) = [x for x in first.check().stdout.splitlines() if x.startswith("TIMEOUT ")]
    timeout = json.loads(line[len("TIMEOUT ") :])
    assert "processes [1] of [0, 1] did not answer" in timeout["message"]
    assert timeout["secs"] < 15


def test_with_every_local_copy_gone_the_newest_persistent_step_is_restored(run_dir) -> None:
    shutil.rmtree(run_dir / "local")
    for stats in _job(run_dir, "restore"):
        assert (stats["step"], stats["tier"], stats["local"], stats["peers"]) == (
            25,
            "persistent",
            0,
            0,
        )


def test_forged_manifests_on_a_peer_remove_nothing_and_are_passed_over(run_dir) -> None:
    # Manifests of writers ".." (without a checksum, as a save before this check wrote
    # none) and "." (checksum correct), with no files, planted on host 1; process 0's own
    # copy damaged, so that it fetches its copy from host 1: the forged ones are passed
    # over there, and nothing of host 0's directory is removed (it once was, all of it).
    from tests.core.training.local_tier.test_local_tier import flip_a_bit
    from tests.core.training.local_tier.test_manifest_trust import sealed

    step = run_dir / "local" / "host1" / "30"
    fields = json.loads((step / "p0-of-2.manifest.json").read_text())
    del fields["checksum"]
    (step / "...manifest.json").write_text(json.dumps({**fields, "writer": "..", "files": {}}))
    (step / "..manifest.json").write_text(sealed({**fields, "writer": ".", "files": {}}))
    # Host 1's directory stays the tier's (its record, as a run not moved keeps it): without
    # one, the claim refuses the forged files outright (tests/core/training/local_tier).
    record = {"persistent_root": os.path.realpath(run_dir / "persistent")}
    record["adopted_runs"] = [fields["run"]]
    (run_dir / "local" / "host1" / OWNER_FILE).write_text(json.dumps(record))
    flip_a_bit(run_dir / "local" / "host0" / "30" / "p0-of-2")
    first, second = _job(run_dir, "restore")
    assert (first["step"], first["tier"], first["persistent"]) == (30, "local", 0)
    assert first["peers"] > 0 and (second["step"], second["tier"]) == (30, "local")
    assert sorted(os.listdir(run_dir / "local" / "host0" / "20")) == [
        "p0-of-2", "p0-of-2.manifest.json", "p1-of-2", "p1-of-2.manifest.json"]  # fmt: skip


def test_a_step_whose_only_copies_of_one_host_are_damaged_is_skipped(run_dir) -> None:
    # Both copies of process 1's files of step 30 lose a bit: step 30 is incomplete.
    from tests.core.training.local_tier.test_local_tier import flip_a_bit

    for host in (0, 1):
        flip_a_bit(run_dir / "local" / f"host{host}" / "30" / "p1-of-2")
    for stats in _job(run_dir, "restore"):
        assert (stats["step"], stats["tier"], stats["local"], stats["peers"]) == (
            25,
            "persistent",
            0,
            0,
        )
        assert stats["persistent"] > 0


def test_a_job_killed_while_draining_a_step_restores_that_step_from_the_local_tier(
    tmp_path,
) -> None:
    # Step 10 is chosen by both tiers: its local copies commit and replicate while its
    # persistent save (the drain) is still writing; a process is killed there, then all.
    import signal
    import time

    local = tmp_path / "local"
    local.mkdir()
    copies = [
        local / f"host{h}" / "10" / f"p{w}-of-2.manifest.json" for h in (0, 1) for w in (0, 1)
    ]
    drains = [local / "draining0", local / "draining1"]

    def reached() -> bool:
        return any(f.is_file() for f in drains) and all(f.is_file() for f in copies)

    def kill(procs) -> None:
        deadline = time.monotonic() + 90
        while not reached() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        for proc in procs:
            proc.kill()

    args = [str(tmp_path / "persistent"), str(local), "drain", "0,1", "5,10"]
    run_job(BODY, args=args, timeout=120, on_started=kill)
    assert reached(), "the job never reached the drain of step 10"
    import checkpointables as cp

    persistent = cp.training.Checkpointer(tmp_path / "persistent")
    assert [s.step for s in persistent.steps()] == [0]  # The unfinished drain is not a step.
    persistent.close()
    for stats in _job(tmp_path, "restore", hosts="1,0", cadences="5,10"):
        assert (stats["step"], stats["tier"], stats["peers"], stats["persistent"]) == (
            10, "local", 0, 0)  # fmt: skip


# Fault schedules over the saved runs' files (of 2 processes, and of 4). Each schedule
# damages a fresh copy of a run at random (hosts wiped, bits flipped, copies killed before
# their commit or while being fetched, a persistent step lost), restarts it with process
# ids permuted or, for the run of 4, with half the processes on 2 of its hosts (the
# others' disks gone, and a sharding that splits a saved shard's rows between devices),
# then checks the restore decision the hosts make from what they report against an oracle
# that compares every surviving copy byte for byte with the pristine run: the step chosen
# is the newest one whose every writer's files survive intact on a host that restarted
# (or the newest persistent step); each process reads intact copies, and the arrays it
# loads from them (combined, when it needs several) hold the step's values bit for bit.


def _writers(n: int) -> tuple[str, ...]:
    return tuple(f"p{i}-of-{n}" for i in range(n))


WRITERS = _writers(2)


def _files(directory) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def _intact(run, pristine, host: int, step: int, writer: str) -> bool:
    """Whether ``host`` holds ``writer``'s whole copy of ``step`` as it was written."""
    copy = run / "local" / f"host{host}" / str(step) / writer
    manifest = copy.parent / f"{writer}.manifest.json"
    index = int(writer[1:].split("-")[0])
    original = pristine / "local" / f"host{index}" / str(step) / writer
    return manifest.is_file() and copy.is_dir() and _files(copy) == _files(original)


def _oracle(run, pristine, hosts, n: int) -> tuple[int, str]:
    import checkpointables as cp

    persistent = [s.step for s in cp.training.Checkpointer(run / "persistent").steps()]
    local = [
        step
        for step in (20, 30)
        if all(any(_intact(run, pristine, h, step, w) for h in hosts) for w in _writers(n))
    ]
    newest_local = max(local, default=-1)
    newest_persistent = max(persistent, default=-1)
    if newest_local >= newest_persistent and newest_local >= 0:
        return newest_local, "local"
    return newest_persistent, "persistent"


def _rewrite(path, data: bytes) -> None:
    """Replaces ``path``'s contents, never those of the pristine file it is a link of."""
    path.unlink()
    path.write_bytes(data)


def _damage(run, rng, n: int) -> None:
    hosts = [run / "local" / f"host{h}" for h in range(n)]
    copies = [h / str(s) / w for h in hosts for s in (20, 30) for w in _writers(n)]
    for _ in range(rng.randint(0, 3)):  # Bit flips in the files of random copies.
        victim = rng.choice(copies)
        if victim.is_dir():
            files = sorted(p for p in victim.rglob("*") if p.is_file() and p.stat().st_size)
            target = rng.choice(files)
            data = bytearray(target.read_bytes())
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            _rewrite(target, bytes(data))
    if rng.random() < 0.25:  # Killed after writing a copy, before its manifest.
        victim = rng.choice(copies)
        (victim.parent / f"{victim.name}.manifest.json").unlink(missing_ok=True)
    if rng.random() < 0.25:  # Killed mid-copy: a truncated file.
        victim = rng.choice(copies)
        if victim.is_dir():
            target = rng.choice(sorted(p for p in victim.rglob("*") if p.is_file()))
            _rewrite(target, target.read_bytes()[: target.stat().st_size // 2])
    if rng.random() < 0.2:  # Killed while fetching: a staging directory of a later step.
        staging = rng.choice(hosts) / "40" / f"{_writers(n)[1]}.fetching-99-1"
        staging.mkdir(parents=True, exist_ok=True)
        (staging / "partial").write_bytes(b"x")
    if rng.random() < 0.15:  # The newest persistent step lost.
        shutil.rmtree(run / "persistent" / "25", ignore_errors=True)
    for host in hosts:  # A host replaced (its disk wiped), or all of them.
        if rng.random() < 0.2:
            shutil.rmtree(host, ignore_errors=True)


def _needs(pristine, n: int, groups) -> list[dict]:
    """Per restarted process, the shards its devices need: the bounding box of what the
    saved processes of its group held (their rows, whole: another sharding when the
    group has several)."""
    from checkpointables.training.local_tier._manifest import Manifest

    held = [
        Manifest.from_json((pristine / "local" / f"host{i}" / "30" / f"{w}.manifest.json")
                           .read_text()).held
        for i, w in enumerate(_writers(n))
    ]  # fmt: skip
    needs = []
    for group in groups:
        need = {}
        for key in held[group[0]]:
            boxes = [box for i in group for box in held[i][key]]
            bounds = [(min(b[d][0] for b in boxes), max(b[d][1] for b in boxes))
                      for d in range(len(boxes[0]))]  # fmt: skip
            need[key] = {tuple(bounds)}
        needs.append(need)
    return needs


def _values_read(directory: str, needed: dict, step: int) -> None:
    """Reads what ``needed`` names from the pytree at ``directory``/state with TensorStore
    and compares it with the step's values, bit for bit."""
    import numpy as np
    import tensorstore as ts

    expected = {
        "sharded": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step,
        "by_row": np.arange(8 * 3, dtype=np.int32).reshape(8, 3) * (step + 1),
        "replicated": np.full((4,), step, np.float32),
    }
    base = f"file://{os.path.abspath(os.path.join(directory, 'state'))}"
    for key, boxes in needed.items():
        name = key.split("['")[1].split("']")[0]
        spec = {"driver": "zarr3", "fill_missing_data_reads": False,
                "kvstore": {"driver": "ocdbt", "base": base, "path": f"{name}/"}}  # fmt: skip
        array = ts.open(spec).result()
        for box in boxes:
            region = tuple(slice(a, b) for a, b in box)
            got = array[region].read().result()
            np.testing.assert_array_equal(got, expected[name][region], strict=True)


def _run_of(pristine) -> str:
    """The run the copies of ``pristine`` name (a moved run's directories adopt it)."""
    from checkpointables.training.local_tier._manifest import Manifest

    manifest = next((pristine / "local" / "host0" / "30").glob("*.manifest.json"))
    return Manifest.from_json(manifest.read_text()).run


def _decide(run, hosts, needs, owner: str) -> tuple[int, str, dict[int, tuple[str, ...]]]:
    """What the processes restarted on ``hosts`` (process -> host directory) decide by
    ``_restore``'s rule, each host serving its directory over HTTP as in a job; and the
    copies each process then holds on its own disk (the one loaded first). ``owner``: the
    run the hosts' directories serve."""
    import checkpointables as cp
    from checkpointables.training.local_tier import _combine, _restore, _transport
    from checkpointables.training.local_tier._store import Store

    n = len(hosts)
    stores = {p: Store(str(run / "local" / f"host{hosts[p]}"), owner) for p in range(n)}
    for store in stores.values():
        os.makedirs(store.directory, exist_ok=True)
    servers = {p: _transport.FileServer(stores[p].directory, "127.0.0.1") for p in range(n)}
    local = cp.Context(multiprocessing_options=cp.options.MultiprocessingOptions(primary_host=None))
    try:
        copies = {p: {s: store.copies(s) for s in store.steps()} for p, store in stores.items()}
        inventory = _restore.Inventory({p: servers[p].address for p in range(n)}, copies)
        persistent = cp.training.Checkpointer(run / "persistent").steps()
        for candidate in _restore.candidates(inventory, persistent, None):
            if candidate.tier == "persistent":
                return candidate.step, "persistent", {}
            holders = inventory.holders(candidate.step)
            read = {}
            for p in range(n):
                choices = _restore.options(holders, p, n, needs[p])
                with contextlib.suppress(_transport.FetchError):
                    paths = _restore.obtain(stores[p], inventory, choices, p, 10, needs[p]).paths
                    if len(paths) > 1:
                        target = os.path.join(stores[p].step_dir(candidate.step), "combined")
                        with local:
                            paths = (_combine.combine(paths, target, local), *paths)
                    read[p] = paths
            if len(read) == n:
                return candidate.step, "local", read
        return -1, "none", {}
    finally:
        for server in servers.values():
            server.close()


def _restart(rng, n: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """Where the processes restart (process -> host) and whose devices' shards each needs:
    all of them permuted, or (of 4) half of them on 2 random hosts."""
    if n == 4 and rng.random() < 0.6:
        # Mostly on hosts that together hold every process's files (in a ring with one
        # replica: 0 and 2, or 1 and 3), else on any two.
        if rng.random() < 0.75:
            return rng.choice([[0, 2], [2, 0], [1, 3], [3, 1]]), [(0, 1), (2, 3)]
        return rng.sample(range(4), 2), [(0, 1), (2, 3)]
    hosts = list(range(n))
    rng.shuffle(hosts)
    return hosts, [(i,) for i in range(n)]


def _check_schedule(pristine, run, rng, n: int, seed: int) -> None:
    # Hard links: a schedule replaces the files it damages, and restores write new ones.
    shutil.copytree(pristine, run, copy_function=os.link)
    for record in run.glob(f"local/host*/{OWNER_FILE}"):
        record.unlink()  # Moved: see moved().
    _damage(run, rng, n)
    hosts, groups = _restart(rng, n)
    needs = _needs(pristine, n, groups)
    expected = _oracle(run, pristine, hosts, n)
    step, tier, reads = _decide(run, hosts, needs, _run_of(pristine))
    assert (step, tier) == expected, f"schedule {seed}"
    for p, paths in reads.items():
        for path in paths[1:] if len(paths) > 1 else paths:
            # Every copy a process holds on its own disk is intact (whole or partial).
            writer = os.path.basename(path)
            original = pristine / "local" / f"host{writer[1:].split('-')[0]}" / str(step) / writer
            got = _files(Path(path))
            assert got == {k: v for k, v in _files(original).items() if k in got}, seed
        if len(groups[p]) == 1:  # Its own index's items: from its own index's copy.
            assert os.path.basename(paths[1 if len(paths) > 1 else 0]).startswith(f"p{p}-"), seed
        _values_read(paths[0], needs[p], step)


@pytest.mark.parametrize(
    "seeds",
    [
        pytest.param(range(0, 200), id="200 schedules"),
        pytest.param(
            range(200, 1200),
            id="1000 more",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(
                    not os.environ.get("CHECKPOINTABLES_MORE_SCHEDULES"),
                    reason="set CHECKPOINTABLES_MORE_SCHEDULES=1 for 1000 more schedules",
                ),
            ],
        ),
    ],
)
def test_random_fault_schedules_restore_the_newest_intact_step(
    saved, saved_by_four, tmp_path, seeds
) -> None:
    import random

    for seed in seeds:
        rng = random.Random(seed)
        n = rng.choice([2, 4])
        _check_schedule(saved if n == 2 else saved_by_four, tmp_path / f"run{seed}", rng, n, seed)


# Real faults: a training job saving every few steps is SIGKILLed at a random moment (in a
# local save, a replication or a persistent save), then every other process is killed as
# the job restarts; a host may be wiped and a bit flipped; the job restarts with its
# process ids maybe permuted. The restore must pick the newest complete intact step (the
# oracle reads the files with its own checksum code) and the values it restores must be
# that step's, bit for bit (checked in the job); no process may hang.


def _copy_intact(copy) -> bool:
    import crc32c

    manifest_file = copy.parent / f"{copy.name}.manifest.json"
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError):
        return False
    for relative, (size, crc) in manifest["files"].items():
        path = copy / relative
        if not path.is_file() or path.stat().st_size != size:
            return False
        if crc32c.crc32c(path.read_bytes()) != crc:
            return False
    return True


def _real_oracle(run) -> int:
    import checkpointables as cp

    local = run / "local"
    steps = {int(s.name) for h in local.glob("host*") for s in h.iterdir() if s.name.isdigit()}
    complete = [
        step
        for step in steps
        if all(any(_copy_intact(h / str(step) / w) for h in local.glob("host*")) for w in WRITERS)
    ]
    persistent = [s.step for s in cp.training.Checkpointer(run / "persistent").steps()]
    return max(complete + persistent, default=-1)


def _killer(run, rng):
    import signal
    import time

    def kill(procs) -> None:
        threshold, deadline = rng.randint(2, 20), time.monotonic() + 90
        while time.monotonic() < deadline:
            done = [(run / "local" / f"progress{p}") for p in range(len(procs))]
            if all(f.is_file() and int(f.read_text() or 0) >= threshold for f in done):
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.4))
        procs[rng.randrange(len(procs))].send_signal(signal.SIGKILL)
        time.sleep(rng.uniform(0, 0.3))
        for proc in procs:  # A lost process ends the job: all restart.
            proc.kill()

    return kill


def _schedule(tmp_path, seed: int) -> None:
    import random

    rng = random.Random(seed)
    run = tmp_path / f"killed{seed}"
    (run / "local").mkdir(parents=True)
    args = [str(run / "persistent"), str(run / "local"), "train", "0,1", "3,7"]
    run_job(BODY, args=args, timeout=120, on_started=_killer(run, rng))
    hosts = sorted((run / "local").glob("host*"))
    if rng.random() < 0.3:
        shutil.rmtree(rng.choice(hosts))
    if rng.random() < 0.5:
        files = sorted(
            p for h in hosts for p in h.rglob("*") if p.is_file() and "manifest" not in p.name
        )
        if files:
            victim = rng.choice(files)
            data = bytearray(victim.read_bytes())
            if data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                victim.write_bytes(bytes(data))
    expected = _real_oracle(run)
    permutation = rng.choice(["0,1", "1,0"])
    restore = [str(run / "persistent"), str(run / "local"), "restore", permutation, "3,7"]
    results = _tagged(run_job(BODY, args=restore, timeout=150), "STATS")
    assert [r["step"] for r in results] == [expected, expected], f"schedule {seed}"


@pytest.mark.parametrize(
    "seed",
    [
        pytest.param(1, id="schedule 1"),
        *(
            pytest.param(
                seed,
                id=f"schedule {seed}",
                marks=[
                    pytest.mark.slow,
                    pytest.mark.skipif(
                        not os.environ.get("CHECKPOINTABLES_MORE_SCHEDULES"),
                        reason="set CHECKPOINTABLES_MORE_SCHEDULES=1 for more killed jobs",
                    ),
                ],
            )
            for seed in range(2, 22)
        ),
    ],
)
def test_a_job_killed_at_a_random_moment_restores_the_newest_complete_step(tmp_path, seed) -> None:
    _schedule(tmp_path, seed)


# argv: root, local base, mode: "latest" (resume as docs/training.md does: latest_step(),
# then that step), "unsharded" (the newest step, asked for without shardings) or "lonely"
# (process 0 first calls latest_step() alone, then both resume as "latest").
RESUME_BODY = """
import json
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

root, base, mode = sys.argv[1], sys.argv[2], sys.argv[3]
MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
SHAPES = {"sharded": ((16, 8), np.float32, P("x", "y")), "by_row": ((8, 3), np.int32, P("x")),
          "replicated": ((4,), np.float32, P())}
state = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(MESH, spec))
         for name, (shape, dtype, spec) in SHAPES.items()}
if mode == "unsharded":
    state = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype, _) in SHAPES.items()}
state["host_numpy"] = np.empty(3, np.int64)
policy = cp.training.save_decision_policies.EveryNStepsPolicy
tier = cp.training.LocalTier(f"{base}/host{PROCESS_ID}", save_decision_policy=policy(10),
                             replicas=1, keep=2, timeout_secs=3 if mode == "lonely" else 30)
with cp.training.Checkpointer(root, save_decision_policy=policy(25), local_tier=tier) as ckptr:
    if mode == "lonely":  # Process 0 alone asks (a mistake): it times out, saying why.
        if PROCESS_ID == 0:
            try:
                ckptr.latest_step()
            except cp.multihost.BarrierTimeoutError as e:
                print("LONELY", json.dumps(str(e)), flush=True)
        cp.multihost.sync_global_processes("asked alone")
        mode = "latest"  # Then both ask, and agree.
    start = ckptr.latest_step()
    step = start.step if mode == "latest" else None
    restored = ckptr.load_checkpointables(step, {"state": state, "config": None})
    stats = ckptr.last_restore_stats
    shard = restored["state"]["sharded"].addressable_shards[0]
    expected = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)[shard.index] + stats.step
    np.testing.assert_array_equal(np.asarray(shard.data), expected)
    print("RESUMED", json.dumps({"latest": start.step, "step": stats.step, "tier": stats.tier,
                                 "config": restored["config"]["step"]}))
"""


def _resume(run_dir, mode: str) -> list:
    args = [str(run_dir / "persistent"), str(run_dir / "local"), mode]
    results = run_job(RESUME_BODY, args=args, timeout=150)
    if mode == "lonely":
        (message,) = [json.loads(x[7:]) for x in results[0].stdout.splitlines() if "LONELY" in x]
        assert "call it on every process" in message
    return _tagged(results, "RESUMED")


def test_latest_step_is_the_same_on_every_process_after_a_save_half_committed(run_dir) -> None:
    # Killed after process 1 committed step 30 and before process 0 did: host 1 holds its
    # own copy, host 0 nothing of step 30. Every process names step 25, and loads it.
    shutil.rmtree(run_dir / "local" / "host0" / "30")
    shutil.rmtree(run_dir / "local" / "host1" / "30" / "p0-of-2")
    for resumed in _resume(run_dir, "latest"):
        assert resumed == {"latest": 25, "step": 25, "tier": "persistent", "config": 25}


def test_a_restore_without_shardings_reads_the_persistent_tier(run_dir) -> None:
    # Local step 30's arrays are split over the processes: without shardings, no process
    # can tell which shards it needs, so the persistent tier's step 25 is read.
    for resumed in _resume(run_dir, "unsharded"):
        assert resumed["latest"] == 30
        assert (resumed["step"], resumed["tier"], resumed["config"]) == (25, "persistent", 25)


def test_latest_step_asked_by_one_process_alone_times_out_and_the_next_call_agrees(
    run_dir,
) -> None:
    for resumed in _resume(run_dir, "lonely"):
        assert resumed == {"latest": 30, "step": 30, "tier": "local", "config": 30}


def test_a_step_left_by_a_rollback_is_not_restored_though_a_host_holds_it_whole(
    run_dir,
) -> None:
    # The run went back to step 20 and saved it again: process 0 committed its new copy
    # (and dropped its step 30), process 1 was killed before its commit (its save had
    # removed its old step 20). Host 1 still holds step 30 whole, with process 0's replica;
    # it is of the trajectory left, so the persistent step 25 is restored.
    import attrs
    from checkpointables.training.local_tier._manifest import Manifest

    host0, host1 = run_dir / "local" / "host0", run_dir / "local" / "host1"
    shutil.rmtree(host0 / "30")
    shutil.rmtree(host0 / "20" / "p1-of-2")
    (host0 / "20" / "p1-of-2.manifest.json").unlink()
    shutil.rmtree(host1 / "20")
    again = host0 / "20" / "p0-of-2.manifest.json"
    manifest = Manifest.from_json(again.read_text())
    # What process 0's save of step 20 records: the copies of step 30 it held and removed
    # (its own, and process 1's replica), whatever the clocks (the checksum covers them).
    left = [Manifest.from_json(p.read_text()).copy for p in (host1 / "30").glob("*.manifest.json")]
    again.write_text(attrs.evolve(manifest, left=left).to_json())
    for resumed in _resume(run_dir, "latest"):
        assert resumed == {"latest": 25, "step": 25, "tier": "persistent", "config": 25}
