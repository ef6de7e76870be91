"""Saving and loading through the free functions, with the JSON and stateful handlers."""

from __future__ import annotations

import json
import os

import checkpointables as cp
import pytest

from ..metadata_edits import without_metadata_checksums
from .helpers import Boom, StatefulPoint


def test_json_and_stateful_round_trip(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.save_checkpointables(
        path,
        {"extra": {"foo": "bar", "n": [1, 2.5, None, True]}, "point": StatefulPoint(1, 2)},
        custom_metadata={"run": "exp-7"},
    )
    assert cp.is_checkpoint(path)
    assert sorted(os.listdir(path)) == [
        "_CHECKPOINT_METADATA",
        "_CHECKSUMS",
        "commit_success.txt",
        "extra",
        "orbax.checkpoint",
        "point",
    ]
    assert (path / "orbax.checkpoint").read_text() == ""
    assert json.loads((path / "extra" / "data.json").read_text())["foo"] == "bar"
    meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    assert meta["item_handlers"] == {
        # Orbax's JSON handler reads data.json as written: Orbax loads it too.
        "extra": "orbax.checkpoint.experimental.v1._src.handlers.json_handler.JsonHandler",
        "point": "checkpointables.builtin_plugin.StatefulCheckpointableHandler",
    }
    # Beside the user's: which distribution's plugin saved each item (read back out of it).
    recorded = meta["custom_metadata"].pop("checkpointables_handler_distributions")
    assert recorded["extra"]["distribution"] == "checkpointables-json"
    assert meta["custom_metadata"] == {"run": "exp-7"}
    assert cp.checkpointables_metadata(path).custom_metadata == {"run": "exp-7"}
    assert meta["commit_timestamp_nsecs"] >= meta["init_timestamp_nsecs"] > 0

    fresh = StatefulPoint(0, 0)
    loaded = cp.load_checkpointables(path, {"extra": None, "point": fresh})
    assert loaded["extra"] == {"foo": "bar", "n": [1, 2.5, None, True]}
    assert loaded["point"] is fresh and (fresh.x, fresh.y) == (1, 2)


def test_load_subset_and_everything(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.save_checkpointables(path, {"a": {"x": 1}, "b": [1, 2]})
    assert cp.load_checkpointables(path, {"b": None}) == {"b": [1, 2]}
    assert cp.load_checkpointables(path) == {"a": {"x": 1}, "b": [1, 2]}
    with pytest.raises(KeyError, match="no checkpointable named 'c'; it holds 'a', 'b'"):
        cp.load_checkpointables(path, {"c": None})


def test_a_missing_checkpointable_is_a_public_error_worded_alike_by_every_load(tmp_path) -> None:
    from checkpointables import _loading

    path = tmp_path / "ckpt"
    cp.save_checkpointables(path, {"pytree": {"w": [1, 2]}, "extra": {"k": 1}})
    assert _loading.CheckpointableNotFoundError is cp.errors.CheckpointableNotFoundError
    assert "CheckpointableNotFoundError" in cp.errors.__all__
    with pytest.raises(cp.errors.CheckpointableNotFoundError) as by_name:
        cp.load_pytree(path, checkpointable_name="pytre")
    with pytest.raises(cp.errors.CheckpointableNotFoundError) as by_key:
        cp.load_checkpointables(path, {"extras": None, "nope": None})
    assert isinstance(by_name.value, KeyError)  # As before it was public.
    assert isinstance(by_name.value, cp.errors.CheckpointError)
    assert str(by_name.value) == (
        f"Checkpoint {path} has no checkpointable named 'pytre' (did you mean 'pytree'?); "
        "it holds 'extra', 'pytree'. Pass checkpointable_name= one of those (or None to find "
        "the pytree)."
    )
    assert str(by_key.value) == (
        f"Checkpoint {path} has no checkpointables named 'extras' (did you mean 'extra'?), "
        "'nope'; it holds 'extra', 'pytree'. Pass abstract_checkpointables with keys among "
        "those (or None to load them all)."
    )


def test_stateful_object_needs_an_instance_to_load(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.save_checkpointables(path, {"point": StatefulPoint(1, 2)})
    with pytest.raises(ValueError, match="pass an instance"):
        cp.load_checkpointables(path)


def test_checkpointables_metadata(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.save_checkpointables(
        path, {"extra": {"k": 1}, "point": StatefulPoint(1, 2)}, custom_metadata={"a": 1}
    )
    meta = cp.checkpointables_metadata(path)
    assert meta.metadata == {"extra": {"k": 1}, "point": None}
    assert meta.custom_metadata == {"a": 1}
    assert meta.path == path
    assert meta.commit_timestamp is not None


def test_async_save_returns_response_and_load_waits_for_it(tmp_path) -> None:
    path = tmp_path / "ckpt"
    response = cp.save_checkpointables_async(path, {"extra": {"k": 1}})
    assert isinstance(response, cp.AsyncResponse)
    # A load of the same path waits for the save in flight.
    assert cp.load_checkpointables(path) == {"extra": {"k": 1}}
    assert response.done() and response.result() is None


def test_caller_may_mutate_objects_after_async_save_returns(tmp_path) -> None:
    data = {"values": [1, 2, 3]}
    point = StatefulPoint(1, 2)
    response = cp.save_checkpointables_async(tmp_path / "ckpt", {"data": data, "point": point})
    data["values"].append(4)
    point.x = 100
    response.result()
    fresh = StatefulPoint(0, 0)
    loaded = cp.load_checkpointables(tmp_path / "ckpt", {"data": None, "point": fresh})
    assert loaded["data"] == {"values": [1, 2, 3]} and fresh.x == 1


def test_overwrite_replaces_only_when_asked(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.save_checkpointables(path, {"extra": {"v": 1}})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        cp.save_checkpointables(path, {"extra": {"v": 2}})
    assert cp.load_checkpointables(path) == {"extra": {"v": 1}}
    cp.save_checkpointables(path, {"extra": {"v": 2}}, overwrite=True)
    assert cp.load_checkpointables(path) == {"extra": {"v": 2}}
    assert os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize(
    "name", ["", "a/b", "..", "x..y", "metrics", "AUTO", ".hidden", "_CHECKPOINT_METADATA"]
)
def test_bad_names_are_rejected_before_anything_is_written(tmp_path, name) -> None:
    with pytest.raises(ValueError):
        cp.save_checkpointables(tmp_path / "ckpt", {name: {"k": 1}})
    assert os.listdir(tmp_path) == []


def test_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="empty dict"):
        cp.save_checkpointables(tmp_path / "c", {})
    with pytest.raises(ValueError, match="dict of name"):
        cp.save_checkpointables(tmp_path / "c", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"custom_metadata\['x'\] is an object, which JSON"):
        cp.save_checkpointables(tmp_path / "c", {"a": {"k": 1}}, custom_metadata={"x": object()})
    assert os.listdir(tmp_path) == []


def test_one_pytree_given_for_a_dict_of_checkpointables_says_which_call_to_make(tmp_path) -> None:
    import numpy as np

    with pytest.raises(cp.errors.InvalidArgumentError) as saved:
        cp.save_checkpointables(tmp_path / "c", np.ones(3))  # type: ignore[arg-type]
    assert "use save_pytree: cp.save_pytree(path, pytree), or on a Checkpointer" in str(saved.value)
    cp.save_pytree(tmp_path / "c", {"w": np.ones(3)})
    with pytest.raises(cp.errors.InvalidArgumentError) as loaded:  # An array has no truth value.
        cp.load_checkpointables(tmp_path / "c", np.ones(3))  # type: ignore[arg-type]
    assert "use load_pytree: cp.load_pytree(path, abstract_pytree), or on a" in str(loaded.value)
    assert cp.load_checkpointables(tmp_path / "c", {}).keys() == {"pytree"}


def test_unhandleable_object_names_checkpointable_and_type(tmp_path) -> None:
    class Opaque:
        pass

    with pytest.raises(cp.errors.NoHandlerForObjectError) as info:
        cp.save_checkpointables(tmp_path / "c", {"thing": Opaque()})
    assert "'thing'" in str(info.value) and "Opaque" in str(info.value)
    assert "stateful" in str(info.value) and "json" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_load_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cp.load_checkpointables(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(cp.errors.NotACheckpointError, match="empty"):
        cp.load_checkpointables(tmp_path / "empty")
    assert not cp.is_checkpoint(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(cp.errors.NotACheckpointError, match="is a file"):
        cp.load_checkpointables(tmp_path / "file")


class _Note:
    """An object only ``_NoteHandler`` saves."""

    def __init__(self, text: str) -> None:
        self.text = text


class _NoteHandler:
    """A handler registered for one test, then gone: its checkpoints need a missing handler."""

    async def save(self, directory, checkpointable):
        async def write() -> None:
            path = await directory.await_creation()
            (path / "note.txt").write_text(checkpointable.text)

        return write()

    async def load(self, directory, abstract_checkpointable=None):
        async def read() -> _Note:
            return _Note((directory / "note.txt").read_text())

        return read()

    async def metadata(self, directory):
        return None

    def is_handleable(self, checkpointable) -> bool:
        return isinstance(checkpointable, _Note)

    def is_abstract_handleable(self, abstract_checkpointable):
        return None


def test_a_pytree_saved_by_a_missing_handler_names_it(tmp_path) -> None:
    cp.handlers.register_handler(_NoteHandler, typestr="some_plugin.NoteHandler")
    try:
        cp.save_checkpointables(tmp_path / "c", {"pytree": _Note("hi")})
    finally:
        cp.handlers.unregister_handler(_NoteHandler)
    with pytest.raises(cp.errors.MissingHandlerError, match="'some_plugin.NoteHandler'"):
        cp.load_pytree(tmp_path / "c")
    with pytest.raises(cp.errors.MissingHandlerError, match="'some_plugin.NoteHandler'"):
        cp.pytree_metadata(tmp_path / "c")
    with pytest.raises(cp.errors.MissingHandlerError, match="'some_plugin.NoteHandler'"):
        cp.load_pytree(tmp_path / "c", checkpointable_name="pytree")


def test_malformed_metadata_names_the_file(tmp_path) -> None:
    path = tmp_path / "ckpt"
    cp.save_checkpointables(path, {"extra": {"k": 1}})
    (path / "_CHECKPOINT_METADATA").write_text("{not json")
    # The checksum recorded at commit catches the edit first ...
    with pytest.raises(cp.errors.IntegrityError, match="_CHECKPOINT_METADATA"):
        cp.load_checkpointables(path)
    without_metadata_checksums(path)  # ... and without it, the parser names the file.
    with pytest.raises(cp.errors.MetadataError, match="_CHECKPOINT_METADATA"):
        cp.load_checkpointables(path)
    (path / "_CHECKPOINT_METADATA").write_text("[1, 2]")
    with pytest.raises(cp.errors.CheckpointError, match="_CHECKPOINT_METADATA"):
        cp.checkpointables_metadata(path)


def test_failed_background_save_leaves_nothing_and_keeps_old_checkpoint(
    tmp_path, misbehaving_handlers
) -> None:
    path = tmp_path / "ckpt"
    cp.save_checkpointables(path, {"extra": {"v": 1}})
    response = cp.save_checkpointables_async(path, {"bad": Boom()}, overwrite=True)
    with pytest.raises(OSError, match="disk on fire") as info:
        response.result()
    # The traceback reaches into the handler's background code.
    assert any(
        frame.name == "write"
        for frame in __import__("traceback").extract_tb(info.value.__traceback__)
    )
    assert os.listdir(tmp_path) == ["ckpt"]
    assert cp.load_checkpointables(path) == {"extra": {"v": 1}}
    new_path = tmp_path / "new"
    with pytest.raises(OSError):
        cp.save_checkpointables(new_path, {"bad": Boom()})
    assert not new_path.exists() and os.listdir(tmp_path) == ["ckpt"]


def test_unfinished_save_is_temporary_and_not_a_checkpoint(tmp_path, misbehaving_handlers) -> None:
    from .helpers import Gate

    gate = Gate()
    response = cp.save_checkpointables_async(tmp_path / "ckpt", {"gate": gate})
    assert gate.started.wait(30)
    (leftover,) = os.listdir(tmp_path)
    assert leftover.startswith("ckpt.checkpointables-tmp-")
    assert cp.layout.is_temporary_path(tmp_path / leftover)
    assert not cp.is_checkpoint(tmp_path / leftover)
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(cp.errors.NotACheckpointError, match="did not finish"):
        cp.load_checkpointables(tmp_path / leftover)
    gate.release.set()
    response.result(30)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_load_async_really_runs_in_background(tmp_path, misbehaving_handlers) -> None:
    from .helpers import Gate, GatedHandler

    saving_gate = Gate()
    saving_gate.release.set()
    cp.save_checkpointables(tmp_path / "ckpt", {"gate": saving_gate})
    GatedHandler.gate = Gate()
    response = cp.load_checkpointables_async(tmp_path / "ckpt")
    assert GatedHandler.gate.started.wait(30)
    assert not response.done()
    with pytest.raises(TimeoutError, match="still running"):
        response.result(timeout=0.01)
    GatedHandler.gate.release.set()
    assert response.result(30) == {"gate": "ok"}


def test_later_save_to_same_path_waits_for_earlier(tmp_path, misbehaving_handlers) -> None:
    from .helpers import Gate

    gate = Gate()
    first = cp.save_checkpointables_async(tmp_path / "ckpt", {"gate": gate})
    assert gate.started.wait(30)
    gate_release_later = __import__("threading").Timer(0.2, gate.release.set)
    gate_release_later.start()
    second = cp.save_checkpointables_async(tmp_path / "ckpt", {"extra": {"v": 2}}, overwrite=True)
    assert first.done()
    second.result(30)
    assert cp.load_checkpointables(tmp_path / "ckpt") == {"extra": {"v": 2}}


def test_forcing_a_handler_by_name_through_context(tmp_path) -> None:
    json_handler = cp.handlers.get("json")
    options = cp.options.CheckpointablesOptions.create_with_handlers(extra=json_handler)
    with cp.Context(checkpointables_options=options):
        cp.save_checkpointables(tmp_path / "c", {"extra": {"foo": "bar"}})
    assert (tmp_path / "c" / "extra" / "data.json").exists()
    with (
        cp.Context(checkpointables_options=options),
        pytest.raises(cp.errors.NoHandlerForObjectError),
    ):
        cp.save_checkpointables(tmp_path / "d", {"extra": StatefulPoint(1, 2)})


def test_path_permission_mode(tmp_path) -> None:
    with cp.Context(file_options=cp.options.FileOptions(path_permission_mode=0o750)):
        cp.save_checkpointables(tmp_path / "c", {"extra": {"k": 1}})
    assert (os.stat(tmp_path / "c" / "extra").st_mode & 0o777) == 0o750 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_overwrite_swaps_atomically_and_leaves_no_debris(tmp_path) -> None:
    path = tmp_path / "ckpt"
    for version in range(3):
        cp.save_checkpointables(path, {"extra": {"v": version}}, overwrite=True)
        assert cp.load_checkpointables(path) == {"extra": {"v": version}}
        assert os.listdir(tmp_path) == ["ckpt"]


def test_load_pytree_async_callbacks_fire(tmp_path) -> None:
    import numpy as np

    cp.save_pytree(tmp_path / "c", {"a": np.arange(3)})
    response = cp.load_pytree_async(tmp_path / "c")
    seen = []
    response.add_done_callback(lambda r: seen.append(r.result()["a"].tolist()))
    response.result()
    import time

    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [[0, 1, 2]]


@pytest.mark.parametrize(
    ("pytrees", "others", "expected"),
    [
        (["model"], [], "model"),  # The only pytree: loaded, as documented.
        (["model"], ["extra"], "model"),
        (["model", "pytree"], [], "pytree"),
        (["model", "state"], ["extra"], "state"),
        (["pytree", "state"], [], "pytree"),
        (["ema", "model"], [], None),  # Several, none preferred: which one is a guess.
        (["a", "b", "c"], ["pytree"], None),  # "pytree" is JSON here, not a pytree.
    ],
)
def test_load_pytree_without_a_name_follows_the_documented_rule(
    tmp_path, pytrees, others, expected
) -> None:
    import numpy as np

    items = {name: {"w": np.full(2, i, np.float32)} for i, name in enumerate(pytrees)}
    items |= {name: {"json": name} for name in others}
    cp.save_checkpointables(tmp_path / "c", items)
    if expected is None:
        with pytest.raises(cp.errors.InvalidArgumentError, match="several pytrees") as info:
            cp.load_pytree(tmp_path / "c")
        assert all(repr(n) in str(info.value) for n in pytrees)
        assert "checkpointable_name=" in str(info.value)
        with pytest.raises(cp.errors.InvalidArgumentError, match="several pytrees"):
            cp.pytree_metadata(tmp_path / "c")
        return
    loaded = cp.load_pytree(tmp_path / "c")
    assert loaded["w"][0] == pytrees.index(expected)
