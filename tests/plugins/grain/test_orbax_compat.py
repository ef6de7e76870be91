"""Grain iterator checkpoints and Orbax (0.12.8) with Grain's own handlers."""

from __future__ import annotations

import checkpointables as cp
import grain
import orbax.checkpoint as ocp
from orbax.checkpoint import v1 as ocp_v1

from .pipelines import data_loader, map_pipeline, take


def test_we_read_orbax_v0_with_grains_checkpoint_handler(tmp_path) -> None:
    it = iter(map_pipeline())
    take(it, 4)
    loader_it = iter(data_loader())
    take(loader_it, 2)
    with ocp.CheckpointManager(tmp_path / "run", item_names=("dataset", "loader")) as manager:
        manager.save(
            1,
            args=ocp.args.Composite(
                dataset=grain.checkpoint.CheckpointSave(it),
                loader=grain.checkpoint.CheckpointSave(loader_it),
            ),
        )
        manager.wait_until_finished()
    fresh, fresh_loader = iter(map_pipeline()), iter(data_loader())
    cp.load_checkpointables(tmp_path / "run" / "1", {"dataset": fresh, "loader": fresh_loader})
    assert take(fresh, 6) == take(it, 6)
    assert take(fresh_loader, 6) == take(loader_it, 6)
    meta = cp.checkpointables_metadata(tmp_path / "run" / "1").metadata["dataset"]
    assert (meta.iterator_type, meta.process_count) == (None, 1)


def test_orbax_v1_reads_ours(tmp_path) -> None:
    it = iter(map_pipeline())
    take(it, 5)
    cp.save_checkpointables(tmp_path / "c", {"dataset": it})
    fresh = iter(map_pipeline())
    ocp_v1.load_checkpointables(tmp_path / "c", {"dataset": fresh})
    assert take(fresh, 6) == take(it, 6)


def test_we_read_orbax_v1(tmp_path) -> None:
    it = iter(map_pipeline())
    take(it, 5)
    ocp_v1.save_checkpointables(tmp_path / "c", {"dataset": it})
    fresh = iter(map_pipeline())
    cp.load_checkpointables(tmp_path / "c", {"dataset": fresh})
    assert take(fresh, 6) == take(it, 6)
