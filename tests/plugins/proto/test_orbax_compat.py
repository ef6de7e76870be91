"""Proto checkpoints and Orbax (0.12.8, in the dev environment): each reads the other's."""

from __future__ import annotations

import checkpointables as cp
import orbax.checkpoint as ocp
import pytest
from checkpointables_proto import MessageTypeNotFoundError
from google.protobuf import duration_pb2
from orbax.checkpoint import v1 as ocp_v1

from .messages import TrainConfig, train_config


def test_orbax_reads_ours(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"config": train_config()})
    loaded = ocp_v1.load_checkpointables(tmp_path / "c", {"config": TrainConfig})
    assert loaded["config"] == train_config()


def test_we_read_orbax_v1(tmp_path) -> None:
    ocp_v1.save_checkpointables(tmp_path / "c", {"config": train_config()})
    assert cp.load_checkpointables(tmp_path / "c", {"config": TrainConfig}) == {
        "config": train_config()
    }
    # Orbax records no message type: metadata says so, and loading asks for the class.
    assert cp.checkpointables_metadata(tmp_path / "c").metadata == {"config": None}
    with pytest.raises(MessageTypeNotFoundError, match="does not record its message type"):
        cp.load_checkpointables(tmp_path / "c")


def test_we_read_orbax_v0_checkpoint_manager(tmp_path) -> None:
    with ocp.CheckpointManager(tmp_path / "run", item_names=("config",)) as manager:
        manager.save(
            1, args=ocp.args.Composite(config=ocp.args.ProtoSave(duration_pb2.Duration(seconds=4)))
        )
        manager.wait_until_finished()
    loaded = cp.load_checkpointables(tmp_path / "run" / "1", {"config": duration_pb2.Duration})
    assert loaded == {"config": duration_pb2.Duration(seconds=4)}
