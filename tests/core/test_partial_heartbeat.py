"""A ``cp.partial`` session beats a heartbeat while this process has work in flight in it.

A child process holds a session open past a small ``AsyncOptions.timeout_secs`` (a staged
save waiting to be promoted, or a ``finalize`` merging); this process then runs what
removes leftovers (a partial save's cleanup, ``finalize``, a Checkpointer's cleanup, a
save to the path), which must leave it alone; once the child is killed, what it left is
cleaned.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import types
import weakref

import checkpointables as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables import partial
from etils import epath

from ..integration.object_store.conftest import bucket, s3, s3_server  # noqa: F401
from ..python_subprocess import wait_for_file

_TIMEOUT = 0.4  # Seconds: a session beats every tenth of a second.
_A, _B, _C = {"a": np.arange(3.0)}, {"b": np.ones(2)}, {"c": np.zeros(4)}

# argv: the path, a file it makes once held, the timeout, what it holds ("promote": its
# second save before its promotion into the session; "merge": its finalize while it merges).
_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import checkpointables as cp
    from checkpointables import partial

    path, ready, timeout, point = sys.argv[1:5]
    name = {"promote": "_promote", "merge": "_merge_pytrees"}[point]
    real, calls = getattr(partial, name), []

    def held(*args):
        calls.append(1)
        if len(calls) == (2 if point == "promote" else 1):
            open(ready, "w").close()
            time.sleep(600)
        return real(*args)

    setattr(partial, name, held)
    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=float(timeout))):
        cp.partial.save(path, {"a": np.arange(3.0)})
        if point == "promote":
            cp.partial.save(path, {"b": np.ones(2)})
        else:
            cp.partial.finalize(path)
    """
)


def _held_child(path, ready, point: str) -> subprocess.Popen:
    """Starts the child; returns once it is held at ``point``, past the timeout."""
    args = [sys.executable, "-c", _CHILD, str(path), str(ready), str(_TIMEOUT), point]
    proc = subprocess.Popen(args)
    try:
        wait_for_file(proc, ready)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    time.sleep(2.5 * _TIMEOUT)  # Its entries are older than the timeout; it is alive.
    return proc


def _short_timeout() -> cp.Context:
    return cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=_TIMEOUT))


def _killed(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(30)


def test_a_live_sessions_staged_save_outlives_the_timeout_and_a_dead_ones_is_removed(
    tmp_path,
) -> None:
    path = tmp_path / "ckpt"
    session = cp.partial.session_path(path)
    child = _held_child(path, tmp_path / "ready", "promote")
    try:
        held = sorted(n for n in os.listdir(session) if n.startswith("staged-"))
        assert len(held) == 2  # The staged save and its `.pending` twin.
        with _short_timeout():
            cp.partial.save(path, _C)  # Removes the entries of dead writers only.
            assert set(held) <= set(os.listdir(session))
            with pytest.raises(cp.errors.CheckpointExistsError, match="still writing"):
                cp.partial.finalize(path)
        assert set(held) <= set(os.listdir(session)) and not path.exists()
    finally:
        _killed(child)
    with _short_timeout():
        cp.partial.finalize(path)  # Its process is gone: what it left is removed.
    assert sorted(cp.load_pytree(path)) == ["a", "c"]


def test_a_live_finalize_outlives_the_timeout_and_a_dead_ones_is_resumed(tmp_path) -> None:
    path = tmp_path / "ckpt"
    session = cp.partial.session_path(path)
    child = _held_child(path, tmp_path / "ready", "merge")
    try:
        (entry,) = [n for n in os.listdir(session) if n.startswith("finalize.")]
        with _short_timeout():
            with pytest.raises(cp.errors.CheckpointExistsError, match="another process is fin"):
                cp.partial.finalize(path)  # It would remove what the merge builds.
            cp.partial.save(path, _C)
        assert entry in os.listdir(session) and not path.exists()
    finally:
        _killed(child)
    with _short_timeout():
        cp.partial.finalize(path)
    assert sorted(cp.load_pytree(path)) == ["a", "c"]
    assert not [n for n in os.listdir(path) if n.startswith("finalize.")]


def test_a_live_finalize_on_an_object_store_outlives_the_timeout(tmp_path, bucket) -> None:  # noqa: F811
    root = epath.Path(f"{bucket}/run")
    path = root / "1"
    child = _held_child(path, tmp_path / "ready", "merge")
    try:
        with _short_timeout():
            with pytest.raises(cp.errors.CheckpointExistsError, match="may still be running"):
                cp.save_pytree(path, _C)
            with pytest.raises(cp.errors.CheckpointExistsError, match="another process is fin"):
                cp.partial.finalize(path)
            with cp.training.Checkpointer(root):
                pass  # Its cleanup of unfinished steps runs, and ends before it closes.
        assert cp.storage.is_file(f"{path}/.checkpointables-save")
        assert cp.storage.exists(f"{path}/pytree/partial-000001/commit_success.txt")
    finally:
        _killed(child)
    with _short_timeout(), cp.training.Checkpointer(root):
        pass  # The killed finalize is a leftover now.
    assert not cp.storage.list_files(path)


def _arrays_reachable(root: object) -> list[object]:
    """The arrays that ``root`` refers to, directly or not (a function: through its closure
    and defaults, not its module's globals)."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray | jax.Array):
            found.append(obj)
        elif isinstance(obj, types.FunctionType):
            cells = [c for c in obj.__closure__ or () if c.cell_contents is not None]
            stack.extend([*(c.cell_contents for c in cells), obj.__defaults__])
        else:
            stack.extend(gc.get_referents(obj))
    return found


def test_a_partial_sessions_heartbeat_refers_to_no_array(tmp_path) -> None:
    path = tmp_path / "p"
    state = partial._state(cp.partial.session_path(path))
    refs, responses, walked = [], [], 0
    gc.collect()
    gc.disable()
    try:
        with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=0.04)):
            for i in range(3):  # Each waits for the one before: their claims are held.
                values = {f"leaf_{i}": np.ones(1 << 16, np.float32), "j": jnp.ones(4) + i}
                refs += [weakref.ref(v) for v in values.values()]
                responses.append(cp.partial.save_async(path, values))
                del values
                heartbeat = state.claims._heartbeat  # Beats every hundredth of a second.
                if heartbeat is not None:  # Still in flight (as it nearly always is).
                    assert _arrays_reachable(heartbeat._beat) == []
                    walked += 1
            for response in responses:
                response.result()
            assert walked and [ref() for ref in refs] == [None] * 6
            assert not state.claims._held and state.claims._heartbeat is None
            cp.partial.finalize(path)
    finally:
        gc.enable()


def test_a_finalize_that_fails_on_an_object_store_leaves_no_record(bucket) -> None:  # noqa: F811
    # Its heartbeat stopped: left there, its record would make other processes' finalizes
    # refuse (one is running, they would say) until it grew older than the timeout.
    path = f"{bucket}/ckpt"
    cp.partial.save(path, _A)

    class FailsToMerge(cp.handlers.get("pytree")):  # type: ignore[misc]
        async def merge_partial(self, sources, target) -> None:
            raise OSError("disk on fire")

    cp.handlers.register_handler(FailsToMerge, name="pytree", priority=0)
    try:
        with pytest.raises(OSError, match="disk on fire"):
            cp.partial.finalize(path)
    finally:
        cp.handlers.unregister_handler(FailsToMerge)
    assert not cp.storage.exists(f"{path}/.checkpointables-save")
    cp.partial.finalize(path)
    assert sorted(cp.load_pytree(path)) == ["a"]
