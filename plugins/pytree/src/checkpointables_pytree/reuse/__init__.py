"""Incremental saves: unchanged arrays linked from an earlier checkpoint, not written again.

Under ``cp.reuse.current()`` (``cp.save_pytree(..., reuse_from=...)``, a
Checkpointer with ``reuse_unchanged``), ``plan_reuse`` fingerprints the arrays
of a save on their devices (``_fingerprint``), compares them with the record
the source saved beside its database, and hands the writer the chunks to link
(``io.Writer.linked``); the save then writes the record of its own
fingerprints (``ReusePlan.write``). Arrays on CPU devices are probed first
(``probe``: a few windows of their bytes); those that surely changed skip the
fingerprint. A ``jax.Array`` object on accelerators fingerprinted once keeps its
fingerprints while it lives (``kept_prints``). Guide: ``docs/incremental.md``.

Linking is a hard link on a local disk and a server-side copy on S3
(``storage.copy_objects``, through ``ocdbt.link_files``). On an object store a
Checkpointer's committed step reads its own record and b-tree back, and lists its
data objects, for the next save (``_prefetched``), so that save's blocking phase
makes no requests for them.

It imports ``io``, ``ocdbt``, ``storage``, ``tree`` and ``zarr3``; only the handler imports it.
"""

from checkpointables_pytree.reuse._fingerprint import (
    PROBE_KIND,
    fingerprint_lanes,
    fingerprint_numpy,
    fingerprint_shards,
    host_bytes,
    probe,
    supported,
)
from checkpointables_pytree.reuse._known import kept_count, kept_prints
from checkpointables_pytree.reuse._plan import (
    MIN_BYTES,
    RECORD_FILE,
    ReusePlan,
    plan_reuse,
    reuse_report,
)

__all__ = [
    "PROBE_KIND",
    "fingerprint_lanes",
    "fingerprint_numpy",
    "fingerprint_shards",
    "host_bytes",
    "probe",
    "supported",
    "kept_count",
    "kept_prints",
    "MIN_BYTES",
    "RECORD_FILE",
    "ReusePlan",
    "plan_reuse",
    "reuse_report",
]
