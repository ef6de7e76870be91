"""The local tier of a training Checkpointer: fast saves to each host's own disk,
replicated to peers, restored without the persistent tier when they survive.

See ``docs/local-tier.md`` for the guide; the modules:

- ``_config``: ``LocalTier`` (what users pass) and ``RestoreStats``;
- ``_store``: one host's directory of local steps and copies;
- ``_owner``: which run (persistent root) a host's directory serves;
- ``_manifest``: each copy's files with checksums and its shards;
- ``_saves``: the tier's saves, replication and retention;
- ``_transport``: the HTTP file service peers fetch copies from;
- ``_exchange``: reports between hosts over the ``jax.distributed`` key-value store;
- ``_restore``: the rule that picks the step restored, and the copy each process reads;
- ``_tier``: the pieces together, as the Checkpointer uses them.
"""

from __future__ import annotations

from checkpointables.training.local_tier._config import LocalTier, RestoreStats

__all__ = ["LocalTier", "RestoreStats"]
