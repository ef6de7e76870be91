"""Writes roots with the real Orbax Checkpoint, for the compatibility tests.

Usage: python orbax_writer.py DIRECTORY

Run in its own process: Orbax and absl set up logging and warnings that the
test process should not inherit.
"""

from __future__ import annotations

import sys

import numpy as np


def state(step: int) -> dict:
    """The pytree saved at ``step`` (the tests recompute it)."""
    return {"a": np.arange(4, dtype=np.int32) + step, "b": {"c": np.full((2, 3), step, np.float32)}}


def extra(step: int) -> dict:
    """The JSON item saved at ``step``."""
    return {"step": step, "name": f"s{step}"}


def metrics(step: int) -> dict:
    """The metrics saved at ``step``."""
    return {"loss": 1.0 / (step + 1), "acc": {"top1": step / 10}}


def main(directory: str) -> None:
    import orbax.checkpoint as ocp
    from orbax.checkpoint import v1 as ocp_v1

    # Orbax V1's training Checkpointer: state/ and metrics/metrics per step.
    with ocp_v1.training.Checkpointer(f"{directory}/v1", custom_metadata={"exp": "x"}) as ckptr:
        for step in range(3):
            ckptr.save(step, state(step), metrics={"loss": 1.0 / (step + 1)})

    # Orbax V0's CheckpointManager with two items (a JSON one and a pytree).
    manager = ocp.CheckpointManager(f"{directory}/v0", metadata={"hello": 1})
    for step in (0, 10, 20):
        manager.save(
            step,
            args=ocp.args.Composite(
                extra=ocp.args.JsonSave({"step": step, "x": [1, 2]}),
                state=ocp.args.StandardSave(state(step)),
            ),
        )
    manager.wait_until_finished()
    manager.close()

    # Orbax V0's CheckpointManager writes metrics (a metrics/ item) when it tracks the best.
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    manager = ocp.CheckpointManager(f"{directory}/v0_metrics", options=options)
    for step in (0, 1, 2):
        manager.save(
            step,
            args=ocp.args.Composite(
                extra=ocp.args.JsonSave(extra(step)), state=ocp.args.StandardSave(state(step))
            ),
            metrics=metrics(step),
        )
    manager.wait_until_finished()
    manager.close()

    # Orbax V1's training Checkpointer with several checkpointables (its JSON-like dicts are
    # saved as pytrees) and metrics.
    with ocp_v1.training.Checkpointer(f"{directory}/v1_items") as ckptr:
        for step in range(2):
            items = {"state": state(step), "extra": extra(step)}
            ckptr.save_checkpointables(step, items, metrics=metrics(step))

    # A single unnamed item, with a step prefix and zero padding.
    options = ocp.CheckpointManagerOptions(step_prefix="step", step_format_fixed_length=5)
    manager = ocp.CheckpointManager(f"{directory}/prefixed", options=options)
    for step in (5, 15):
        manager.save(step, args=ocp.args.StandardSave(state(step)))
    manager.wait_until_finished()
    manager.close()


if __name__ == "__main__":
    main(sys.argv[1])
