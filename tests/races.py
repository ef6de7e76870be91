"""Loads racing an overwrite of the same checkpoint, on any storage."""

from __future__ import annotations

import threading
from typing import Any

import checkpointables as cp
import numpy as np


def load_while_overwriting(
    path: Any, versions: list[dict[str, Any]], overwrites: int, *, absent: bool = False
) -> set[str]:
    """Loads ``path`` again and again while a thread overwrites it ``overwrites`` times with
    ``versions`` in turn (``versions[0]`` saved first; each has a leaf ``"n"`` and arrays
    holding only ``n``). Every load must be whole: all its arrays from one save.

    Returns the outcomes seen: ``"whole"``, ``"changed"`` (``CheckpointChangedError``),
    and with ``absent`` ``"absent"`` (no checkpoint there for a moment: on an object store,
    between the old marker's deletion and the new one's). Loads go on until the writer is
    done and a load was whole.
    """
    cp.save_pytree(path, versions[0])
    done = threading.Event()

    def overwrite() -> None:
        for i in range(overwrites):
            cp.save_pytree(path, versions[(i + 1) % len(versions)], overwrite=True)
        done.set()

    tolerated: tuple[type[Exception], ...] = (
        (cp.errors.NotACheckpointError, FileNotFoundError) if absent else ()
    )
    writer = threading.Thread(target=overwrite)
    writer.start()
    outcomes: set[str] = set()
    try:
        while not (done.is_set() and "whole" in outcomes):
            try:
                loaded = cp.load_pytree(path)
            except cp.errors.CheckpointChangedError:
                outcomes.add("changed")
                continue
            except tolerated:
                outcomes.add("absent")
                continue
            arrays = [leaf for key, leaf in loaded.items() if key != "n"]
            values = {int(v) for leaf in arrays for v in np.unique(leaf)}
            assert values == {loaded["n"]}, "a mix of two checkpoints"
            outcomes.add("whole")
    finally:
        writer.join()
    return outcomes
