"""What the reuse tests read back from a checkpoint."""

from __future__ import annotations

from checkpointables_pytree import reuse


def linked_names(checkpoint, name: str = "pytree") -> set[str]:
    """The arrays of ``checkpoint``'s checkpointable ``name`` that its save linked from
    its source (as its record, and ``checkpointables inspect``, say)."""
    report = reuse.reuse_report(checkpoint / name)
    return {array for array, source in report.items() if source is not None}
