"""Training loops: a sequence of checkpoints, one per step, under a root directory.

Example::

    import checkpointables as cp

    policy = cp.training.save_decision_policies.EveryNStepsPolicy(steps=1000)
    keep = cp.training.preservation_policies.LatestN(3)
    with cp.training.Checkpointer(root, save_decision_policy=policy,
                                  preservation_policy=keep) as ckptr:
        start = ckptr.latest_step()
        state = ckptr.load_pytree(start.step, abstract_state) if start else init_state
        for step in range(start.step + 1 if start else 0, num_steps):
            state, loss = train_step(state)
            ckptr.save_pytree_async(step, state, metrics={"loss": loss})

See ``docs/training.md`` for the guide.
"""

from __future__ import annotations

from checkpointables.training import (
    errors,
    preservation_policies,
    save_decision_policies,
    step_name_formats,
)
from checkpointables.training._save_stats import SaveStats
from checkpointables.training.checkpointer import Checkpointer
from checkpointables.training.local_tier import LocalTier, RestoreStats
from checkpointables.training.step_info import RootMetadata, StepInfo
from checkpointables.training.step_name_formats import StepNameFormat, standard_name_format

__all__ = [
    "Checkpointer",
    "LocalTier",
    "RestoreStats",
    "SaveStats",
    "StepInfo",
    "RootMetadata",
    "StepNameFormat",
    "standard_name_format",
    # Modules.
    "errors",
    "preservation_policies",
    "save_decision_policies",
    "step_name_formats",
]
