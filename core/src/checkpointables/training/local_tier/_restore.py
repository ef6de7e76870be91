"""Which step a restore reads, and from where: one rule over every tier.

**The rule:** the newest step that is complete and checksum-valid on some
tier is restored. At equal steps the local tier wins (it is faster).

1. Every host reports the copies on its disk that have a manifest (their
   commit); an all-gather gives every process the same reports (a manifest that
   is damaged, malformed or another run's is passed over, logged). A local step
   is a *candidate* when every process that saved it (``p<i>-of-<n>`` for
   every ``i < n``) has a copy on some live host (a partial one, of its small
   items, counts) and every shard of every array is in one of them. A
   persistent step is one once committed.
2. For the newest candidate, each process gathers the copies its devices
   need: first the copy saved by the process of the same index (its
   per-process items, e.g. a dataset iterator, belong to that index),
   preferring one on its own disk, then further copies, own disk first,
   until their shards (from the manifests) cover those the abstract tree's
   shardings place on this process (fewer processes than saved the step, or
   another mesh, need several). A copy on its disk is checked against its
   checksums; a copy elsewhere is fetched and checked. A damaged or
   unreachable copy is passed over for the next holder. Several copies are
   combined into one checkpoint on this disk (``_combine``).
3. A second all-gather says whether every process got a valid copy; if one
   did not, every process moves on to the next candidate together. So the
   step restored is never incomplete, never damaged, and never older than a
   complete, valid one. Only the copies read are checked.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping

import attrs

from checkpointables.training.local_tier import _manifest, _transport
from checkpointables.training.local_tier._exchange import Exchange
from checkpointables.training.local_tier._manifest import Index, Manifest
from checkpointables.training.local_tier._store import Store, writer_name
from checkpointables.training.step_info import StepInfo

logger = logging.getLogger("checkpointables.training")

__all__ = ["Inventory", "Candidate", "Obtained", "gather", "candidates", "options", "obtain"]


@attrs.frozen
class Inventory:
    """What every host reported: process -> its address and its committed copies."""

    addresses: dict[int, str]
    copies: dict[int, dict[int, dict[str, Manifest]]]  # process -> step -> writer -> manifest

    def holders(self, step: int) -> dict[str, list[tuple[int, Manifest]]]:
        """For ``step``: writer -> the processes holding a copy (with its manifest); copies
        of a trajectory the run left (``left_behind``) are not counted."""
        return self._holders(step, self.left_behind())

    def _holders(
        self, step: int, left: set[_manifest.Copy]
    ) -> dict[str, list[tuple[int, Manifest]]]:
        found: dict[str, list[tuple[int, Manifest]]] = {}
        for process, steps in sorted(self.copies.items()):
            for writer, manifest in steps.get(step, {}).items():
                if manifest.copy not in left:
                    found.setdefault(writer, []).append((process, manifest))
        return found

    def complete_steps(self) -> list[int]:
        """The local steps every writer of which has a copy somewhere, newest first (of
        the copies the run did not leave behind: see ``left_behind``)."""
        left = self.left_behind()
        complete = []
        for step in {s for held in self.copies.values() for s in held}:
            holders = self._holders(step, left)
            counts = {m.process_count for copies in holders.values() for _, m in copies}
            if len(counts) != 1:
                continue  # Copies of different runs' saves: not one step (or none left).
            (n,) = counts
            if all(writer_name(i, n) in holders for i in range(n)) and _every_shard_held(holders):
                complete.append(step)
        return sorted(complete, reverse=True)

    def left_behind(self) -> set[_manifest.Copy]:
        """The copies of a trajectory the run left: those some manifest of any host names in
        its ``left`` (a save at or before their step started while its host held them: the
        run went back), whichever hosts still hold them.

        A host killed before its commit of the step the run went back to still holds the
        copies of the newer steps (maybe whole, with its replicas); the hosts that committed
        it record which copies they removed. Commit times do not tell: they come from the
        clocks of different hosts and jobs (a fast clock in an earlier job would make every
        step saved after it look older than its steps).
        """
        return {
            entry
            for steps in self.copies.values()
            for by_writer in steps.values()
            for manifest in by_writer.values()
            for entry in manifest.left
        }


def _every_shard_held(holders: Mapping[str, list[tuple[int, Manifest]]]) -> bool:
    """Whether every shard of every array of the step is in some copy (a partial copy,
    of a process's small items only, holds none)."""
    every: dict[str, set[Index]] = {}
    held: dict[str, set[Index]] = {}
    for copies in holders.values():
        for _, m in copies:
            for key, shards in m.shards.items():
                every.setdefault(key, set()).update(shards)
            for key, shards in m.held.items():
                held.setdefault(key, set()).update(shards)
    return all(shards <= held.get(key, set()) for key, shards in every.items())


def gather(store: Store, exchange: Exchange, address: str, name: str, timeout: float) -> Inventory:
    """All-gathers every host's report of the copies it holds (checked when read)."""
    mine: dict[str, dict[str, str]] = {}
    for step in store.steps():
        held = store.copies(step)
        if held:
            mine[str(step)] = {w: m.to_json() for w, m in held.items()}
    report = json.dumps({"address": address, "copies": mine})
    gathered = exchange.all_gather(name, report, timeout)
    addresses, copies = {}, {}
    for process, text in gathered.items():
        raw = json.loads(text)
        addresses[process] = raw["address"]
        copies[process] = {
            int(s): _valid(process, s, by_writer) for s, by_writer in raw["copies"].items()
        }
    return Inventory(addresses, copies)


def _valid(process: int, step: str, reported: Mapping[str, str]) -> dict[str, Manifest]:
    """The copies of ``step`` process ``process`` reported whose manifests are valid and
    of the writer they are reported as (others are logged and passed over)."""
    found = {}
    for writer, text in reported.items():
        try:
            manifest = Manifest.from_json(text)
        except _manifest.InvalidManifest as e:
            logger.warning("Local tier: passing over process %d's copy %r of step %s: %s",
                           process, writer, step, e)  # fmt: skip
            continue
        if (str(manifest.step), manifest.writer) == (step, writer):
            found[writer] = manifest
    return found


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


def _split_arrays(holders: Mapping[str, list[tuple[int, Manifest]]]) -> set[str]:
    """The arrays whose shards are spread over several writers' copies."""
    return {
        k
        for copies in holders.values()
        for _, m in copies
        if not m.partial
        for k, v in m.shards.items()
        if set(m.held.get(k, ())) != set(v)
    }


def options(
    holders: Mapping[str, list[tuple[int, Manifest]]],
    me: int,
    count: int,
    needed: dict[str, set[Index]] | None,
    unsharded: Collection[str] = (),
) -> list[tuple[int, Manifest]]:
    """The copies this process may read (holder process, manifest), best first: the copy
    saved by the process of its index (of the same count first), then those on its own
    disk. ``obtain`` takes the first and adds the next ones until they hold ``needed``
    (``unsharded``: the arrays asked for without a sharding)."""
    split = _split_arrays(holders)
    if split and (needed is None or split.intersection(unsharded)):
        return []  # Without shardings to say what this process needs, no copy is whole.
    ranked = []
    for writer, copies in holders.items():
        for process, manifest in copies:
            if needed is None and manifest.partial:
                continue  # Without shardings, one copy is read: a whole one.
            same_index = manifest.process_index == me
            same_count = same_index and manifest.process_count == count
            key = (not same_count, not same_index, manifest.partial, process != me, process, writer)
            ranked.append((key, (process, manifest)))
    return [option for _, option in sorted(ranked, key=lambda r: r[0])]


@attrs.frozen
class Obtained:
    """Copies on this host's disk that together hold what this process needs (the first
    one supplies everything that is not an array's shard), and what getting them cost."""

    paths: tuple[str, ...]
    bytes_local: int
    bytes_peers: int


def _get(store: Store, inventory: Inventory, process: int, manifest: Manifest, me: int,
         timeout: float) -> tuple[str, int, int]:  # fmt: skip
    """The copy on this host's disk, checked (fetched if elsewhere): (path, local, peers).

    Raises:
      _transport.FetchError: it is damaged or could not be fetched.
    """
    path = store.copy_dir(manifest.step, manifest.writer)
    if process != me:
        received = _transport.fetch_copy(inventory.addresses[process], manifest, store, timeout)
        return path, 0, received
    bad = _manifest.problems(path, manifest)
    if bad:
        raise _transport.FetchError(f"own copy {manifest.writer} is damaged ({'; '.join(bad[:2])})")
    return path, manifest.nbytes, 0


def obtain(
    store: Store,
    inventory: Inventory,
    choices: list[tuple[int, Manifest]],
    me: int,
    timeout: float,
    needed: dict[str, set[Index]] | None = None,
) -> Obtained:
    """The first valid one of ``choices``, and the next ones that hold more of ``needed``
    (``None``: the first one alone), until they hold all of it; on this host's disk.

    Raises:
      _transport.FetchError: the valid, reachable choices do not hold what is needed;
        the message says why for each one passed over.
    """
    why: list[str] = []
    got: list[str] = []
    whole: set[str] = set()  # Writers of the whole copies got (not partial).
    held: dict[str, list[Index]] = {}
    local = peers = 0
    missing = -1 if needed is None else _manifest.uncovered(needed, held)
    for process, manifest in choices:
        if got and (needed is None or manifest.writer in whole):
            continue
        merged = {k: held.get(k, []) + list(v) for k, v in manifest.held.items()}
        after = -1 if needed is None else _manifest.uncovered(needed, {**held, **merged})
        if got and after >= missing:
            continue  # Holds nothing more of what is needed.
        try:
            path, from_local, from_peers = _get(store, inventory, process, manifest, me, timeout)
        except _transport.FetchError as e:
            why.append(f"process {process}: {e}" if process != me else str(e))
            continue
        if path not in got:  # A whole copy fetched over a partial one got before.
            got.append(path)
        if not manifest.partial:
            whole.add(manifest.writer)
        held.update(merged)
        local, peers, missing = local + from_local, peers + from_peers, after
        if missing <= 0:
            return Obtained(tuple(got), local, peers)
    if got:
        why.append(f"the valid copies hold {missing} elements less than this process needs")
    raise _transport.FetchError("; ".join(why) or "no copy holds the shards this process needs")
