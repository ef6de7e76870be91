"""Which step a restore reads, and from where: one rule over every tier.

**The rule:** the newest step that is complete and checksum-valid on some
tier is restored. A local step is *complete* when every process that saved
it (``p<i>-of-<n>`` for every ``i < n``) has a copy that some live host holds
and has checked against its checksums; hosts report what they hold in an
all-gather, so every process computes the same answer from the same reports.
A persistent step is complete once committed. At equal steps the local tier
wins (it is faster). A damaged copy is never reported, so a healthy copy
elsewhere, or the next candidate, is used instead; never an incomplete step.

Each process then picks the copy its devices need: one whose shards (from its
manifest) cover the shards the abstract tree's shardings place on this
process, preferring the copy saved by the process of the same index (its
per-process items, e.g. a dataset iterator, belong to that index), then one on
its own disk. A copy held only by peers is fetched first. If any process
cannot get a copy (a second all-gather says so), every process moves on to
the next candidate together.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import attrs

from checkpointables.training.local_tier import _transport
from checkpointables.training.local_tier._exchange import Exchange
from checkpointables.training.local_tier._manifest import Index, Manifest
from checkpointables.training.local_tier._store import Store, writer_name
from checkpointables.training.step_info import StepInfo

__all__ = ["Inventory", "Candidate", "Obtained", "gather", "candidates", "obtain"]


@attrs.frozen
class Inventory:
    """What every host reported: process -> its address and its checked copies."""

    addresses: dict[int, str]
    copies: dict[int, dict[int, dict[str, Manifest]]]  # process -> step -> writer -> manifest

    def holders(self, step: int) -> dict[str, list[tuple[int, Manifest]]]:
        """For ``step``: writer -> the processes holding a checked copy (with its manifest)."""
        found: dict[str, list[tuple[int, Manifest]]] = {}
        for process, steps in sorted(self.copies.items()):
            for writer, manifest in steps.get(step, {}).items():
                found.setdefault(writer, []).append((process, manifest))
        return found

    def complete_steps(self) -> list[int]:
        """The local steps every writer of which has a checked copy somewhere, newest first."""
        steps = {s for held in self.copies.values() for s in held}
        complete = []
        for step in steps:
            holders = self.holders(step)
            counts = {m.process_count for copies in holders.values() for _, m in copies}
            if len(counts) != 1:
                continue  # Copies of different runs' saves: not one step.
            (n,) = counts
            if all(writer_name(i, n) in holders for i in range(n)):
                complete.append(step)
        return sorted(complete, reverse=True)


def gather(store: Store, exchange: Exchange, address: str, name: str, timeout: float) -> Inventory:
    """Checks this host's copies against their checksums and all-gathers every host's report."""
    mine: dict[str, dict[str, str]] = {}
    for step in store.steps():
        valid = store.valid_copies(step)
        if valid:
            mine[str(step)] = {w: m.to_json() for w, m in valid.items()}
    report = json.dumps({"address": address, "copies": mine})
    gathered = exchange.all_gather(name, report, timeout)
    addresses, copies = {}, {}
    for process, text in gathered.items():
        raw = json.loads(text)
        addresses[process] = raw["address"]
        copies[process] = {
            int(s): {w: Manifest.from_json(m) for w, m in by_writer.items()}
            for s, by_writer in raw["copies"].items()
        }
    return Inventory(addresses, copies)


@attrs.frozen
class Candidate:
    """A step a restore may read: from ``tier`` ``"local"`` or ``"persistent"``."""

    step: int
    tier: str
    info: StepInfo | None = None  # The persistent step.


def candidates(
    inventory: Inventory, persistent: list[StepInfo], step: int | None
) -> list[Candidate]:
    """Every complete step, newest first (local before persistent at equal steps);
    only ``step`` if given."""
    found = [Candidate(s, "local") for s in inventory.complete_steps()]
    found += [Candidate(i.step, "persistent", i) for i in persistent]
    if step is not None:
        found = [c for c in found if c.step == step]
    return sorted(found, key=lambda c: (-c.step, c.tier != "local"))


def _arrays_split(holders: Mapping[str, list[tuple[int, Manifest]]]) -> bool:
    """Whether some array's shards are spread over several writers' copies."""
    return any(
        any(set(m.held.get(k, ())) != set(v) for k, v in m.shards.items())
        for copies in holders.values()
        for _, m in copies
    )


def choose(
    holders: Mapping[str, list[tuple[int, Manifest]]],
    me: int,
    count: int,
    needed: dict[str, set[Index]] | None,
) -> tuple[int, Manifest] | None:
    """The copy this process reads (holder process, manifest), or ``None`` if none serves."""
    if needed is None and _arrays_split(holders):
        return None  # Without shardings to say what this process needs, no copy is whole.
    options = []
    for writer, copies in holders.items():
        for process, manifest in copies:
            if needed is not None and not manifest.covers(needed):
                continue
            same_index = manifest.process_index == me and manifest.process_count == count
            options.append(((not same_index, process != me, process, writer), (process, manifest)))
    if not options:
        return None
    return min(options, key=lambda o: o[0])[1]


@attrs.frozen
class Obtained:
    """A copy on this host's disk, ready to load, and what getting it cost."""

    path: str
    bytes_local: int
    bytes_peers: int


def obtain(
    store: Store, inventory: Inventory, chosen: tuple[int, Manifest], me: int, timeout: float
) -> Obtained:
    """The chosen copy on this host's disk, fetched from its holder if it is elsewhere.

    Raises:
      _transport.FetchError: the holder did not answer in time or sent damaged files.
    """
    process, manifest = chosen
    path = store.copy_dir(manifest.step, manifest.writer)
    if process == me:
        return Obtained(path, manifest.nbytes, 0)
    received = _transport.fetch_copy(inventory.addresses[process], manifest, store, timeout)
    return Obtained(path, 0, received)
