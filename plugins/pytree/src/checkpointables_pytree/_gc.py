"""Pausing Python's cyclic garbage collector around allocation-heavy sections.

The pauses are the core's (``checkpointables._gc``): one nesting count for
the core's pauses around whole operations and the plugin's around its
CPU-bound sections (never I/O waits of background work).
"""

from __future__ import annotations

from checkpointables._gc import paused

__all__ = ["paused"]
