"""Time-based policies and commit times that a wrong clock wrote (in the future, or out of
order): such a time never stops saving and never deletes a step."""

from __future__ import annotations

import logging
import time

import checkpointables as cp
from hypothesis import given, settings
from hypothesis import strategies as st

D = cp.training.save_decision_policies
P = cp.training.preservation_policies
StepInfo = cp.training.StepInfo

S = 10**9  # One second in ns.
NOW = 1_800_000_000 * S
HOUR = 3600 * S


def infos(times, *, tag="skew"):
    return [
        StepInfo(step=i, path=f"/{tag}/{i}", commit_timestamp_nsecs=t) for i, t in enumerate(times)
    ]


def decide(policy, times, *, now=NOW, tag="skew"):
    context = D.DecisionContext(time_nsecs=now)
    candidate = StepInfo(step=len(times), path=f"/{tag}/{len(times)}")
    return policy.should_save(candidate, infos(times, tag=tag), context=context)


def kept(policy, times, *, tag="skew"):
    steps = infos(times, tag=tag)
    decisions = policy.should_preserve(steps, context=P.PreservationContext(time_nsecs=NOW))
    return [s.step for s, keep in zip(steps, decisions, strict=True) if keep]


def test_continuous_saves_when_the_latest_commit_time_is_in_the_future(caplog) -> None:
    policy = D.ContinuousCheckpointingPolicy(minimum_interval_secs=60)
    # The previous job's host ran an hour ahead; a year-2100 time is no different.
    future = [NOW + HOUR, NOW + HOUR + S, NOW + HOUR + 2 * S]
    with caplog.at_level(logging.WARNING, logger="checkpointables.training"):
        assert decide(policy, future, tag="future")
        assert decide(policy, future, tag="future")
        assert decide(policy, [4_102_444_800 * S], tag="y2100")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # Once per step and time, not at every step.
    assert "Step 2 (/future/2)" in warnings[0] and str(NOW + HOUR + 2 * S) in warnings[0]
    assert "2100-01-01T00:00:00+00:00" in warnings[1]


def test_continuous_measures_from_the_latest_step_not_an_older_future_one() -> None:
    policy = D.ContinuousCheckpointingPolicy(minimum_interval_secs=60)
    # Steps 0-2 by a fast clock, step 3 by this one 10 s ago: the interval runs from step 3.
    times = [NOW + HOUR, NOW + HOUR + S, NOW + HOUR + 2 * S, NOW - 10 * S]
    assert not decide(policy, times, now=NOW)
    assert decide(policy, times, now=NOW + 50 * S)
    # A time too large for a datetime is named by its number.
    assert decide(policy, [2**62 + 2**61], tag="huge")


def test_every_n_seconds_keeps_the_steps_after_a_clock_went_back(caplog) -> None:
    # The attack: steps 0-2 by a host an hour ahead, 3-9 by this one 0.4 s apart.
    fast = [NOW + HOUR, NOW + HOUR + S // 10, NOW + HOUR + 2 * S // 10]
    later = [NOW + 4 * k * S // 10 for k in range(7)]
    right = [NOW - 10 * S, NOW - 10 * S + S // 10, NOW - 10 * S + 2 * S // 10]
    policy = P.EveryNSeconds(interval_secs=0.3)
    with caplog.at_level(logging.WARNING, logger="checkpointables.training"):
        assert kept(policy, fast + later, tag="back") == [0, 3, 4, 5, 6, 7, 8, 9]
    assert kept(policy, right + later, tag="ok") == [0, 3, 4, 5, 6, 7, 8, 9]  # True times.
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "Step 3 (/back/3)" in warning and "before that of step 2" in warning


# Property: a wrong clock never makes EveryNSeconds keep fewer steps than true times would.
# True times rise; each job (segment) has its own clock offset. A clock behind the previous
# job's is modelled only when it puts a job's first step before the step preceding it: a
# smaller error is indistinguishable from a true shorter gap, for any rule.


@st.composite
def skewed_runs(draw):
    gaps = draw(st.lists(st.integers(0, 100), min_size=1, max_size=25))
    true = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    observed, offset = [], 0
    cuts = set(draw(st.lists(st.integers(1, len(true)), max_size=4)))
    for i, t in enumerate(true):
        if i in cuts:
            gap = t - true[i - 1]
            ahead = draw(st.integers(0, 300))  # The new job's clock is ahead of the old...
            behind = draw(st.integers(gap + 1, gap + 300))  # ... or behind it by more than the gap.
            offset += ahead if draw(st.booleans()) else -behind
        observed.append(t + offset)
    return true, observed, draw(st.integers(1, 150))


@settings(max_examples=150, deadline=None)
@given(skewed_runs())
def test_every_n_seconds_never_keeps_fewer_than_with_true_times(run) -> None:
    true, observed, interval = run
    policy = P.EveryNSeconds(interval_secs=interval)
    with_true = kept(policy, [t * S for t in true])
    with_skew = kept(policy, [t * S for t in observed])
    assert len(with_skew) >= len(with_true), (with_true, with_skew)
    if true == observed:
        assert with_skew == with_true


# Property: commit times a fast clock put after now never delay a save. Undetectable is only
# the latest step's time when it is fast yet not after now.


@settings(max_examples=150, deadline=None)
@given(
    gaps=st.lists(st.integers(0, 100), min_size=1, max_size=10),
    fast_prefix=st.integers(0, 10),
    ahead=st.integers(1, 10**6),
    since_last=st.integers(0, 200),
    interval=st.integers(0, 150),
)
def test_continuous_never_saves_less_for_a_future_time(
    gaps, fast_prefix, ahead, since_last, interval
) -> None:
    true = [sum(gaps[: i + 1]) * S for i in range(len(gaps))]
    now = true[-1] + since_last * S
    observed = [t + ahead * S if i < fast_prefix else t for i, t in enumerate(true)]
    if fast_prefix >= len(true) and observed[-1] <= now:
        return  # The latest step is fast but not after now: no rule can tell.
    policy = D.ContinuousCheckpointingPolicy(minimum_interval_secs=interval)
    if decide(policy, true, now=now, tag="true"):
        assert decide(policy, observed, now=now, tag="observed")


def test_a_checkpointer_resumed_after_a_fast_clock_saves_and_keeps(tmp_path, monkeypatch) -> None:
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + HOUR)
    with cp.training.Checkpointer(tmp_path) as fast:
        for step in range(3):
            assert fast.save_checkpointables(step, {"extra": {"step": step}}, force=True)
    monkeypatch.setattr(time, "time_ns", real)
    with cp.training.Checkpointer(
        tmp_path,
        save_decision_policy=D.ContinuousCheckpointingPolicy(minimum_interval_secs=0.05),
        preservation_policy=P.EveryNSeconds(interval_secs=0.05),
    ) as ckptr:
        saved = []
        for step in range(3, 8):
            if ckptr.save_checkpointables(step, {"extra": {"step": step}}):
                saved.append(step)
            ckptr.wait()
            time.sleep(0.06)
        assert saved == [3, 4, 5, 6, 7]
    assert [s.step for s in cp.training.Checkpointer(tmp_path).steps()][-5:] == saved
