"""Which process this is, and which one writes shared files.

Single-process runs need nothing from here. In a ``jax.distributed`` job every
process calls the same save; only the primary host writes shared metadata
and commits.
"""

from __future__ import annotations

import sys

from checkpointables import context as context_lib

__all__ = ["process_index", "process_count", "is_primary_host"]


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
