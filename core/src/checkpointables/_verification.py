"""``checkpointables verify``: everything a load would check, and more, without keeping values.

A checkpoint passes only if a load of every checkpointable would succeed and
return what was saved: the checkpoint stays inside its directory, every
metadata file matches the checksum recorded at commit, every recorded
checkpointable exists and has a handler here, and each one passes its
handler's ``verify`` (the pytree handler reads every chunk) or, for handlers
without one, loads. A metrics item (Orbax's ``metrics/metrics``) must hold a
JSON object.
"""

from __future__ import annotations

from typing import Any

import attrs
from etils import epath

from checkpointables import (
    _confinement,
    _loading,
    _step_metrics,
    errors,
    layout,
    metadata_checksums,
    progress,
)
from checkpointables._asyncio import run_sync
from checkpointables._pytree_api import holds_pytree
from checkpointables.checkpoint_metadata import read_checkpoint_metadata
from checkpointables.context import get_context
from checkpointables.path._parse import as_path
from checkpointables.protocols import Verifiable, VerifyNote
from checkpointables.serialization import AbstractArray

__all__ = ["Finding", "verify_checkpoint", "leaf_nbytes"]


@attrs.frozen
class Finding:
    """One line of the report: what was checked (``"checkpoint"`` or a checkpointable name),
    and the problem found (``None``: it passed; ``note``: said, but not a failure)."""

    subject: str
    problem: str | None = None
    note: str | None = None


def _checksum_findings(path: epath.Path) -> list[Finding]:
    """Recorded metadata files that are missing or do not match (handlers are still checked:
    they name what the damage breaks)."""
    problems = metadata_checksums.verify(path)
    if problems:
        return [Finding("checkpoint", p) for p in problems]
    if metadata_checksums.is_protected(path):
        return [Finding("checkpoint", note="metadata checksums ok")]
    return [
        Finding(
            "checkpoint",
            note="no metadata checksums recorded (written by Orbax or an earlier version): "
            "metadata files are checked for form only",
        )
    ]


def leaf_nbytes(leaf: Any) -> int | None:
    """Bytes of an (abstract) leaf, ``None`` where its metadata does not say.

    An abstract array's shape's size times its dtype's; another leaf's
    ``nbytes`` where it has an integer one (the pytree plugin's metadata of a
    ``bytes`` leaf does).
    """
    if not isinstance(leaf, AbstractArray) or leaf.shape is None or leaf.dtype is None:
        nbytes = getattr(leaf, "nbytes", None)
        return nbytes if type(nbytes) is int else None
    import numpy as np

    return int(np.prod(leaf.shape, dtype=np.int64)) * int(getattr(leaf.dtype, "itemsize", 0))


def _array_bytes(directory: epath.Path, name: str, recorded: str | None) -> int | None:
    """Bytes of the arrays of one checkpointable, from its metadata (``None`` if unknown):
    the total of ``verify``'s progress bar."""
    import jax

    try:
        value = _loading.item_metadata(directory, name, recorded, get_context())
    except Exception:  # The checks below report what is wrong.
        return None
    total = sum(leaf_nbytes(leaf) or 0 for leaf in jax.tree_util.tree_leaves(value))
    return total or None  # Nothing to count in bytes (e.g. JSON): a bar without a total.


def _item_findings(name: str, directory: epath.Path, recorded: str | None) -> list[Finding]:
    context = get_context()
    try:
        handler = _loading.resolve_load_handler(directory, name, recorded, None, context)
        verifiable = isinstance(handler, Verifiable)
        with context:
            if verifiable:
                total = _array_bytes(directory, name, recorded) if progress.enabled() else None
                with progress.bytes_progress(total, f"verify {name}"):
                    problems = run_sync(handler.verify(directory))
            else:  # What a load would find: load it, and drop the value.
                run_sync(_load(handler, directory))
                problems = []
    except errors.InvalidArgumentError as e:
        # A load needs more than the checkpoint (a stateful object to load into): its files
        # were still checked against their recorded checksums above.
        return [Finding(name, note=f"not loaded here: {e}")]
    except errors.CheckpointError as e:
        return [Finding(name, str(e))]
    except Exception as e:  # A handler's own failure is a failed check, not a crash.
        return [Finding(name, f"{type(e).__name__}: {e}")]
    notes = [p for p in problems if isinstance(p, VerifyNote)]
    problems = [p for p in problems if not isinstance(p, VerifyNote)]
    if problems:
        return [Finding(name, problem) for problem in problems]
    if notes:
        return [Finding(name, note=f"ok; {note}") for note in notes]
    return [Finding(name, note=None if verifiable else "loads (no verify in its handler)")]


def _metrics_findings(path: epath.Path, meta: dict[str, Any]) -> list[Finding]:
    """The metrics item (``metrics/metrics``, as Orbax writes it), if the checkpoint has one."""
    if not _step_metrics.has_item(path, meta):
        return []
    try:
        _step_metrics.read_item(path)
    except errors.CheckpointError as e:
        return [Finding(layout.METRICS_NAME, str(e))]
    return [Finding(layout.METRICS_NAME)]


async def _load(handler: Any, directory: epath.Path) -> None:
    await (await handler.load(directory))


@metadata_checksums.scope()  # One lookup of _CHECKSUMS per operation.
def verify_checkpoint(path: epath.PathLike) -> list[Finding]:
    """Every finding about the checkpoint at ``path``; it passes if none has a ``problem``.

    Raises:
      FileNotFoundError: nothing exists at ``path``.
    """
    path = as_path(path)
    try:
        layout.validate_checkpoint_directory(path)
    except errors.NotACheckpointError as e:
        return [Finding("checkpoint", str(e))]
    try:
        _confinement.check_contained(path)
    except (errors.OutsideCheckpointError, errors.IntegrityError) as e:
        return [Finding("checkpoint", str(e))]  # Nothing more is read from it.
    findings = _checksum_findings(path)
    try:
        meta = read_checkpoint_metadata(path)
        _loading.available_checkpointables(path, meta)
    except errors.CheckpointError as e:
        if any(f.problem == str(e) for f in findings):  # A lost _CHECKSUMS: said once.
            return findings
        return [*findings, Finding("checkpoint", str(e))]
    findings += _metrics_findings(path, meta)
    typestrs = _loading.recorded_typestrs(meta)
    flat = meta.get("item_handlers") if isinstance(meta.get("item_handlers"), str) else None
    if flat is not None or (not typestrs and holds_pytree(path)):
        return [*findings, *_item_findings("<root>", path, flat)]  # Orbax V0's flat layout.
    for name in layout.checkpointable_directories(path, typestrs):
        findings += _item_findings(name, path / name, typestrs.get(name))
    return findings
