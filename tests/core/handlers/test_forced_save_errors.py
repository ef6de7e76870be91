"""What a ``NoHandlerForObjectError`` of a forced handler tells the user to do."""

from __future__ import annotations

import checkpointables as cp
import pytest


def test_save_pytree_of_a_non_pytree_says_what_to_call_instead(tmp_path) -> None:
    with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
        cp.save_pytree(tmp_path / "c", object())
    message = str(raised.value)
    # The option's real name and what dropping it does; no cryptic "force no handler".
    assert "force no handler" not in message
    assert "cp.save_checkpointables({'pytree': obj})" in message
    assert "create_with_handlers(pytree=...)" in message
    assert not (tmp_path / "c").exists()


class IteratorStateHandler:
    """A third party's handler that says why it refuses an object (ExplainsUnhandleable)."""

    async def save(self, directory, checkpointable): ...
    async def load(self, directory, abstract_checkpointable=None): ...
    async def metadata(self, directory): ...

    def is_handleable(self, obj):
        return isinstance(obj, dict) and "position" in obj

    def is_abstract_handleable(self, abstract):
        return None

    def unhandleable_reason(self, obj):
        return None if self.is_handleable(obj) else "an iterator state has a position."


def test_a_forced_handler_of_a_plugin_refusing_gives_no_pytree_advice(tmp_path) -> None:
    cp.handlers.register_handler(IteratorStateHandler, name="iteratorstate")
    forced = cp.options.CheckpointablesOptions.create_with_handlers(d="iteratorstate")
    try:
        with (
            cp.Context(checkpointables_options=forced),
            pytest.raises(cp.errors.NoHandlerForObjectError) as raised,
        ):
            cp.save_checkpointables(tmp_path / "c", {"d": {"shard": 1}})
    finally:
        cp.handlers.unregister_handler(IteratorStateHandler)
    message = str(raised.value)
    assert "(an iterator state has a position.)" in message
    assert "create_with_handlers(d=...) forces for it" in message
    assert "drop d= from CheckpointablesOptions.create_with_handlers" in message
    assert "(the json handler saves it)" in message
    # Advice for pytrees and for cp.save_pytree, which the user did not call, is left out.
    assert "pytree" not in message.lower() and "Flax" not in message
    assert not (tmp_path / "c").exists()


def test_a_reason_ending_in_a_full_stop_gets_no_second_one(tmp_path) -> None:
    cp.handlers.register_handler(IteratorStateHandler, name="iteratorstate")
    try:
        with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
            cp.save_checkpointables(tmp_path / "c", {"d": object()})
    finally:
        cp.handlers.unregister_handler(IteratorStateHandler)
    assert "iteratorstate: an iterator state has a position. " in str(raised.value)
    assert "position.." not in str(raised.value)
