"""Reads a root with the real Orbax V1 training Checkpointer, for the compatibility tests.

Usage: python orbax_reader.py ROOT

Prints one JSON object: the steps Orbax lists with their metrics, the root's
custom metadata, and per step what Orbax's natural calls return (``load``,
``load_checkpointables``, ``metadata``, ``checkpointables_metadata``), or the
error each raised. Run in its own process, like ``orbax_writer``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


def plain(value: Any) -> Any:
    """``value`` as JSON: arrays become ``{"dtype", "values"}``."""
    import numpy as np

    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray | np.generic) or hasattr(value, "__array__"):
        array = np.asarray(value)
        return {"dtype": str(array.dtype), "values": array.tolist()}
    return value


def attempt(call: Callable[[], Any]) -> Any:
    """``{"ok": value}``, or ``{"error": "Type: message"}``."""
    try:
        return {"ok": plain(call())}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def step_report(ckptr: Any, step: int) -> dict[str, Any]:
    """What Orbax's natural calls return for ``step``."""
    return {
        "load": attempt(lambda: ckptr.load(step)),
        "load_checkpointables": attempt(lambda: ckptr.load_checkpointables(step)),
        "metadata_metrics": attempt(lambda: ckptr.metadata(step).metrics),
        "checkpointables_metadata": attempt(
            lambda: sorted(ckptr.checkpointables_metadata(step).metadata)
        ),
    }


def main(root: str) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    with ocp_v1.training.Checkpointer(root) as ckptr:
        report: dict[str, Any] = {
            "steps": [[c.step, c.metrics] for c in ckptr.checkpoints],
            "root_metadata": ckptr.root_metadata().custom_metadata,
            "by_step": {},
        }
        for c in ckptr.checkpoints:
            report["by_step"][str(c.step)] = step_report(ckptr, c.step)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
