"""Save decision and preservation policies, and step name formats, as pure functions."""

from __future__ import annotations

import checkpointables as cp
import numpy as np
import pytest

NAN = float("nan")

D = cp.training.save_decision_policies
P = cp.training.preservation_policies
StepInfo = cp.training.StepInfo


def infos(steps, *, metrics=None, times=None):
    return [
        StepInfo(
            step=s,
            path=f"/root/{s}",
            metrics=(metrics or {}).get(s, {}),
            commit_timestamp_nsecs=None if times is None else times[i],
        )
        for i, s in enumerate(steps)
    ]


def decide(policy, step, previous=(), *, saving=False, now=10**18):
    context = D.DecisionContext(is_saving_in_progress=saving, time_nsecs=now)
    return policy.should_save(
        StepInfo(step=step, path=f"/root/{step}"), list(previous), context=context
    )


def kept(policy, steps):
    decisions = policy.should_preserve(steps, context=P.PreservationContext())
    return [s.step for s, keep in zip(steps, decisions, strict=True) if keep]


# Save decisions.


def test_every_n_steps() -> None:
    policy = D.EveryNStepsPolicy(steps=5)
    assert [s for s in range(13) if decide(policy, s)] == [0, 5, 10]


def test_specific_steps() -> None:
    policy = D.SpecificStepsPolicy([3, 7])
    assert [s for s in range(10) if decide(policy, s)] == [3, 7]


def test_continuous_skips_while_saving_and_honours_interval() -> None:
    policy = D.ContinuousCheckpointingPolicy()
    assert decide(policy, 1)
    assert not decide(policy, 1, saving=True)
    spaced = D.ContinuousCheckpointingPolicy(minimum_interval_secs=60)
    previous = infos([0], times=[1_000 * 10**9])
    assert decide(spaced, 1)  # No previous step.
    assert not decide(spaced, 1, previous, now=1_059 * 10**9)
    assert decide(spaced, 1, previous, now=1_060 * 10**9)
    assert not decide(spaced, 1, previous, saving=True, now=2_000 * 10**9)


def test_initial_save_only_for_an_empty_root() -> None:
    policy = D.InitialSavePolicy()
    assert decide(policy, 7)
    assert not decide(policy, 7, infos([0]))
    assert not decide(policy, 7, saving=True)


def test_any_save_policy() -> None:
    policy = D.AnySavePolicy([D.EveryNStepsPolicy(10), D.SpecificStepsPolicy([3])])
    assert [s for s in range(25) if decide(policy, s)] == [0, 3, 10, 20]


@pytest.mark.parametrize(
    "make",
    [
        lambda: D.EveryNStepsPolicy(0),
        lambda: D.EveryNStepsPolicy(-2),
        lambda: D.SpecificStepsPolicy([1, -1]),
        lambda: D.ContinuousCheckpointingPolicy(minimum_interval_secs=-1),
    ],
)
def test_bad_decision_arguments(make) -> None:
    with pytest.raises(ValueError):
        make()


def test_any_save_policy_rejects_non_policies() -> None:
    with pytest.raises(TypeError, match="should_save"):
        D.AnySavePolicy([D.EveryNStepsPolicy(2), "often"])


def test_user_policies_satisfy_the_protocol() -> None:
    class Odd:
        def should_save(self, step, previous_steps, *, context):
            return step.step % 2 == 1

    assert isinstance(Odd(), D.SaveDecisionPolicy)
    assert [s for s in range(6) if decide(D.AnySavePolicy([Odd()]), s)] == [1, 3, 5]


# Preservation.


def test_preserve_all_and_latest_n() -> None:
    steps = infos([0, 10, 20, 30, 40])
    assert kept(P.PreserveAll(), steps) == [0, 10, 20, 30, 40]
    assert kept(P.LatestN(2), steps) == [30, 40]
    assert kept(P.LatestN(10), steps) == [0, 10, 20, 30, 40]
    assert kept(P.LatestN(None), steps) == [0, 10, 20, 30, 40]
    assert kept(P.LatestN(1), steps) == [40]


@pytest.mark.parametrize("n", [0, -1])
def test_latest_n_below_one_is_refused_naming_the_field(n: int) -> None:
    # The latest step is always kept, so LatestN(0) would mean LatestN(1): refused, as
    # EveryNStepsPolicy(0) is.
    with pytest.raises(cp.errors.InvalidArgumentError, match=rf"^LatestN\.n={n} \(int\) is"):
        P.LatestN(n)


def test_every_n_steps_preservation() -> None:
    assert kept(P.EveryNSteps(20), infos([0, 10, 20, 30, 40, 45])) == [0, 20, 40]


def test_every_n_seconds() -> None:
    s = 10**9
    steps = infos([0, 1, 2, 3, 4, 5], times=[0, 30 * s, 60 * s, 61 * s, 119 * s, 125 * s])
    assert kept(P.EveryNSeconds(60), steps) == [0, 2, 5]
    # Steps without a commit time are kept rather than guessed about.
    assert kept(P.EveryNSeconds(60), infos([0, 1])) == [0, 1]


def test_best_n_follows_orbax_ordering() -> None:
    # Orbax's documented cases: reverse=False keeps the largest, reverse=True the smallest.
    accuracy = {i: {"acc": a} for i, a in enumerate([0.8, 0.6, 0.2, 0.3, 0.9])}
    steps = infos(range(5), metrics=accuracy)
    assert kept(P.BestN(get_metric_fn=lambda m: m["acc"], n=2), steps) == [0, 4]
    loss = {i: {"loss": v} for i, v in enumerate([0.3, 0.2, 0.8, 0.9, 0.4])}
    steps = infos(range(5), metrics=loss)
    assert kept(P.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2), steps) == [0, 1]
    assert kept(P.BestN(get_metric_fn=lambda m: m["loss"], n=None), steps) == [0, 1, 2, 3, 4]
    assert kept(P.BestN(get_metric_fn=lambda m: m["loss"], n=10), steps) == [0, 1, 2, 3, 4]
    assert kept(P.BestN(get_metric_fn=lambda m: m["loss"], n=0), steps) == []


def test_best_n_steps_without_metrics() -> None:
    steps = infos(range(4), metrics={1: {"loss": 0.5}, 2: {"loss": 0.1}})
    best = P.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1)
    assert kept(best, steps) == [0, 2, 3]
    strict = P.BestN(
        get_metric_fn=lambda m: m["loss"], reverse=True, n=1, keep_checkpoints_without_metrics=False
    )
    assert kept(strict, steps) == [2]


def test_best_n_names_the_step_whose_metric_fails() -> None:
    steps = infos(range(3), metrics={0: {"loss": 1.0}, 1: {"acc": 0.5}, 2: {"loss": 0.5}})
    with pytest.raises(ValueError, match=r"step 1 .*'acc'.*KeyError"):
        kept(P.BestN(get_metric_fn=lambda m: m["loss"], n=1), steps)


def test_best_n_refuses_a_metric_that_is_no_number_and_ranks_nan_last() -> None:
    # Metrics come from the steps' files: "abc" beside [1, 2] was a TypeError from sorted().
    steps = infos(range(3), metrics={0: {"loss": 0.5}, 1: {"loss": "abc"}, 2: {"loss": [1, 2]}})
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"returned 'abc' .* step 1"):
        kept(P.BestN(get_metric_fn=lambda m: m["loss"], n=1), steps)
    diverged = infos(range(3), metrics={i: {"loss": v} for i, v in enumerate([0.5, NAN, 0.2])})
    best = P.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)
    assert kept(best, diverged) == [0, 2]
    assert kept(P.BestN(get_metric_fn=lambda m: m["loss"], n=2), diverged) == [0, 2]
    huge = infos(range(2), metrics={0: {"loss": 10**400}, 1: {"loss": 0.5}})  # Past a float.
    with pytest.raises(cp.errors.InvalidArgumentError, match=r"returned 1000.* step 0"):
        kept(P.BestN(get_metric_fn=lambda m: m["loss"], n=1), huge)
    arrays = infos(range(3), metrics={i: {"acc": v} for i, v in enumerate([0.1, 0.9, 0.5])})
    as_0d = P.BestN(get_metric_fn=lambda m: np.asarray(m["acc"], np.float32), n=1)
    assert kept(as_0d, arrays) == [1]  # 0-d arrays (and NumPy scalars) are numbers.


def test_any_preservation_policy_is_the_issue_example() -> None:
    losses = [0.9, 0.1, 0.8, 0.2, 0.7, 0.6, 0.5]
    steps = infos(range(7), metrics={i: {"loss": v} for i, v in enumerate(losses)})
    keep = P.AnyPreservationPolicy(
        [P.LatestN(3), P.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)]
    )
    assert kept(keep, steps) == [1, 3, 4, 5, 6]


def test_any_preservation_policy_checks_its_members() -> None:
    class WrongLength:
        def should_preserve(self, steps, *, context):
            return [True]

    with pytest.raises(ValueError, match="returned 1 decisions for 3 steps"):
        kept(P.AnyPreservationPolicy([WrongLength()]), infos([0, 1, 2]))
    with pytest.raises(TypeError, match="should_preserve"):
        P.AnyPreservationPolicy([P.LatestN(1), 3])


@pytest.mark.parametrize(
    "make",
    [
        lambda: P.LatestN(-1),
        lambda: P.EveryNSteps(0),
        lambda: P.EveryNSeconds(0),
        lambda: P.BestN(get_metric_fn=len, n=-1),
    ],
)
def test_bad_preservation_arguments(make) -> None:
    with pytest.raises(ValueError):
        make()


# Step names.


def test_default_name_format_is_the_bare_number() -> None:
    fmt = cp.training.standard_name_format()
    assert fmt.build_name(0) == "0" and fmt.build_name(1200) == "1200"
    assert fmt.parse_step("1200") == 1200 and fmt.parse_step("0") == 0
    for other in ["007", "-1", "1e3", "12a", "", "step_1", "٣", "5.checkpointables-tmp-1-2-ab"]:
        assert fmt.parse_step(other) is None, other


def test_prefix_and_padding() -> None:
    fmt = cp.training.standard_name_format(step_prefix="step", step_format_fixed_length=5)
    assert fmt.build_name(3) == "step_00003"
    assert fmt.build_name(1234567) == "step_1234567"
    assert fmt.parse_step("step_00003") == 3
    assert fmt.parse_step("step_1234567") == 1234567
    for other in ["3", "00003", "step_3", "step_000003", "stepx_00003", "step_0003"]:
        assert fmt.parse_step(other) is None, other
    assert cp.training.standard_name_format(step_prefix="ckpt").build_name(7) == "ckpt_7"


@pytest.mark.parametrize(
    "kwargs",
    [{"step_prefix": ""}, {"step_prefix": "a/b"}, {"step_format_fixed_length": 0}],
)
def test_bad_name_formats(kwargs) -> None:
    with pytest.raises(ValueError):
        cp.training.standard_name_format(**kwargs)


def test_negative_steps_have_no_name() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        cp.training.standard_name_format().build_name(-1)
