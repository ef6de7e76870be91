"""Reading steps: which committed step a load means, and read leases (steps being read in
this process, so garbage collection never deletes one mid-load).

Shared by every Checkpointer of the process (a trainer and an evaluator may
watch the same root). A load registers its step directory before it checks
that the directory exists; a deletion checks for readers and renames the
directory away under the same lock. So either the load sees the step gone
(and raises ``StepNotFoundError``) or the deletion sees the reader and waits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from etils import epath

from checkpointables import layout, storage
from checkpointables._asyncio import AsyncResponse, start_background
from checkpointables.context import Context
from checkpointables.training import _arguments, _listing, step_name_formats
from checkpointables.training.errors import StepNotFoundError
from checkpointables.training.step_info import StepInfo

T = TypeVar("T")

StepLike = int | StepInfo | None

_condition = threading.Condition()
_readers: dict[str, int] = {}


def acquire(path: epath.Path) -> str:
    """Registers a reader of ``path``; returns the key to ``release``."""
    key = storage.key(path)
    with _condition:
        _readers[key] = _readers.get(key, 0) + 1
    return key


def release(key: str) -> None:
    """Ends a read registered by ``acquire``."""
    with _condition:
        count = _readers.get(key, 0) - 1
        if count > 0:
            _readers[key] = count
        else:
            _readers.pop(key, None)
        _condition.notify_all()


def run_if_unread(path: epath.Path, action: Callable[[], T]) -> tuple[bool, T | None]:
    """Runs ``action`` (e.g. a rename) unless ``path`` is being read; atomic with ``acquire``.

    Returns ``(True, result)`` if it ran, ``(False, None)`` if a reader exists.
    """
    with _condition:
        if storage.key(path) in _readers:
            return False, None
        return True, action()


def wait_until_unread(path: epath.Path, timeout: float | None) -> None:
    """Blocks until no load of ``path`` is in progress.

    Raises:
      TimeoutError: loads are still running after ``timeout`` seconds.
    """
    key = storage.key(path)
    with _condition:
        if not _condition.wait_for(lambda: key not in _readers, timeout):
            raise TimeoutError(
                f"Loads of {path} are still running after {timeout} s; the step cannot be "
                f"overwritten while it is being read. Wait for them, or raise the timeout "
                f"(cp.options.AsyncOptions(timeout_secs=...))."
            )


def _summary(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}"


class Leases:
    """The reads of one Checkpointer: each finds its committed step, then holds a lease on it
    until it ends (deletions deferred for the read may then run: ``on_release``)."""

    def __init__(
        self,
        root: epath.Path,
        steps: _listing.StepIndex,
        path_of: Callable[[int], epath.Path],
        wait_for_save: Callable[[int], None],
        on_release: Callable[[], None],
    ) -> None:
        self._root = root
        self._steps = steps
        self._path_of = path_of
        self._wait_for_save = wait_for_save
        self._on_release = on_release

    def resolve(self, step: StepLike, context: Context) -> StepInfo:
        """The committed step ``step`` names (``None``: the latest), waiting for its save if
        it is in flight."""
        if step is None:
            latest = self._steps.latest()
            if latest is None:
                raise StepNotFoundError(self._no_step_message(context))
            return latest
        number = _arguments.as_step(step.step if isinstance(step, StepInfo) else step)
        if self._steps.get(number) is None:
            self._wait_for_save(number)
        info = self._steps.get(number)
        if info is not None:
            return info
        path = self._path_of(number)
        with context:
            if layout.is_checkpoint(path):  # Committed by another process since we listed.
                return _listing.read_step(number, path)
        raise StepNotFoundError(
            f"No committed checkpoint for step {number} in {self._root} (looked for {path}). "
            f"Committed steps: {_summary([s.step for s in self._steps.sorted()])}."
        )

    def _no_step_message(self, context: Context) -> str:
        text = f"{self._root} has no committed checkpoint yet, so there is no latest step to load."
        with context:
            unmatched = _listing.committed_unmatched(self._root, self._writes)
        if unmatched:
            return f"{text} {_listing.unmatched_note(unmatched)}"
        return f"{text} Check the path, or call reload() if another process is writing it."

    def _writes(self, name: str) -> bool:
        """Whether this Checkpointer's step name format names a step ``name`` (a step
        committed since the listing), judged from the name it gives the step ``name`` holds."""
        guess = step_name_formats.guess_standard_format([name])
        step = guess.parse_step(name) if guess is not None else None
        return step is not None and self._path_of(step).name == name

    def _acquire(self, step: StepLike, context: Context) -> tuple[StepInfo, str]:
        info = self.resolve(step, context)
        key = acquire(info.path)
        with context:
            gone = not storage.exists(info.path)
        if gone:
            self._release(key)
            self._steps.forget(info)  # Else steps() and latest_step() would keep naming it.
            raise StepNotFoundError(
                f"Step {info.step} was deleted from {self._root} (by this run's preservation "
                f"policy or another process); it is no longer listed. Call reload() to list "
                f"the steps saved since (load without a step does so itself), or steps() for "
                f"the steps known."
            )
        return info, key

    def _release(self, key: str) -> None:
        release(key)
        self._on_release()

    @contextlib.contextmanager
    def holding(self, step: StepLike, context: Context) -> Iterator[StepInfo]:
        """The step ``step`` names, leased during the block, which runs under ``context``."""
        info, key = self._acquire(step, context)
        try:
            with context:
                yield info
        finally:
            self._release(key)

    def load_async(
        self, step: StepLike, context: Context, start: Callable[[epath.Path], AsyncResponse[T]]
    ) -> AsyncResponse[T]:
        """``start(path)`` for the step ``step`` names; it stays leased until the load ends."""
        info, key = self._acquire(step, context)
        try:
            with context:
                inner = start(info.path)
        except BaseException:
            self._release(key)
            raise

        def finish() -> T:
            try:
                return inner.result()
            finally:
                self._release(key)

        description = f"load of step {info.step} from {self._root}"
        return start_background(finish, description, daemon=True)
