"""Host copies of single-device arrays: how a save takes its snapshot off the devices.

On CPU devices ``np.asarray`` of an array is a view of its buffer: no copy.

On an accelerator whose devices can address pinned host memory (GPUs), each
array is put into that memory by ``jax.device_put`` to the memory kind
``pinned_host`` and viewed from there. Measured on an H200 (JAX 0.11.2, 1 GiB
float32 fresh each time): 20 ms, against 640-815 ms for ``np.asarray`` of the
array, which copies through pageable memory. ``np.asarray`` also keeps the
copy it made on the caller's array for that array's lifetime (JAX caches it),
so a state kept across saves (frozen weights) held its size in host memory for
good; the pinned copy belongs to the save alone. JAX's pinned-memory allocator
keeps what it allocated for the next save (it is not handed back to the
system), which is about the largest snapshot taken. A save's stall on that
H200, 1 GiB in 8 arrays: 0.080 s (was 0.720 s).

Elsewhere (no pinned memory, or the transfer refused), every copy is started
with ``copy_to_host_async`` before any is waited for, then ``np.asarray``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["host_copies"]

logger = logging.getLogger("checkpointables.pytree")
_PINNED = "pinned_host"


@functools.cache
def _has_pinned_memory(device: Any) -> bool:
    try:
        return any(m.kind == _PINNED for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, RuntimeError):  # An older or odd backend.
        return False


def _device(array: jax.Array) -> Any:
    return next(iter(array.devices()))


def host_copies(arrays: Sequence[jax.Array]) -> list[np.ndarray]:
    """A host array of each single-device ``jax.Array`` (see the module's docstring); the
    caller may delete or donate ``arrays`` once this returns."""
    if jax.default_backend() == "cpu":  # Every device a CPU: views (and no per-array test).
        return list(map(np.asarray, arrays))
    out: list[np.ndarray | None] = [None] * len(arrays)
    pinned = [
        i
        for i, a in enumerate(arrays)
        if _device(a).platform != "cpu" and _has_pinned_memory(_device(a))
    ]
    if pinned:
        try:
            copies = jax.device_put(
                [arrays[i] for i in pinned],
                [arrays[i].sharding.with_memory_kind(_PINNED) for i in pinned],
            )
            for i, copy in zip(pinned, copies, strict=True):
                out[i] = np.asarray(copy)
        except Exception as e:  # An optimisation only: the copies below are always right.
            _log_fallback_once(e)
            out = [None] * len(arrays)
    rest = [i for i, h in enumerate(out) if h is None]
    for i in rest:
        if _device(arrays[i]).platform != "cpu":
            arrays[i].copy_to_host_async()
    for i in rest:
        out[i] = np.asarray(arrays[i])
    return out  # type: ignore[return-value]


@functools.cache
def _log_fallback_once_for(kind: str) -> None:
    logger.info("Copies to pinned host memory failed (%s); saves copy through np.asarray.", kind)


def _log_fallback_once(error: Exception) -> None:
    _log_fallback_once_for(f"{type(error).__name__}: {str(error)[:200]}")
