"""Which committed steps the training ``Checkpointer`` keeps: ``preservation_policy=...``.

After every commit the Checkpointer asks its policy which steps to keep and
deletes the others in the background. The latest step is always kept,
whatever the policy says, so that a run can resume; a step that is being
loaded is deleted only once the load has finished.

Example: the latest 3 steps (to resume) and the 2 with the lowest loss::

    keep = cp.training.preservation_policies.AnyPreservationPolicy([
        cp.training.preservation_policies.LatestN(3),
        cp.training.preservation_policies.BestN(
            get_metric_fn=lambda m: m["loss"], reverse=True, n=2),
    ])

A policy of your own returns one bool per step::

    class KeepEvenSteps:
        def should_preserve(self, steps, *, context):
            return [s.step % 2 == 0 for s in steps]
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from checkpointables import errors, options
from checkpointables.training._arguments import as_list, refuse_class
from checkpointables.training.save_decision_policies import warn_about_clock
from checkpointables.training.step_info import StepInfo

__all__ = [
    "PreservationContext",
    "PreservationPolicy",
    "PreserveAll",
    "LatestN",
    "EveryNSteps",
    "EveryNSeconds",
    "BestN",
    "AnyPreservationPolicy",
]


@attrs.frozen
class PreservationContext:
    """What a policy may need besides the steps.

    Attributes:
      time_nsecs: the current time (ns since the epoch), read once per decision.
    """

    time_nsecs: int = attrs.field(factory=time.time_ns)


@runtime_checkable
class PreservationPolicy(Protocol):
    """Decides which committed steps to keep.

    ``steps`` are the committed steps of the root, sorted by step; the result
    has one bool per step, in the same order (True: keep). It runs on a
    background thread after each commit; an exception it raises surfaces on
    the next ``save*``, ``wait()`` or ``close()`` and deletes nothing.
    """

    def should_preserve(
        self, steps: Sequence[StepInfo], *, context: PreservationContext
    ) -> Sequence[bool]:
        """One bool per step: whether to keep it."""
        ...


# Each field is checked where the policy is made (cp.options' validators): a wrong type
# raises cp.errors.InvalidArgumentTypeError, also an InvalidArgumentError as before.
_count_or_none = options.int_at_least(0, optional=True, allowed="an int >= 0 (e.g. 3) or None")


@attrs.frozen
class PreserveAll:
    """Keeps every step (the default)."""

    def should_preserve(
        self, steps: Sequence[StepInfo], *, context: PreservationContext
    ) -> Sequence[bool]:
        """All True."""
        return [True] * len(steps)


@attrs.frozen
class LatestN:
    """Keeps the ``n`` highest steps.

    Attributes:
      n: how many to keep, >= 1; ``None`` keeps all. ``0`` is refused: the latest
        step is always kept (a restarted run resumes from it), so it would mean 1.
    """

    n: int | None = attrs.field(
        default=None,
        validator=options.int_at_least(
            1,
            optional=True,
            allowed="an int >= 1 (e.g. 3; the latest step is always kept) or None (keep all)",
        ),
    )

    def should_preserve(
        self, steps: Sequence[StepInfo], *, context: PreservationContext
    ) -> Sequence[bool]:
        """True for the last ``n`` steps."""
        if self.n is None:
            return [True] * len(steps)
        first_kept = len(steps) - self.n
        return [i >= first_kept for i in range(len(steps))]


@attrs.frozen
class EveryNSteps:
    """Keeps steps that are multiples of ``interval_steps``.

    Attributes:
      interval_steps: the interval, > 0.
    """

    interval_steps: int = attrs.field(
        validator=options.int_at_least(1, allowed="an int >= 1 (e.g. 1000)")
    )

    def should_preserve(
        self, steps: Sequence[StepInfo], *, context: PreservationContext
    ) -> Sequence[bool]:
        """True for multiples of the interval."""
        return [s.step % self.interval_steps == 0 for s in steps]


@attrs.frozen
class EveryNSeconds:
    """Keeps steps at least ``interval_secs`` apart in commit time.

    The first step is kept; each later step is kept if it was committed at
    least ``interval_secs`` after the last kept one. Steps without a commit
    time are kept.

    A step whose commit time is before the previous step's (a clock was fast,
    or set back) is kept, with a warning, and later steps are measured from
    it: a gap that a wrong clock makes negative never deletes a step.

    Attributes:
      interval_secs: the spacing, > 0.
    """

    interval_secs: float = attrs.field(
        validator=options.option_validator(
            "a number of seconds > 0 (e.g. 3600)", kind=numbers.Real, test=lambda v: v > 0
        )
    )

    def should_preserve(
        self, steps: Sequence[StepInfo], *, context: PreservationContext
    ) -> Sequence[bool]:
        """True for the first step and every step ``interval_secs`` after the last kept one."""
        result = []
        last_kept: int | None = None
        previous: tuple[int, int] | None = None  # (step, time): the latest step with a time.
        for s in steps:
            t = s.commit_timestamp_nsecs
            keep = t is None or last_kept is None or t - last_kept >= self.interval_secs * 1e9
            # Compared with the previous step, not the last kept one: a step between them
            # committed by a fast clock also shortens the gaps after it, undetected otherwise.
            if t is not None and previous is not None and t < previous[1]:
                warn_about_clock(
                    s,
                    f"before that of step {previous[0]} ({previous[1]} ns), unless step "
                    f"{previous[0]} was saved again later; EveryNSeconds keeps step {s.step} and "
                    f"measures the later steps from it",
                )
                keep = True
            if keep and t is not None:
                last_kept = t
            if t is not None:
                previous = (s.step, t)
            result.append(keep)
        return result


@attrs.frozen
class BestN:
    """Keeps the ``n`` best steps by a metric.

    Steps are sorted by ``get_metric_fn(metrics)``, ascending, or descending
    when ``reverse`` is true, and the **last** ``n`` are kept: by default the
    largest values (accuracy); with ``reverse=True`` the smallest (loss). This
    is the convention of Orbax's ``BestN``.

    Attributes:
      get_metric_fn: maps a step's metrics dict to a number.
      reverse: sort descending (keep the smallest values).
      n: how many to keep; ``None`` keeps all, ``0`` none (other than steps
        without metrics, see below).
      keep_checkpoints_without_metrics: keep steps saved with no metrics.
    """

    get_metric_fn: Callable[[Mapping[str, Any]], float] = attrs.field()
    reverse: bool = attrs.field(default=False, validator=options.boolean())
    n: int | None = attrs.field(default=None, validator=_count_or_none)
    keep_checkpoints_without_metrics: bool = attrs.field(default=True, validator=options.boolean())

    @get_metric_fn.validator
    def _check(self, attribute: object, value: object) -> None:
        if not callable(value):
            raise errors.InvalidArgumentTypeError(f"get_metric_fn must be callable, got {value!r}.")

    def _metric(self, info: StepInfo) -> float:
        try:
            value = self.get_metric_fn(info.metrics)
        except Exception as e:
            raise errors.InvalidArgumentError(
                f"BestN.get_metric_fn failed on the metrics of step {info.step} "
                f"({info.metrics!r}): {type(e).__name__}: {e}. Save the metric with every step, "
                f"or make get_metric_fn handle its absence."
            ) from e
        # Metrics come from the steps' files: a string there would fail the sort with a
        # TypeError, far from its cause. A NumPy or JAX scalar (0-d) is a number too.
        number = value
        if not isinstance(value, numbers.Real) and np.ndim(value) == 0:
            scalar = np.asarray(value)
            number = scalar.item() if scalar.dtype.kind in "iuf" else value
        try:
            if not isinstance(number, numbers.Real) or isinstance(number, bool):
                raise TypeError
            return float(number)
        except (TypeError, OverflowError):  # OverflowError: an int past float's range.
            raise errors.InvalidArgumentError(
                f"BestN.get_metric_fn returned {value!r} for the metrics of step {info.step} "
                f"({info.metrics!r}); it must return a number. Save the metric as a number "
                f"with every step, or make get_metric_fn convert it."
            ) from None

    def should_preserve(
        self, steps: Sequence[StepInfo], *, context: PreservationContext
    ) -> Sequence[bool]:
        """True for the ``n`` best steps (and, if so configured, those without metrics)."""
        if self.n is None:
            return [True] * len(steps)
        scores = {i: self._metric(s) for i, s in enumerate(steps) if s.metrics}
        ranked = [i for i, v in scores.items() if math.isnan(v)]  # Worst: a diverged run's.
        finite = [i for i, v in scores.items() if not math.isnan(v)]
        ranked += sorted(finite, key=scores.__getitem__, reverse=self.reverse)
        kept = set(ranked[max(0, len(ranked) - self.n) :])
        return [
            i in kept or (not s.metrics and self.keep_checkpoints_without_metrics)
            for i, s in enumerate(steps)
        ]


def _policy_tuple(policies: Iterable[PreservationPolicy]) -> tuple[PreservationPolicy, ...]:
    example = "AnyPreservationPolicy([LatestN(3), EveryNSteps(1000)])"
    return tuple(as_list("AnyPreservationPolicy", "policies", policies, example))


@attrs.frozen
class AnyPreservationPolicy:
    """Keeps a step when any of ``policies`` keeps it.

    Attributes:
      policies: the policies to combine.
    """

    policies: tuple[PreservationPolicy, ...] = attrs.field(converter=_policy_tuple)

    @policies.validator
    def _check(self, attribute: object, value: tuple[object, ...]) -> None:
        for policy in value:
            refuse_class("each of AnyPreservationPolicy's policies", policy, PreservationPolicy)
            if not isinstance(policy, PreservationPolicy):
                raise errors.InvalidArgumentTypeError(
                    f"AnyPreservationPolicy takes preservation policies (objects with a "
                    f"should_preserve method), got {policy!r}."
                )

    def should_preserve(
        self, steps: Sequence[StepInfo], *, context: PreservationContext
    ) -> Sequence[bool]:
        """The element-wise OR of the policies' answers."""
        result = [False] * len(steps)
        for policy in self.policies:
            answer = checked_decision(policy, steps, context)
            result = [a or b for a, b in zip(result, answer, strict=True)]
        return result


def checked_decision(
    policy: PreservationPolicy, steps: Sequence[StepInfo], context: PreservationContext
) -> list[bool]:
    """``policy.should_preserve(steps)`` as a list, checked to have one bool per step."""
    answer = list(policy.should_preserve(steps, context=context))
    if len(answer) != len(steps):
        raise errors.InvalidArgumentError(
            f"Preservation policy {policy!r} returned {len(answer)} decisions for {len(steps)} "
            f"steps; should_preserve must return one bool per step, in order."
        )
    return [bool(a) for a in answer]
