"""The restore's rule on manifests alone: which shards a set of copies holds, when a step is
complete, and which copies a process takes (several when its shards are spread)."""

from __future__ import annotations

import attrs
from checkpointables.training.local_tier import _restore
from checkpointables.training.local_tier._manifest import Manifest, uncovered
from checkpointables.training.local_tier._store import writer_name

# An (8, 4) array saved by 4 processes, each holding 2 rows: row blocks 0..3.
ROWS = [((2 * i, 2 * i + 2), (0, 4)) for i in range(4)]
KEY = "state/['w']"


def manifest(i: int, *, partial: bool = False) -> Manifest:
    whole = Manifest(
        step=30,
        writer=writer_name(i, 4),
        process_index=i,
        process_count=4,
        algorithm="crc32",
        files={
            "_CHECKPOINT_METADATA": (10, 1),
            "state/_METADATA": (20, 2),
            "config/data.json": (5, 3),
        },
        held={KEY: [ROWS[i]]},
        shards={KEY: list(ROWS)},
        small=["config"],
    )
    return whole.small_part() if partial else whole


def test_uncovered_counts_what_no_held_shard_holds_also_across_several() -> None:
    held = {KEY: [ROWS[0], ROWS[1]]}
    assert uncovered({KEY: {((0, 4), (0, 4))}}, held) == 0  # Spans two held shards.
    assert uncovered({KEY: {((1, 3), (1, 2))}}, held) == 0  # Inside them.
    assert uncovered({KEY: {((2, 6), (0, 4))}}, held) == 8  # Half of it is rows 4-5.
    assert uncovered({KEY: {((0, 2), (0, 4))}}, {}) == 8
    assert uncovered({}, held) == 0


def test_a_partial_copy_holds_the_small_items_and_no_shard() -> None:
    part = manifest(1, partial=True)
    assert part.partial and part.held == {}
    assert sorted(part.files) == ["_CHECKPOINT_METADATA", "config/data.json"]
    assert Manifest.from_json(part.to_json()) == part


def test_a_step_is_complete_only_when_every_shard_is_held_by_a_whole_copy() -> None:
    # Hosts 0 and 2 of a ring with one replica: every writer's whole copy survives.
    holding = {0: [0, 3], 1: [2, 1]}
    copies = {
        p: {30: {m.writer: m for m in [manifest(i) for i in whole]
                 + [manifest(i, partial=True) for i in range(4) if i not in whole]}}
        for p, whole in holding.items()
    }  # fmt: skip
    assert _restore.Inventory({0: "", 1: ""}, copies).complete_steps() == [30]
    # Hosts 0 and 1: writer 2 is there only as a partial copy; its rows are nowhere.
    copies[1] = {30: {m.writer: m for m in [manifest(1), manifest(0), manifest(2, partial=True)]}}
    copies[0][30][writer_name(2, 4)] = manifest(2, partial=True)
    assert _restore.Inventory({0: "", 1: ""}, copies).complete_steps() == []


def test_options_put_the_own_index_first_then_whole_copies_on_this_disk() -> None:
    holders = {
        writer_name(0, 4): [(0, manifest(0))],
        writer_name(1, 4): [(0, manifest(1, partial=True)), (1, manifest(1))],
        writer_name(3, 4): [(0, manifest(3))],
    }
    needed = {KEY: {((0, 4), (0, 4))}}
    ranked = [(p, m.writer, m.partial) for p, m in _restore.options(holders, 1, 2, needed)]
    # Process 1 of 2 now: p1-of-4's items are its own index's (whole before partial).
    assert ranked[:2] == [(1, "p1-of-4", False), (0, "p1-of-4", True)]
    assert ranked[2:] == [(0, "p0-of-4", False), (0, "p3-of-4", False)]
    # Without shardings a process cannot tell which rows it needs: no copy is whole.
    assert _restore.options(holders, 1, 2, None) == []
    # With every array whole in each copy it reads one, never a partial one.
    whole = {w: [(p, attrs.evolve(m, shards=m.held)) for p, m in c] for w, c in holders.items()}
    assert [m.partial for _, m in _restore.options(whole, 1, 2, None)] == [False] * 3
