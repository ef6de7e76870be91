"""Listing a root (reload()) while another Checkpointer deletes or replaces its steps.

The races are made deterministic: the other Checkpointer's real deletion (its
preservation policy, after a save) or overwrite runs at the exact moment the
listing is between two reads of a step, through the interpreter's trace hook
(nothing of the library is replaced).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import checkpointables as cp
from checkpointables import storage

D = cp.training.save_decision_policies
P = cp.training.preservation_policies
EVERY_STEP = D.EveryNStepsPolicy(1)


@contextlib.contextmanager
def before_reading(suffix: str, action: Callable[[], None]) -> Iterator[None]:
    """Runs ``action`` once, in this thread, just before the first ``storage.read_bytes``
    of a file whose path ends with ``suffix`` (``_CHECKSUMS`` was read by then)."""
    ran = []

    def trace(frame: FrameType, event: str, arg: Any) -> None:
        reads = event == "call" and frame.f_code is storage.read_bytes.__code__
        if reads and not ran and os.fspath(frame.f_locals["path"]).endswith(suffix):
            ran.append(True)
            action()  # Untraced: the hook is off while it runs.

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(None)
    assert ran, f"nothing read a file ending with {suffix}"


def _no_warnings(caplog) -> None:
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []


def test_a_step_deleted_while_reload_reads_it_is_left_out_without_a_warning(
    tmp_path, caplog
) -> None:
    trainer = cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, preservation_policy=P.LatestN(1)
    )
    trainer.save_checkpointables(0, {"extra": {"v": 0}})
    evaluator = cp.training.Checkpointer(tmp_path)

    def delete_step_0() -> None:  # As the trainer does: save 1, its policy deletes 0.
        trainer.save_checkpointables(1, {"extra": {"v": 1}})
        trainer.wait()
        assert not (tmp_path / "0").exists()

    with caplog.at_level(logging.WARNING), before_reading("0/_CHECKPOINT_METADATA", delete_step_0):
        evaluator.reload()
    _no_warnings(caplog)
    assert [s.step for s in evaluator.steps()] == []  # Step 1 came after the listing.
    evaluator.reload()
    assert [s.step for s in evaluator.steps()] == [1]
    trainer.close()


def test_a_step_replaced_while_reload_reads_it_is_listed_as_the_new_one(tmp_path, caplog) -> None:
    trainer = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    trainer.save_checkpointables(0, {"extra": {"v": 0}}, metrics={"loss": 1.0})
    evaluator = cp.training.Checkpointer(tmp_path)

    def replace_step_0() -> None:
        trainer.save_checkpointables(0, {"extra": {"v": 2}}, overwrite=True, metrics={"loss": 0.5})

    with caplog.at_level(logging.WARNING), before_reading("0/_CHECKPOINT_METADATA", replace_step_0):
        evaluator.reload()
    _no_warnings(caplog)
    assert [(s.step, s.metrics) for s in evaluator.steps()] == [(0, {"loss": 0.5})]
    assert evaluator.load_checkpointables(0) == {"extra": {"v": 2}}
    trainer.close()


def test_a_damaged_step_is_still_reported(tmp_path, caplog) -> None:
    with cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP) as trainer:
        trainer.save_checkpointables(0, {"extra": {"v": 0}})
        trainer.save_checkpointables(1, {"extra": {"v": 1}})
    os.remove(tmp_path / "0" / "_CHECKPOINT_METADATA")  # Lost, not deleted with its step.
    with caplog.at_level(logging.WARNING):
        evaluator = cp.training.Checkpointer(tmp_path)
    assert [s.step for s in evaluator.steps()] == [1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "0/_CHECKPOINT_METADATA is missing" in warnings[0]
