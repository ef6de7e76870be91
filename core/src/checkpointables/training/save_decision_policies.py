"""When the training ``Checkpointer`` saves: ``save_decision_policy=...``.

A policy is any object with the method of ``SaveDecisionPolicy``; the classes
here cover the usual cases and compose with ``AnySavePolicy``. A ``save*``
call with ``force=True`` saves whatever the policy says.

Example::

    policy = cp.training.save_decision_policies.AnySavePolicy([
        cp.training.save_decision_policies.EveryNStepsPolicy(1000),
        cp.training.save_decision_policies.SpecificStepsPolicy([10, 100]),
    ])

A policy of your own::

    class EveryTenMinutes:
        def should_save(self, step, previous_steps, *, context):
            if not previous_steps:
                return True
            last = previous_steps[-1].commit_timestamp_nsecs or 0
            # A time after now was written by a fast clock: save rather than wait for it.
            return not 0 <= context.time_nsecs - last < 600 * 10**9
"""

from __future__ import annotations

import datetime
import logging
import numbers
import time
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from checkpointables import errors, options
from checkpointables.training._arguments import as_list, refuse_class
from checkpointables.training.step_info import StepInfo

__all__ = [
    "DecisionContext",
    "SaveDecisionPolicy",
    "EveryNStepsPolicy",
    "SpecificStepsPolicy",
    "ContinuousCheckpointingPolicy",
    "InitialSavePolicy",
    "AnySavePolicy",
    "default_policy",
]

logger = logging.getLogger("checkpointables.training")

# (step path, commit time) pairs already logged as impossible in this process: a policy
# runs at every step, and one warning per bad timestamp is enough.
_warned_clock: set[tuple[str, int]] = set()


def warn_about_clock(info: StepInfo, detail: str) -> None:
    """Logs, once per step and commit time, that ``info``'s commit time cannot be right
    (``detail`` says why and what the policy does instead): a clock was fast or set back."""
    t = info.commit_timestamp_nsecs
    key = (str(info.path), t if t is not None else -1)
    if key in _warned_clock:
        return
    _warned_clock.add(key)
    logger.warning(
        "Step %d (%s) records commit time %s, %s. A host's clock is probably wrong (fast, or "
        "set back): check that the clocks of the hosts are synchronised (NTP).",
        info.step,
        info.path,
        _time_text(t),
        detail,
    )


def _time_text(nsecs: int | None) -> str:
    """``nsecs`` as UTC, and as the number when no datetime can hold it (year 10000)."""
    if nsecs is None:
        return "None"
    try:
        when = datetime.datetime.fromtimestamp(nsecs / 1e9, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return f"{nsecs} ns since the epoch"
    return f"{when.isoformat()} ({nsecs} ns since the epoch)"


@attrs.frozen
class DecisionContext:
    """What a policy may need besides the steps.

    Attributes:
      is_saving_in_progress: a save of this Checkpointer has not committed yet.
      time_nsecs: the current time (ns since the epoch), read once per decision
        so that policies agree on it and tests can set it.
    """

    is_saving_in_progress: bool = False
    time_nsecs: int = attrs.field(factory=time.time_ns)


@runtime_checkable
class SaveDecisionPolicy(Protocol):
    """Decides whether a step is saved.

    ``step`` describes the candidate (its ``metrics`` are empty and its
    ``commit_timestamp_nsecs`` is ``None``: it is not saved yet);
    ``previous_steps`` are the committed steps of the root, sorted by step.
    Must be cheap and must not raise for any step >= 0.
    """

    def should_save(
        self, step: StepInfo, previous_steps: Sequence[StepInfo], *, context: DecisionContext
    ) -> bool:
        """Whether to save ``step``."""
        ...


@attrs.frozen
class EveryNStepsPolicy:
    """Saves steps that are multiples of ``steps`` (0, N, 2N, ...).

    Attributes:
      steps: the interval, > 0.
    """

    steps: int = attrs.field(validator=options.int_at_least(1, allowed="an int >= 1 (e.g. 1000)"))

    def should_save(
        self, step: StepInfo, previous_steps: Sequence[StepInfo], *, context: DecisionContext
    ) -> bool:
        """True when ``step.step`` is a multiple of the interval."""
        return step.step % self.steps == 0


def _steps_set(values: Iterable[int]) -> frozenset[int]:
    given = as_list("SpecificStepsPolicy", "steps", values, "SpecificStepsPolicy([10, 100])")
    steps = [options.python_scalar(s) for s in given]  # np.int64(10) is the step 10.
    wrong_type = [s for s in steps if isinstance(s, bool) or not isinstance(s, numbers.Integral)]
    bad = wrong_type or [s for s in steps if s < 0]
    if bad:
        raise options.invalid_option(
            "SpecificStepsPolicy",
            "steps",
            values,
            f"a list of steps, ints >= 0 (not {bad[0]!r})",
            wrong_type=bool(wrong_type),
        )
    return frozenset(int(s) for s in steps)


@attrs.frozen
class SpecificStepsPolicy:
    """Saves exactly the listed steps.

    Attributes:
      steps: the steps to save.
    """

    steps: frozenset[int] = attrs.field(converter=_steps_set)

    def should_save(
        self, step: StepInfo, previous_steps: Sequence[StepInfo], *, context: DecisionContext
    ) -> bool:
        """True when ``step.step`` is listed."""
        return step.step in self.steps


@attrs.frozen
class ContinuousCheckpointingPolicy:
    """Saves whenever no save is in flight: the next save starts as soon as the last commits.

    Saves asked for while one is in flight are skipped (``save*`` returns
    ``False``) instead of waiting, so training never blocks on storage.

    Attributes:
      minimum_interval_secs: also skip until this long has passed since the
        latest committed step (the highest one with a commit time) was
        committed (``None``: no minimum). A commit time after now, written by
        a fast clock, does not delay the save: the step is saved (with a
        warning), so that its own, current time is the one measured from.
    """

    minimum_interval_secs: float | None = attrs.field(
        default=None,
        validator=options.option_validator(
            "a number of seconds >= 0 (e.g. 600) or None",
            kind=numbers.Real,
            test=lambda v: v >= 0,
            optional=True,
        ),
    )

    def should_save(
        self, step: StepInfo, previous_steps: Sequence[StepInfo], *, context: DecisionContext
    ) -> bool:
        """False while saving; else True once the minimum interval has passed."""
        if context.is_saving_in_progress:
            return False
        if self.minimum_interval_secs is None:
            return True
        # The latest step's time, not the largest of all: an older step committed by a fast
        # clock would otherwise stop saving until real time caught up with it.
        latest = next((p for p in reversed(previous_steps) if p.commit_timestamp_nsecs), None)
        if latest is None or latest.commit_timestamp_nsecs is None:
            return True
        elapsed = context.time_nsecs - latest.commit_timestamp_nsecs
        if elapsed < 0:
            warn_about_clock(
                latest,
                f"{-elapsed / 1e9:.3f} s after now; ContinuousCheckpointingPolicy saves "
                f"instead of waiting for that time",
            )
            return True
        return elapsed >= self.minimum_interval_secs * 1e9


@attrs.frozen
class InitialSavePolicy:
    """Saves the first step of a root that has no committed step and no save in flight."""

    def should_save(
        self, step: StepInfo, previous_steps: Sequence[StepInfo], *, context: DecisionContext
    ) -> bool:
        """True when nothing was saved yet."""
        return not previous_steps and not context.is_saving_in_progress


def _policy_tuple(policies: Iterable[SaveDecisionPolicy]) -> tuple[SaveDecisionPolicy, ...]:
    example = "AnySavePolicy([InitialSavePolicy(), EveryNStepsPolicy(1000)])"
    return tuple(as_list("AnySavePolicy", "policies", policies, example))


@attrs.frozen
class AnySavePolicy:
    """Saves when any of ``policies`` says so.

    Attributes:
      policies: the policies to ask, in order (the first True wins).
    """

    policies: tuple[SaveDecisionPolicy, ...] = attrs.field(converter=_policy_tuple)

    @policies.validator
    def _check(self, attribute: object, value: tuple[object, ...]) -> None:
        for policy in value:
            refuse_class("each of AnySavePolicy's policies", policy, SaveDecisionPolicy)
            if not isinstance(policy, SaveDecisionPolicy):
                raise errors.InvalidArgumentTypeError(
                    f"AnySavePolicy takes save decision policies (objects with a should_save "
                    f"method), got {policy!r}."
                )

    def should_save(
        self, step: StepInfo, previous_steps: Sequence[StepInfo], *, context: DecisionContext
    ) -> bool:
        """True when any policy is."""
        return any(p.should_save(step, previous_steps, context=context) for p in self.policies)


def default_policy() -> AnySavePolicy:
    """The policy of a Checkpointer created without one: the first step, then continuously."""
    return AnySavePolicy([InitialSavePolicy(), ContinuousCheckpointingPolicy()])
