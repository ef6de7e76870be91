"""A root saved with another step_name_format is not silently empty: a warning, and an error
naming the unmatched step directories and the format that would list them."""

from __future__ import annotations

import logging

import checkpointables as cp
import pytest
from checkpointables.training import step_name_formats

PADDED = cp.training.standard_name_format(step_prefix="step", step_format_fixed_length=6)
SUGGESTED = "cp.training.standard_name_format(step_prefix='step', step_format_fixed_length=6)"
LOGGER = "checkpointables.training"


def _save(root, steps, name_format=None) -> None:
    with cp.training.Checkpointer(root, step_name_format=name_format) as ckptr:
        for step in steps:
            ckptr.save_checkpointables(step, {"config": {"step": step}}, force=True)


def _mismatch_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "matches its step_name_format" in r.message]


def test_a_root_saved_with_another_format_says_which_format(tmp_path, caplog) -> None:
    root = tmp_path / "named"
    _save(root, (7, 10), PADDED)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    ckptr = cp.training.Checkpointer(root)
    assert ckptr.latest_step() is None  # The user's code asked for the default format.
    with pytest.raises(cp.training.errors.StepNotFoundError) as raised:
        ckptr.load_checkpointables()
    message = str(raised.value)
    assert "no committed checkpoint yet" in message
    assert "step_000007, step_000010" in message and SUGGESTED in message
    ckptr.reload()
    ckptr.close()
    cp.training.Checkpointer(root).close()
    (warning,) = _mismatch_warnings(caplog)  # Once, not at every reload or reopening.
    assert str(root) in warning and "step_000007" in warning and SUGGESTED in warning
    # The suggestion is exact: it lists the steps.
    suggested = eval(SUGGESTED, {"cp": cp})
    with cp.training.Checkpointer(root, step_name_format=suggested) as right:
        assert [s.step for s in right.steps()] == [7, 10]


def test_a_default_root_opened_with_a_prefix_suggests_the_default(tmp_path, caplog) -> None:
    _save(tmp_path / "plain", (3,))
    ckptr = cp.training.Checkpointer(tmp_path / "plain", step_name_format=PADDED)
    with ckptr, pytest.raises(cp.training.errors.StepNotFoundError, match=r"\(3\).*\(\)"):
        ckptr.load_checkpointables()


def test_names_no_standard_format_writes_are_named_without_a_guess(tmp_path) -> None:
    class Dashed:
        def build_name(self, step: int) -> str:
            return f"ckpt-{step}"

        def parse_step(self, name: str) -> int | None:
            head, _, number = name.partition("-")
            return int(number) if head == "ckpt" and number.isdigit() else None

    _save(tmp_path / "dashed", (1, 2, 3, 4), Dashed())
    ckptr = cp.training.Checkpointer(tmp_path / "dashed")
    with ckptr, pytest.raises(cp.training.errors.StepNotFoundError) as raised:
        ckptr.load_checkpointables()
    message = str(raised.value)
    assert "ckpt-1, ckpt-2, ckpt-3 and 1 more" in message
    assert "standard_name_format" not in message and "step_name_format they were saved" in message


def test_an_empty_root_or_unfinished_steps_say_nothing_more(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    (tmp_path / "run" / "step_000001").mkdir(parents=True)  # No commit: not a checkpoint.
    ckptr = cp.training.Checkpointer(tmp_path / "run")
    with ckptr, pytest.raises(cp.training.errors.StepNotFoundError, match="call reload") as raised:
        ckptr.load_checkpointables()
    assert "step_name_format" not in str(raised.value) and not _mismatch_warnings(caplog)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["step_000007", "step_1234567"], PADDED),
        (["run_1_0007"], step_name_formats.StandardNameFormat("run_1", 4)),
        (["12", "7"], cp.training.standard_name_format()),
        (["ckpt-1", ".hidden_7"], None),
    ],
)
def test_guess_standard_format(names, expected) -> None:
    assert step_name_formats.guess_standard_format(names) == expected
