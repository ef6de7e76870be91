"""Context: nesting, inheritance, global defaults, and propagation into background work."""

from __future__ import annotations

import threading

import attrs
import checkpointables as cp
import pytest
from checkpointables.context import get_context


def test_nested_contexts_inherit_and_innermost_wins() -> None:
    outer_async = cp.options.AsyncOptions(timeout_secs=10)
    inner_file = cp.options.FileOptions(path_permission_mode=0o700)
    with cp.Context(async_options=outer_async):
        assert get_context().async_options.timeout_secs == 10
        with cp.Context(file_options=inner_file):
            assert get_context().async_options.timeout_secs == 10
            assert get_context().file_options.path_permission_mode == 0o700
            with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=5)):
                assert get_context().async_options.timeout_secs == 5
        assert get_context().file_options.path_permission_mode is None
    assert get_context().async_options == cp.options.AsyncOptions()


def test_configure_changes_defaults() -> None:
    before = get_context().async_options
    try:
        cp.configure(async_options=cp.options.AsyncOptions(timeout_secs=42))
        assert get_context().async_options.timeout_secs == 42
        with cp.Context(pytree_options=cp.options.PyTreeOptions(partial_load=True)):
            assert get_context().async_options.timeout_secs == 42
    finally:
        cp.configure(async_options=before)


def test_options_are_frozen_and_validated() -> None:
    options = cp.options.AsyncOptions(timeout_secs=3)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        options.timeout_secs = 4  # type: ignore[misc]
    with pytest.raises(ValueError):
        cp.options.AsyncOptions(timeout_secs=0)
    with pytest.raises(TypeError, match="Unknown option"):
        cp.Context(asynchronous=options)
    with pytest.raises(TypeError, match="must be a cp.options.AsyncOptions"):
        cp.Context(async_options=cp.options.FileOptions())
    assert cp.options.MultiprocessingOptions(active_processes=[0, 1]).active_processes == frozenset(
        {0, 1}
    )


def test_create_with_handlers_accepts_names_and_classes() -> None:
    json_handler = cp.handlers.get("json")
    options = cp.options.CheckpointablesOptions.create_with_handlers(a=json_handler, b="json")
    assert options.handlers == {"a": json_handler, "b": "json"}
    assert cp.handlers.get(options.handlers["b"]) is json_handler


def test_context_reaches_background_threads_of_a_save(tmp_path) -> None:
    seen: list[float] = []

    class Recorder:
        async def save(self, directory):
            async def write():
                seen.append(get_context().async_options.timeout_secs)
                seen.append(threading.current_thread() is not threading.main_thread())
                await directory.await_creation()

            return write()

        async def load(self, directory):
            return None

    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=7)):
        response = cp.save_checkpointables_async(tmp_path / "c", {"r": Recorder()})
    response.result()
    assert seen == [7, True]


def test_memory_options_budget_is_validated_and_reaches_the_context() -> None:
    budget = cp.options.MemoryOptions(host_bytes=64 << 20)
    assert cp.context.get_context().memory_options.host_bytes is None  # Default: unbounded.
    with cp.Context(memory_options=budget):
        assert cp.context.get_context().options(cp.options.MemoryOptions) is budget
    for bad in (0, -1, cp.options.MIN_HOST_BYTES - 1):
        with pytest.raises(cp.errors.InvalidArgumentError, match=str(cp.options.MIN_HOST_BYTES)):
            cp.options.MemoryOptions(host_bytes=bad)
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="int"):
        cp.options.MemoryOptions(host_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="MemoryOptions"):
        cp.Context(memory_options=64 << 20)
