"""``inspect`` and ``verify`` of something that is not a checkpoint but holds or is inside
one name the checkpoint to give them instead."""

from __future__ import annotations

import os

import checkpointables as cp
import pytest
from checkpointables import cli


def _root(tmp_path, steps=(2, 10)):
    root = tmp_path / "runs" / "nnx"
    with cp.training.Checkpointer(root) as ckptr:
        for step in steps:
            ckptr.save_checkpointables(step, {"config": {"step": step}}, force=True)
    return root


def _verify_problem(path, capsys) -> str:
    assert cli.main(["verify", "-q", str(path)]) == 1
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("checkpoint: FAILED")]
    return line


def _inspect_error(path, capsys) -> str:
    assert cli.main(["inspect", "-q", str(path)]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_root_names_its_newest_step(tmp_path, capsys, command) -> None:
    root = _root(tmp_path)
    text = (_inspect_error if command == "inspect" else _verify_problem)(root, capsys)
    newest = os.path.join(root, "10")
    assert f"{command} one of its steps; the newest is {newest}" in text
    assert f"`checkpointables {command} {newest}`" in text
    assert "load one of its steps" not in text  # The library's wording, for the API.
    assert "cp.load_pytree" not in text


def test_a_checkpointable_folder_points_to_its_checkpoint(tmp_path, capsys) -> None:
    step = _root(tmp_path) / "10"
    text = _inspect_error(step / "config", capsys)
    assert f"inside the checkpoint {step}" in text and f"`checkpointables inspect {step}`" in text
    assert "checkpointable_name" not in text  # The API's advice.
    assert f"`checkpointables verify {step}`" in _verify_problem(step / "config", capsys)


def test_a_local_tier_step_points_to_its_copy(tmp_path, capsys) -> None:
    tier = cp.training.LocalTier(tmp_path / "local")
    with cp.training.Checkpointer(tmp_path / "persistent", local_tier=tier) as ckptr:
        ckptr.save_checkpointables(30, {"config": {"step": 30}}, force=True)
    copy = tmp_path / "local" / "30" / "p0-of-1"
    assert cp.is_checkpoint(copy)
    text = _inspect_error(tmp_path / "local" / "30", capsys)
    assert "step of a local tier" in text and f"`checkpointables inspect {copy}`" in text
    assert "root of several" not in text and "ckptr.load_pytree" not in text
    text = _inspect_error(tmp_path / "local", capsys)
    assert "local tier's directory" in text and f"`checkpointables inspect {copy}`" in text
    assert f"`checkpointables verify {copy}`" in _verify_problem(tmp_path / "local" / "30", capsys)


def test_a_directory_of_other_things_gets_no_hint(tmp_path, capsys) -> None:
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    text = _inspect_error(tmp_path / "plain", capsys)
    assert "is not a finished checkpoint" in text and "checkpointables inspect" not in text


def test_verify_of_a_missing_path_fails_its_check_with_exit_1(tmp_path, capsys) -> None:
    # `--help` and the quickstart promise exit status 1 when a load would fail (2 is a usage
    # error, which a mistyped path is not: the command was right).
    line = _verify_problem(tmp_path / "typo" / "ckpt", capsys)
    assert "No checkpoint at" in line and "does not exist" in line, line
