"""Coordination between the processes of a ``jax.distributed`` job.

Single-process runs need nothing from here. In a multi-process job every
process calls the same save; each writes its own part, only the primary host
writes shared files and commits, and the processes meet at barriers. Every
wait is bounded by ``AsyncOptions.timeout_secs`` and a timeout names the
processes that did not arrive and the phase they were in.

Barriers go through the key-value store of JAX's distributed runtime: each
process publishes ``ok`` or its error under a key, so one failed process fails
the others at once instead of leaving them waiting.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

from checkpointables import context as context_lib
from checkpointables import errors

__all__ = [
    "process_index",
    "process_count",
    "is_primary_host",
    "is_coordinated",
    "participating_processes",
    "sync_global_processes",
    "broadcast_from_primary",
    "next_operation_id",
    "ProcessFailedError",
    "BarrierTimeoutError",
]

_POLL_SECS = 0.02


class BarrierTimeoutError(errors.CheckpointError, TimeoutError):
    """Some processes did not reach a barrier in time; the message names them."""


class ProcessFailedError(errors.CheckpointError, RuntimeError):
    """Another process of the job failed during a collective phase."""


def process_index() -> int:
    """This process's index in a ``jax.distributed`` job (0 when alone)."""
    if "jax" not in sys.modules:
        return 0  # No jax.distributed job can exist without jax imported.
    import jax

    return int(jax.process_index())


def process_count() -> int:
    """The number of processes in the job (1 when alone)."""
    if "jax" not in sys.modules:
        return 1
    import jax

    return int(jax.process_count())


def is_primary_host(context: context_lib.Context | None = None) -> bool:
    """Whether this process writes shared files and commits.

    ``MultiprocessingOptions(primary_host=None)`` makes every process primary.
    """
    primary = context_lib.get_context(context).multiprocessing_options.primary_host
    return primary is None or primary == process_index()


def participating_processes(context: context_lib.Context | None = None) -> list[int]:
    """The process indices that take part in collective phases, sorted."""
    options = context_lib.get_context(context).multiprocessing_options
    if options.active_processes is not None:
        return sorted(options.active_processes)
    return list(range(process_count()))


def is_coordinated(context: context_lib.Context | None = None) -> bool:
    """Whether saves must coordinate with other processes.

    False when alone, and when every process is its own primary
    (``primary_host=None``: process-local storage).
    """
    options = context_lib.get_context(context).multiprocessing_options
    return options.primary_host is not None and len(participating_processes(context)) > 1


_operation_counter = itertools.count()
_operation_lock = threading.Lock()


def next_operation_id() -> int:
    """A number that is the same on every process for the n-th collective operation.

    Every process performs the same saves in the same order, so counting them
    gives matching ids without any communication.
    """
    with _operation_lock:
        return next(_operation_counter)


def _client() -> object:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "This is a multi-process job but jax.distributed is not initialized; call "
            "jax.distributed.initialize(...) in every process before saving."
        )
    return client


def _key(name: str, context: context_lib.Context) -> str:
    prefix = context.multiprocessing_options.barrier_sync_key_prefix
    return f"checkpointables/{prefix + '/' if prefix else ''}{name}"


def sync_global_processes(
    name: str,
    *,
    timeout_secs: float | None = None,
    error: BaseException | None = None,
    report: str = "",
    context: context_lib.Context | None = None,
) -> dict[int, str]:
    """Waits until every participating process reaches barrier ``name``; returns what each
    one passed as ``report``, by process index (a few bytes each: a count, a flag).

    A process that passes ``error`` reports it; then every process raises
    ``ProcessFailedError`` naming the failed processes and their errors.

    Example (the bytes every process wrote)::

        reports = cp.multihost.sync_global_processes("written", report=str(nbytes))
        total = sum(map(int, reports.values()))

    Raises:
      BarrierTimeoutError: some processes did not arrive within the timeout;
        the message names them and the barrier.
      ProcessFailedError: some process reported an error.
    """
    context = context_lib.get_context(context)
    if not is_coordinated(context):
        if error is not None:
            raise error
        return {process_index(): report}
    timeout = context.async_options.timeout_secs if timeout_secs is None else timeout_secs
    client = _client()
    directory = _key(f"barrier/{name}", context)
    me = process_index()
    status = f"ok:{report}" if error is None else f"error: {type(error).__name__}: {error}"[:2000]
    client.key_value_set(f"{directory}/{me}", status)  # type: ignore[attr-defined]
    if error is not None:
        raise error  # Published: the others fail at once instead of waiting for us.
    expected = participating_processes(context)
    deadline = time.monotonic() + timeout
    while True:
        entries = dict(client.key_value_dir_get(f"{directory}/"))  # type: ignore[attr-defined]
        arrived = {int(k.rsplit("/", 1)[-1]): v for k, v in entries.items()}
        failed = {p: v for p, v in arrived.items() if not v.startswith("ok:")}
        if failed:
            details = "; ".join(f"process {p}: {v}" for p, v in sorted(failed.items()))
            raise ProcessFailedError(f"Phase {name!r} failed on other processes: {details}.")
        missing = [p for p in expected if p not in arrived]
        if not missing:
            return {p: arrived[p].removeprefix("ok:") for p in expected}
        if time.monotonic() > deadline:
            raise BarrierTimeoutError(
                f"Timed out after {timeout:g} s in phase {name!r}: processes {missing} of "
                f"{expected} did not arrive (they may have crashed or be stuck). Nothing was "
                f"committed. Raise AsyncOptions.timeout_secs if they are only slow."
            )
        time.sleep(_POLL_SECS)


def broadcast_from_primary(
    name: str, value: str | None, *, context: context_lib.Context | None = None
) -> str:
    """Returns the primary host's ``value`` on every process (within the timeout)."""
    context = context_lib.get_context(context)
    if not is_coordinated(context):
        assert value is not None
        return value
    client = _client()
    key = _key(f"broadcast/{name}", context)
    if is_primary_host(context):
        assert value is not None
        client.key_value_set(key, value)  # type: ignore[attr-defined]
        return value
    timeout_ms = int(context.async_options.timeout_secs * 1000)
    try:
        return str(client.blocking_key_value_get(key, timeout_ms))  # type: ignore[attr-defined]
    except Exception as e:
        primary = context.multiprocessing_options.primary_host
        raise BarrierTimeoutError(
            f"Timed out waiting for the primary host (process {primary}) to publish {name!r}: "
            f"{e}. It may have crashed."
        ) from e
