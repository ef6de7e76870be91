"""One checkpoint on this host's disk from several local copies of one step.

A restore whose shards lie in several hosts' copies (fewer processes than
saved the step, or another mesh) gets those copies onto its own disk, then
builds ``<dir>/<step>/combined-<writer>/``: an ordinary checkpoint whose
files are hard links of the copies' (nothing is copied), except each
checkpointable that the copies hold several parts of and whose handler is a
``cp.protocols.CombinesShards`` (the pytree handler): its handler builds it
from every copy's directory, so its arrays hold the union of their shards.
Everything else (JSON, a dataset iterator, custom handlers' items) is the
first copy's: the restore puts the copy saved by the process of its own
index first (a partial copy, of that process's small items only, may be
first: the arrays' checkpointables then come from the others).
``_CHECKSUMS`` is recorded anew for what was built.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from etils import epath

from checkpointables import _loading, errors, metadata_checksums
from checkpointables._asyncio import run_sync
from checkpointables.context import Context
from checkpointables.protocols import CombinesShards

__all__ = ["combine", "COMBINED_PREFIX"]

COMBINED_PREFIX = "combined-"
_SOURCE_PREFIX = ".shards-"  # Hidden: not part of the checkpoint's checksummed files.


def _link_tree(source: str, target: str) -> None:
    """``target`` as a tree of hard links of ``source``'s files (copies where links fail)."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link)


def _combiner(opened: _loading.Opened, name: str, context: Context) -> CombinesShards | None:
    """The handler of checkpointable ``name`` if it can combine shards (else ``None``)."""
    directory = opened.path / name
    try:
        handler = _loading.resolve_load_handler(
            directory, name, opened.typestr(name, directory), None, context,
            opened.distribution(name),
        )  # fmt: skip
    except errors.CheckpointError:
        return None  # Loading it reports the problem; linking it changes nothing.
    return handler if isinstance(handler, CombinesShards) else None


def combine(copies: Sequence[str], target: str, context: Context) -> str:
    """Builds at ``target`` the checkpoint of ``copies`` (local copies of one step, the
    first one's items where they cannot be combined); returns ``target``."""
    shutil.rmtree(target, ignore_errors=True)  # What a killed restore left.
    os.makedirs(target)
    first = copies[0]
    opened = _loading.open_for_load(epath.Path(first), context)
    names = {n for c in copies for n in os.listdir(c) if os.path.isdir(os.path.join(c, n))}
    for name in sorted(os.listdir(first)):
        if not os.path.isdir(os.path.join(first, name)):
            # Small; and _CHECKSUMS is rewritten below.
            shutil.copyfile(os.path.join(first, name), os.path.join(target, name))
    for name in sorted(names):
        built = os.path.join(target, name)
        holders = [c for c in copies if os.path.isdir(os.path.join(c, name))]
        combiner = _combiner(opened, name, context) if len(holders) > 1 else None
        if combiner is None:
            _link_tree(os.path.join(holders[0], name), built)
            continue
        os.makedirs(built)
        parts = []
        for k, holder in enumerate(holders):
            part = os.path.join(built, f"{_SOURCE_PREFIX}{k}")
            _link_tree(os.path.join(holder, name), part)
            parts.append(epath.Path(part))
        run_sync(combiner.combine_shards(parts, epath.Path(built)))
    metadata_checksums.record(target)
    return target
