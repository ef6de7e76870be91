"""One background thread per Checkpointer for garbage collection and cleanup, and the
background failures the Checkpointer has still to raise.

Saves never wait for the thread. Tasks run one at a time, in order; a task's
exception is handed to ``on_error`` (the Checkpointer raises it on the next
``save*``, ``wait()`` or ``close()``).
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable


class Worker:
    """Runs submitted callables on a lazily started daemon thread.

    The thread is a daemon so that a forgotten Checkpointer cannot keep the
    interpreter alive; deletions it cuts short are finished by the next
    Checkpointer's cleanup (they are renamed to temporary names first).
    """

    def __init__(self, name: str, on_error: Callable[[BaseException], None]) -> None:
        self._name = name
        self._on_error = on_error
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending: set[str] = set()

    def submit(self, task: Callable[[], None], *, key: str | None = None) -> None:
        """Queues ``task``; with a ``key``, skips it if a task with that key is still queued."""
        ctx = contextvars.copy_context()
        with self._lock:
            if key is not None:
                if key in self._pending:
                    return
                self._pending.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name[:60], daemon=True)
                self._thread.start()

        def run() -> None:
            if key is not None:
                with self._lock:
                    self._pending.discard(key)
            ctx.run(task)

        self._queue.put(run)

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                task()
            except BaseException as e:
                self._on_error(e)
            finally:
                self._queue.task_done()

    def wait_idle(self) -> None:
        """Blocks until every queued task has run."""
        self._queue.join()

    def stop(self) -> None:
        """Runs the queued tasks, then ends the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


class BackgroundErrors:
    """Failures of background work nobody has seen yet, raised by the next front door.

    A save's failure seen through its response (``result()``) is marked
    reported and not raised again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[BaseException] = []

    def record(self, error: BaseException) -> None:
        """Keeps ``error`` until it is raised or reported."""
        with self._lock:
            self._pending.append(error)

    def mark_reported(self, error: BaseException) -> None:
        """Forgets ``error``: its caller has seen it."""
        with self._lock:
            self._pending = [e for e in self._pending if e is not error]

    def raise_pending(self) -> None:
        """Raises the first pending error (the others as notes on it), if any."""
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            first = pending[0]
            for other in pending[1:]:
                first.add_note(f"Another background failure: {type(other).__name__}: {other}")
            raise first
