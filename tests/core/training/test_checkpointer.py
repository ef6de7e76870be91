"""The training Checkpointer: saving, listing and loading steps (JSON and stateful objects)."""

from __future__ import annotations

import json
import os
import stat
import threading

import checkpointables as cp
import numpy as np
import pytest

from .helpers import TIMEOUT, Value, load_value

D = cp.training.save_decision_policies
P = cp.training.preservation_policies
EVERY_STEP = D.EveryNStepsPolicy(1)


def test_save_list_and_load(tmp_path) -> None:
    with cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP) as ckptr:
        assert ckptr.latest_step() is None and ckptr.steps() == []
        for step in range(3):
            assert ckptr.save_checkpointables(step, {"extra": {"step": step}}, metrics={"l": step})
        assert [s.step for s in ckptr.steps()] == [0, 1, 2]
        latest = ckptr.latest_step()
        assert latest.step == 2 and latest.path == tmp_path / "2"
        assert latest.metrics == {"l": 2}
        assert (
            latest.commit_timestamp_nsecs
            == json.loads((tmp_path / "2" / "_CHECKPOINT_METADATA").read_text())[
                "commit_timestamp_nsecs"
            ]
        )
        assert latest.commit_timestamp.year >= 2024
        assert ckptr.load_checkpointables() == {"extra": {"step": 2}}
        assert ckptr.load_checkpointables(1) == {"extra": {"step": 1}}
        assert ckptr.load_checkpointables(ckptr.steps()[0]) == {"extra": {"step": 0}}
        assert ckptr.load_checkpointables_async(0).result() == {"extra": {"step": 0}}
        assert ckptr.checkpointables_metadata(1).metrics == {"l": 1}
    # Each step is an ordinary checkpoint for the free functions.
    assert cp.is_checkpoint(tmp_path / "1")
    assert cp.load_checkpointables(tmp_path / "1") == {"extra": {"step": 1}}
    assert sorted(os.listdir(tmp_path)) == ["0", "1", "2"]
    # A new Checkpointer finds them, with their metrics.
    again = cp.training.Checkpointer(tmp_path)
    assert [(s.step, s.metrics) for s in again.steps()] == [
        (0, {"l": 0}),
        (1, {"l": 1}),
        (2, {"l": 2}),
    ]


def test_policy_skips_and_force_overrides(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=D.EveryNStepsPolicy(10))
    assert ckptr.should_save(0) and not ckptr.should_save(5) and ckptr.should_save(np.int64(20))
    skipped = ckptr.save_checkpointables_async(5, {"extra": {}})
    assert skipped.done() and skipped.result() is False
    assert not ckptr.save_checkpointables(7, {"extra": {}})
    assert not (tmp_path / "5").exists() and not (tmp_path / "7").exists()
    assert ckptr.save_checkpointables(7, {"extra": {"v": 7}}, force=True)
    assert [s.step for s in ckptr.steps()] == [7]
    ckptr.close()


def test_default_policy_saves_first_then_continuously(tmp_path) -> None:
    gate = threading.Event()
    ckptr = cp.training.Checkpointer(tmp_path)
    first = ckptr.save_checkpointables_async(0, {"v": Value(0, save_gate=gate)})
    # The first save is in flight: continuous checkpointing skips instead of waiting.
    skipped = ckptr.save_checkpointables_async(1, {"v": Value(1)})
    assert skipped.done() and skipped.result() is False
    assert not ckptr.should_save(2)
    gate.set()
    assert first.result() is True
    assert ckptr.should_save(2)
    assert ckptr.save_checkpointables(2, {"v": Value(2)})
    assert [s.step for s in ckptr.steps()] == [0, 2]
    ckptr.close()


def test_existing_step_needs_overwrite(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    ckptr.save_checkpointables(3, {"extra": {"v": 1}}, metrics={"m": 1})
    with pytest.raises(cp.training.errors.StepAlreadyExistsError, match="Step 3 already exists"):
        ckptr.save_checkpointables(3, {"extra": {"v": 2}})
    with pytest.raises(FileExistsError):
        ckptr.save_checkpointables_async(3, {"extra": {"v": 2}})
    assert ckptr.save_checkpointables(3, {"extra": {"v": 2}}, overwrite=True, metrics={"m": 2})
    assert ckptr.load_checkpointables(3) == {"extra": {"v": 2}}
    assert ckptr.latest_step().metrics == {"m": 2}
    assert sorted(os.listdir(tmp_path)) == ["3"]
    # A directory that is not a checkpoint also blocks the step, with a message saying so.
    (tmp_path / "4").mkdir()
    with pytest.raises(cp.training.errors.StepAlreadyExistsError, match="not a committed"):
        ckptr.save_checkpointables(4, {"extra": {}})
    assert ckptr.save_checkpointables(4, {"extra": {"v": 4}}, overwrite=True)
    assert ckptr.load_checkpointables(4) == {"extra": {"v": 4}}
    ckptr.close()


def test_step_not_found(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path / "run", save_decision_policy=EVERY_STEP)
    with pytest.raises(cp.training.errors.StepNotFoundError, match="no committed checkpoint yet"):
        ckptr.load_checkpointables()
    for step in (10, 20, 30):
        ckptr.save_checkpointables(step, {"extra": {}})
    with pytest.raises(cp.training.errors.StepNotFoundError, match=r"step 15 .*10, 20, 30"):
        ckptr.load_checkpointables(15)
    with pytest.raises(FileNotFoundError):
        ckptr.pytree_metadata(15)
    assert isinstance(cp.training.errors.StepNotFoundError("x"), cp.errors.CheckpointError)


def test_bad_steps(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    with pytest.raises(ValueError, match=">= 0"):
        ckptr.save_checkpointables(-1, {"extra": {}})
    with pytest.raises(TypeError, match="bool"):
        ckptr.should_save(True)
    with pytest.raises(TypeError, match="float"):
        ckptr.save_checkpointables(1.5, {"extra": {}})
    with pytest.raises(ValueError, match="empty dict"):
        ckptr.save_checkpointables(1, {})
    with pytest.raises(ValueError, match="reserved"):
        ckptr.save_checkpointables(1, {"metrics": {}})
    assert os.listdir(tmp_path) == []


def test_a_pytree_where_a_step_or_a_dict_belongs_says_which_call_to_make(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path / "run", save_decision_policy=EVERY_STEP)
    ckptr.save_pytree(1, {"w": np.arange(3.0)})
    abstract = {"w": np.zeros(3), "big": list(range(1000))}
    with pytest.raises(cp.errors.InvalidArgumentTypeError) as step_forgotten:
        ckptr.load_pytree(abstract)  # type: ignore[arg-type]
    message = str(step_forgotten.value)
    assert "got dict {'big': [0, 1, 2, 3, 4, 5, ...], 'w': array" in message  # Not all of it.
    assert len(message) < 600
    assert "the step, a Checkpointer method's first argument" in message
    assert "(None: the latest) and the abstract tree second: ckptr.load_pytree(step, " in message
    assert "or ckptr.load_pytree(abstract_pytree=abstract_pytree)" in message
    with pytest.raises(cp.errors.InvalidArgumentError) as not_a_dict:
        ckptr.save_checkpointables(2, np.ones(3), force=True)  # type: ignore[arg-type]
    assert "on a Checkpointer ckptr.save_pytree(step, pytree)" in str(not_a_dict.value)
    with pytest.raises(cp.errors.InvalidArgumentError) as not_a_dict:
        ckptr.load_checkpointables(1, np.ones(3))  # type: ignore[arg-type]
    assert "on a Checkpointer ckptr.load_pytree(step, abstract_pytree)" in str(not_a_dict.value)
    ckptr.close()


def test_metrics_are_converted_or_rejected(tmp_path) -> None:
    import jax.numpy as jnp

    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    metrics = {"loss": jnp.float32(0.25), "n": np.int64(3), "ok": np.bool_(True), "d": {"x": [1.5]}}
    ckptr.save_checkpointables(0, {"extra": {}}, metrics=metrics)
    stored = json.loads((tmp_path / "0" / "_CHECKPOINT_METADATA").read_text())["metrics"]
    assert stored == {"loss": 0.25, "n": 3, "ok": True, "d": {"x": [1.5]}}
    assert type(ckptr.latest_step().metrics["loss"]) is float
    with pytest.raises(ValueError, match=r"metrics\['acc'\] is a ndarray"):
        ckptr.save_checkpointables(1, {"extra": {}}, metrics={"acc": np.zeros(3)})
    with pytest.raises(ValueError, match="must be a dict"):
        ckptr.save_checkpointables(1, {"extra": {}}, metrics=[1.0])
    assert sorted(os.listdir(tmp_path)) == ["0"]


def test_only_committed_steps_are_listed(tmp_path) -> None:
    gate = threading.Event()
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    ckptr.save_checkpointables(0, {"v": Value(0)})
    value = Value(1, save_gate=gate)
    response = ckptr.save_checkpointables_async(1, {"v": value})
    assert value.writing.wait(TIMEOUT)
    assert ckptr.is_saving_in_progress() and not response.done()
    assert [s.step for s in ckptr.steps()] == [0]
    assert ckptr.latest_step().step == 0
    assert load_value(ckptr) == 0  # "Latest" means latest committed.
    assert not (tmp_path / "1").exists()
    gate.set()
    assert response.result() is True
    assert [s.step for s in ckptr.steps()] == [0, 1]
    ckptr.close()


def test_loading_a_step_in_flight_waits_for_its_commit(tmp_path) -> None:
    gate = threading.Event()
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    value = Value(5, save_gate=gate)
    ckptr.save_checkpointables_async(5, {"v": value})
    assert value.writing.wait(TIMEOUT)
    loaded = []
    reader = threading.Thread(target=lambda: loaded.append(load_value(ckptr, 5)))
    reader.start()
    reader.join(0.2)
    assert not loaded
    gate.set()
    reader.join(TIMEOUT)
    assert loaded == [5]
    ckptr.close()


def test_at_most_one_save_in_flight(tmp_path) -> None:
    gate, log = threading.Event(), []
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    first = ckptr.save_checkpointables_async(1, {"v": Value(1, save_gate=gate, log=log)})
    second: list = []
    saver = threading.Thread(
        target=lambda: second.append(ckptr.save_checkpointables_async(2, {"v": Value(2, log=log)}))
    )
    saver.start()
    saver.join(0.3)
    # The second save has not even started its blocking phase.
    assert ("save-start", 2) not in log and not second
    gate.set()
    saver.join(TIMEOUT)
    assert first.result() and second[0].result()
    assert log == [("save-start", 1), ("save-end", 1), ("save-start", 2), ("save-end", 2)]
    ckptr.close()


def test_background_failure_surfaces_once_on_result(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    response = ckptr.save_checkpointables_async(1, {"v": Value(1, fail=OSError("disk on fire"))})
    with pytest.raises(OSError, match="disk on fire"):
        response.result()
    # Seen through result(): the next save does not raise it again.
    assert ckptr.save_checkpointables(2, {"v": Value(2)})
    assert [s.step for s in ckptr.steps()] == [2]
    assert sorted(os.listdir(tmp_path)) == ["2"]  # Nothing that looks like step 1.
    ckptr.close()


@pytest.mark.parametrize("surface", ["save", "wait", "close", "exit"])
def test_unobserved_background_failure_surfaces_later(tmp_path, surface) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    ckptr.save_checkpointables_async(1, {"v": Value(1, fail=OSError("disk on fire"))})
    with pytest.raises(OSError, match="disk on fire"):
        if surface == "save":
            ckptr.save_checkpointables_async(2, {"v": Value(2)})
        elif surface == "wait":
            ckptr.wait()
        elif surface == "close":
            ckptr.close()
        else:
            with ckptr:
                pass
    assert ckptr.latest_step() is None
    assert not (tmp_path / "1").exists() and not (tmp_path / "2").exists()
    if surface == "save":
        # Raised once: the run can go on.
        assert ckptr.save_checkpointables(2, {"v": Value(2)})
        ckptr.close()


def test_error_in_block_keeps_priority_over_close_error(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    with pytest.raises(KeyError) as raised, ckptr:
        ckptr.save_checkpointables_async(1, {"v": Value(1, fail=OSError("disk on fire"))})
        raise KeyError("training crashed")
    assert any("disk on fire" in note for note in raised.value.__notes__)


def test_exit_waits_for_the_save_and_closed_checkpointer_refuses_saves(tmp_path) -> None:
    gate = threading.Event()
    value = Value(1, save_gate=gate)
    with cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP) as ckptr:
        response = ckptr.save_checkpointables_async(1, {"v": value})
        assert value.writing.wait(TIMEOUT)
        threading.Timer(0.1, gate.set).start()
    assert response.done() and response.result()
    assert cp.is_checkpoint(tmp_path / "1")
    with pytest.raises(cp.training.errors.CheckpointerClosedError, match="closed") as raised:
        ckptr.save_checkpointables(2, {"extra": {}})
    # A library error that keeps the builtin meaning.
    assert isinstance(raised.value, cp.errors.CheckpointError)
    assert isinstance(raised.value, RuntimeError)
    with pytest.raises(cp.training.errors.CheckpointerClosedError):
        ckptr.save_pytree_async(3, {"a": np.arange(3)}, force=True)
    assert load_value(ckptr, 1) == 1  # Reading still works.


def test_reload_sees_steps_written_elsewhere(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    ckptr.save_checkpointables(0, {"extra": {"v": 0}})
    other = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    other.save_checkpointables(1, {"extra": {"v": 1}})
    cp.save_checkpointables(tmp_path / "2", {"extra": {"v": 2}})
    assert [s.step for s in ckptr.steps()] == [0]
    # A step on disk loads even before reload() lists it.
    assert ckptr.load_checkpointables(2) == {"extra": {"v": 2}}
    ckptr.reload()
    assert [s.step for s in ckptr.steps()] == [0, 1, 2]


def test_listing_ignores_what_is_not_a_committed_step(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "4", {"extra": {}})
    cp.save_checkpointables(tmp_path / "007", {"extra": {}})  # Not a name we write.
    cp.save_checkpointables(tmp_path / "best", {"extra": {}})
    (tmp_path / "5").mkdir()  # No _CHECKPOINT_METADATA.
    (tmp_path / "6").write_text("a file")
    (tmp_path / "7.orbax-checkpoint-tmp-123").mkdir()
    damaged = tmp_path / "8"
    cp.save_checkpointables(damaged, {"extra": {}})
    (damaged / "_CHECKPOINT_METADATA").write_text("{not json")
    ckptr = cp.training.Checkpointer(tmp_path)
    assert [s.step for s in ckptr.steps()] == [4]


def test_step_name_format(tmp_path) -> None:
    fmt = cp.training.standard_name_format(step_prefix="step", step_format_fixed_length=6)
    ckptr = cp.training.Checkpointer(
        tmp_path, save_decision_policy=EVERY_STEP, step_name_format=fmt
    )
    ckptr.save_checkpointables(42, {"extra": {"v": 42}})
    cp.save_checkpointables(tmp_path / "43", {"extra": {}})  # Another format: not ours.
    assert sorted(os.listdir(tmp_path)) == ["43", "step_000042"]
    assert [s.step for s in cp.training.Checkpointer(tmp_path, step_name_format=fmt).steps()] == [
        42
    ]
    assert ckptr.load_checkpointables(42) == {"extra": {"v": 42}}

    class Hex:  # Any object with the two methods will do.
        def build_name(self, step):
            return f"x{step:x}"

        def parse_step(self, name):
            return int(name[1:], 16) if name.startswith("x") else None

    custom = cp.training.Checkpointer(tmp_path / "hex", step_name_format=Hex())
    custom.save_checkpointables(255, {"extra": {}}, force=True)
    assert os.listdir(tmp_path / "hex") == ["xff"]
    with pytest.raises(TypeError, match="step_name_format"):
        cp.training.Checkpointer(tmp_path, step_name_format="{step}")


def test_root_custom_metadata_takes_numpy_scalars(tmp_path) -> None:
    # As a step's custom_metadata does: a config of NumPy numbers is stored as numbers.
    ckptr = cp.training.Checkpointer(tmp_path, custom_metadata={"lr": np.float32(0.5)})
    ckptr.save_pytree(0, {"x": np.arange(2)}, force=True)
    ckptr.close()
    assert cp.training.Checkpointer(tmp_path).metadata().custom_metadata == {"lr": 0.5}


def test_root_custom_metadata(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, custom_metadata={"experiment": "e1", "lr": 0.1})
    assert ckptr.metadata().custom_metadata == {"experiment": "e1", "lr": 0.1}
    assert ckptr.metadata().directory == tmp_path
    # Orbax's place and format, so either library reads the other's.
    assert json.loads((tmp_path / "metadata" / "_ROOT_METADATA").read_text()) == {
        "internal_metadata": {},
        "custom_metadata": {"experiment": "e1", "lr": 0.1},
    }
    # A resumed run keeps what the run started with.
    resumed = cp.training.Checkpointer(tmp_path, custom_metadata={"experiment": "other"})
    assert resumed.root_metadata().custom_metadata == {"experiment": "e1", "lr": 0.1}
    assert cp.training.Checkpointer(tmp_path / "new").metadata().custom_metadata == {}
    with pytest.raises(ValueError, match="JSON-serializable"):
        cp.training.Checkpointer(tmp_path / "bad", custom_metadata={"f": object()})
    (tmp_path / "metadata" / "_ROOT_METADATA").write_text("[1]")
    with pytest.raises(cp.errors.MetadataError, match="_ROOT_METADATA"):
        resumed.metadata()


def test_step_custom_metadata(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    ckptr.save_checkpointables(1, {"extra": {}}, custom_metadata={"note": "warmup done"})
    assert ckptr.checkpointables_metadata(1).custom_metadata == {"note": "warmup done"}
    assert cp.checkpointables_metadata(tmp_path / "1").custom_metadata == {"note": "warmup done"}


def test_bad_constructor_arguments(tmp_path) -> None:
    with pytest.raises(TypeError, match="save_decision_policy"):
        cp.training.Checkpointer(tmp_path, save_decision_policy=10)
    with pytest.raises(TypeError, match="preservation_policy"):
        cp.training.Checkpointer(tmp_path, preservation_policy=3)
    with pytest.raises(TypeError, match="cp.Context"):
        cp.training.Checkpointer(tmp_path, context={"async_options": None})
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        cp.training.Checkpointer(tmp_path / "file")
    cp.save_checkpointables(tmp_path / "run" / "10", {"extra": {}})
    with pytest.raises(ValueError, match=r"itself a checkpoint.*probably .*run"):
        cp.training.Checkpointer(tmp_path / "run" / "10")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_contexts_layer_call_over_checkpointer_over_global(tmp_path) -> None:
    old_umask = os.umask(0o022)
    try:
        mine = cp.Context(file_options=cp.options.FileOptions(path_permission_mode=0o750))
        ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP, context=mine)
        ckptr.save_checkpointables(0, {"extra": {}})
        assert _mode(tmp_path / "0") == 0o750
        # A context entered around the call wins for the options it sets ...
        around = cp.Context(file_options=cp.options.FileOptions(path_permission_mode=0o700))
        with around:
            ckptr.save_checkpointables(1, {"extra": {}})
        assert _mode(tmp_path / "1") == 0o700
        # ... and only for those: the Checkpointer's own options still apply.
        with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=30)):
            ckptr.save_checkpointables(2, {"extra": {}})
        assert _mode(tmp_path / "2") == 0o750
        # A Checkpointer without a context follows the context it is called in.
        plain = cp.training.Checkpointer(tmp_path / "plain", save_decision_policy=EVERY_STEP)
        with around:
            plain.save_checkpointables(0, {"extra": {}})
        assert _mode(tmp_path / "plain" / "0") == 0o700
    finally:
        os.umask(old_umask)


def test_user_save_policy_sees_the_committed_steps(tmp_path) -> None:
    seen = []

    class Recorder:
        def should_save(self, step, previous_steps, *, context):
            seen.append(
                (step.step, [p.step for p in previous_steps], context.is_saving_in_progress)
            )
            return True

    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=Recorder())
    ckptr.save_checkpointables(3, {"extra": {}})
    ckptr.save_checkpointables(1, {"extra": {}})
    ckptr.save_checkpointables(8, {"extra": {}})
    assert seen == [(3, [], False), (1, [3], False), (8, [1, 3], False)]


def test_aliases_and_repr(tmp_path) -> None:
    ckptr = cp.training.Checkpointer(tmp_path, save_decision_policy=EVERY_STEP)
    ckptr.save_checkpointables(0, {"extra": {}})
    assert cp.training.Checkpointer.save is cp.training.Checkpointer.save_pytree
    assert cp.training.Checkpointer.load_async is cp.training.Checkpointer.load_pytree_async
    assert "latest=0" in repr(ckptr)
