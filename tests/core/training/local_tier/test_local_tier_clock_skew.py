"""Local steps whose commit times a wrong clock wrote: a restore still takes the newest
complete step. Going back (a rollback) is told by what the saves removed, never by
comparing the clocks of different jobs."""

from __future__ import annotations

import time

import attrs
from checkpointables.training.local_tier import _restore
from checkpointables.training.local_tier._manifest import Manifest

from .test_local_tier import checkpointer, run
from .test_local_tier_mistakes import _w

HOUR = 3600 * 10**9


def test_steps_saved_after_a_job_with_a_fast_clock_are_restored(tmp_path, monkeypatch) -> None:
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + HOUR)  # The previous job's host.
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        run(ckptr, range(10, 21))
    monkeypatch.setattr(time, "time_ns", real)  # This job's host: its times are earlier.
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        assert _w(ckptr.load_pytree()) == 20
        run(ckptr, range(21, 31))
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        assert ckptr.latest_step().step == 30
        assert _w(ckptr.load_pytree()) == 30 and ckptr.last_restore_stats.step == 30


def test_a_clock_set_back_during_a_job_loses_no_step(tmp_path, monkeypatch) -> None:
    real = time.time_ns
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        monkeypatch.setattr(time, "time_ns", lambda: real() + HOUR)
        run(ckptr, range(10, 21))
        monkeypatch.setattr(time, "time_ns", real)  # Corrected by an hour, mid-run.
        run(ckptr, range(21, 31))
    with checkpointer(tmp_path, persistent=1000, local=10, keep=3) as ckptr:
        assert ckptr.latest_step().step == 30
        assert _w(ckptr.load_pytree()) == 30


def _copy(step: int, i: int, at: int, left=()) -> Manifest:
    """Process ``i`` of 2's copy of ``step``, committed at ``at`` (its clock), holding row ``i``."""
    rows = [((0, 1), (0, 4)), ((1, 2), (0, 4))]
    return Manifest(
        step=step,
        writer=f"p{i}-of-2",
        process_index=i,
        process_count=2,
        algorithm="crc32",
        files={"_CHECKPOINT_METADATA": (10, 1)},
        held={"state/['w']": [rows[i]]},
        shards={"state/['w']": rows},
        commit_timestamp_nsecs=at,
        left=list(left),
    )


def _inventory(hosts: dict[int, list[Manifest]]) -> _restore.Inventory:
    copies: dict = {}
    for host, manifests in hosts.items():
        for m in manifests:
            copies.setdefault(host, {}).setdefault(m.step, {})[m.writer] = m
    return _restore.Inventory({host: "" for host in hosts}, copies)


def test_a_step_left_by_a_rollback_is_told_by_the_manifests_not_the_clocks() -> None:
    now = time.time_ns()
    # Steps 30 by the earlier job's fast clock; the run went back to 20 and host 0 saved it
    # again (by a correct clock: earlier), naming the copies of step 30 it held; host 1 was
    # killed before its commit and still holds step 30 whole (with process 0's replica).
    old = [_copy(30, 0, now + HOUR), _copy(30, 1, now + HOUR + 1)]
    again = _copy(20, 0, now, left=[m.copy for m in old])
    assert 30 not in _inventory({0: [again], 1: old}).complete_steps()
    # Without that record, step 30 is the newest complete step, whatever its times say.
    new = [_copy(30, 0, now - HOUR), _copy(30, 1, now - HOUR)]
    done = [_copy(20, i, now) for i in range(2)]
    assert _inventory({0: [done[0], new[0]], 1: [done[1], new[1]]}).complete_steps() == [30, 20]
    # A new save of step 30 is not the copy left: only that one is passed over.
    mixed = {0: [again, _copy(30, 0, now + 5)], 1: [*old, _copy(30, 1, now + 6)]}
    inventory = _inventory(mixed)
    assert 30 in inventory.complete_steps()
    assert {m.commit_timestamp_nsecs for _, m in inventory.holders(30)["p1-of-2"]} == {now + 6}


def test_the_left_copies_survive_the_manifests_form_and_checksum() -> None:
    entry = (30, "p1-of-2", 7)
    m = _copy(20, 0, 5, left=[entry])
    assert Manifest.from_json(m.to_json()) == m and Manifest.from_json(m.to_json()).left == [entry]
    assert m.small_part().left == [entry]
    for bad in ([(30, "p1-of-1", 7)], [(30, "x", 7)], [(-1, "p0-of-1", 7)], [(30,)], "30"):
        try:
            attrs.evolve(m, left=bad)
        except ValueError as e:
            assert "left" in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")
