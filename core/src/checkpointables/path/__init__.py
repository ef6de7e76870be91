"""Paths: ``Path`` (an ``etils.epath.Path``) and ``PathAwaitingCreation``.

A handler's ``save`` receives a ``PathAwaitingCreation``: the directory its
checkpointable will live in, which the library creates in the background. Code
that writes files must first ``await directory.await_creation()``.
"""

from __future__ import annotations

from etils.epath import Path, PathLike

from checkpointables.path._awaiting import PathAwaitingCreation
from checkpointables.path._parse import as_path

__all__ = ["Path", "PathLike", "PathAwaitingCreation", "as_path"]
