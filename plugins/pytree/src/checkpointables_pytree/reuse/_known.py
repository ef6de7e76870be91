"""The fingerprints of ``jax.Array`` objects this process saved before, while they live.

A ``jax.Array`` never changes: an update returns a new array, and donating or
deleting one leaves it deleted. So an array object a reusing save fingerprinted
keeps those fingerprints for as long as it lives, and a later save of the same
object reads none of its data again. This helps a loop that keeps its frozen
parameters out of the jitted step's outputs (``jax.jit`` returns new buffers
even for the arrays it passes through unchanged: those are fingerprinted).
NumPy arrays can be written in place and are always fingerprinted; so are
arrays on JAX's CPU devices (the caller, ``reuse._plan``, keeps nothing for
them), which may share a NumPy array's memory (``jax.device_put`` and DLPack
do not copy there).

Entries are keyed by ``id`` and hold a weak reference, checked on every
lookup: an entry goes with its array, and a new array at a reused address is
never taken for the old one.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["kept_prints", "keep_prints", "kept_count"]

# Reentrant: a collection inside ``keep_prints`` may run a ``forget`` on this thread.
_lock = threading.RLock()
_prints: dict[int, tuple[weakref.ref[Any], list[str]]] = {}


def kept_prints(array: Any) -> list[str] | None:
    """The fingerprints ``keep_prints`` kept for ``array`` (this very object), or ``None``."""
    entry = _prints.get(id(array))
    if entry is None:
        return None
    # Typed Any: comparing ``array`` itself by ``is`` would narrow it to ``Any | None``.
    referent: Any = entry[0]()
    if referent is not array or referent.is_deleted():
        return None
    return entry[1]


def keep_prints(array: Any, prints: list[str]) -> None:
    """Keeps ``prints`` (one per shard a save wrote) for as long as ``array`` lives."""
    key = id(array)

    def forget(ref: weakref.ref[Any]) -> None:
        with _lock:
            if key in _prints and _prints[key][0] is ref:
                del _prints[key]

    with _lock:
        _prints[key] = (weakref.ref(array, forget), list(prints))


def kept_count() -> int:
    """How many arrays have fingerprints kept (for tests: entries go with their arrays)."""
    return len(_prints)
