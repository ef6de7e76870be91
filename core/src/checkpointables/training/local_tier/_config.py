"""``LocalTier``: where and how often a Checkpointer also saves to each host's own disk."""

from __future__ import annotations

import os

import attrs
from etils import epath

from checkpointables import errors, options
from checkpointables.training import _arguments as arguments
from checkpointables.training import save_decision_policies as decision_lib

__all__ = ["LocalTier", "RestoreStats"]


def _policy(value: object) -> decision_lib.SaveDecisionPolicy:
    # None: a local save is cheap, so save whenever the previous local save has committed.
    return arguments.checked(
        "LocalTier(save_decision_policy=...)",
        value,
        decision_lib.ContinuousCheckpointingPolicy,
        decision_lib.SaveDecisionPolicy,
    )


def _directory(value: epath.PathLike) -> epath.Path:
    text = os.fspath(value)
    if "://" in text:
        raise errors.UnsupportedPathError(
            f"LocalTier({text!r}): the local tier lives on this host's own disk (or RAM disk); "
            f"pass a local directory. Object stores are the persistent tier "
            f"(Checkpointer's root directory)."
        )
    return epath.Path(text)


@attrs.frozen
class LocalTier:
    """A fast tier of checkpoints on each host's own disk, replicated to peers.

    Example::

        ckptr = cp.training.Checkpointer(
            "s3://bucket/run",
            save_decision_policy=EveryNStepsPolicy(1000),       # persistent cadence
            local_tier=cp.training.LocalTier(
                "/local/ckpt", save_decision_policy=EveryNStepsPolicy(10), replicas=1, keep=2),
        )

    Attributes:
      directory: this host's own directory for local steps (each host passes its
        own disk; processes on one machine need distinct directories). The tier's
        alone: empty, missing, or used by a local tier before; one holding
        anything else (checkpoints, a user's files) is refused, never taken over.
      save_decision_policy: the local cadence. Default: whenever the previous
        local save has committed (``ContinuousCheckpointingPolicy``).
      replicas: how many other hosts keep a copy of each host's files (capped
        at the number of other processes; 0 keeps no copies elsewhere).
      keep: how many local steps each host keeps (its own and its replicas).
      serve_address: the address this process serves its local files on, for
        peers to fetch (a port is picked freely). Default ``127.0.0.1``: one
        machine. On a cluster pass this host's address reachable from the others.
      timeout_secs: the bound on every wait of the tier (a peer's report, a
        replication, a fetch); a timeout names the hosts that did not answer.
    """

    directory: epath.Path = attrs.field(converter=_directory)
    save_decision_policy: decision_lib.SaveDecisionPolicy | None = attrs.field(
        default=None, kw_only=True, converter=_policy
    )
    replicas: int = attrs.field(default=1, kw_only=True, validator=options.int_at_least(0))
    keep: int = attrs.field(default=2, kw_only=True, validator=options.int_at_least(1))
    serve_address: str = attrs.field(default="127.0.0.1", kw_only=True)
    timeout_secs: float = attrs.field(
        default=120.0, kw_only=True, validator=options.positive_seconds()
    )


@attrs.frozen
class RestoreStats:
    """Where the latest restore of a Checkpointer read its bytes from, and how long it took.

    Attributes:
      step: the step restored.
      bytes_from_local: bytes of this host's own local-tier files read.
      bytes_from_peers: bytes fetched from other hosts' local tiers.
      bytes_from_persistent: bytes read from the persistent tier (the step's
        file sizes on a local disk; on an object store, the restored arrays'
        bytes); 0 when the step came from the local tier.
      secs: from the call until the load finished.
      tier: ``"local"`` or ``"persistent"``.
    """

    step: int
    bytes_from_local: int
    bytes_from_peers: int
    bytes_from_persistent: int
    secs: float
    tier: str
