"""One host's local-tier directory: its steps, the copies in each, and their retention.

Layout::

    <directory>/<step>/<writer>/                 an ordinary checkpoint of one host's shards
    <directory>/<step>/<writer>.manifest.json    that copy's manifest (its commit)

``<writer>`` names the process that saved the copy (``p<index>-of-<count>``);
a step directory holds this host's own copy and the copies it keeps for
peers. A copy without its manifest is unfinished and never used; so is one
whose manifest is damaged or malformed (``_manifest.InvalidManifest``) or
names another run (another persistent root than the directory's record):
each is logged and passed over. Nothing is ever removed as a copy but a
directory named ``p<index>-of-<count>`` in a step directory. Steps are
removed by renaming them to a hidden name first, so a half-removed step is
never listed.

Only what the tier wrote is ever removed (``foreign``): a numbered entry is a
step only if it is a directory (not a symbolic link, which is never followed)
holding nothing but copies, their manifests and the temporaries of the
tier's saves, fetches and restores. Anything else under a step's number (a
checkpoint saved there by other means, a user's file, a link) is left alone
and logged once: it is not listed as a step, never counted towards ``keep``,
and a local save of its step is refused (``check_own``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import uuid

from checkpointables import errors
from checkpointables.training.local_tier import _manifest
from checkpointables.training.local_tier._manifest import InvalidManifest, Manifest

logger = logging.getLogger("checkpointables.training")
__all__ = ["Store", "writer_name", "foreign", "is_trash"]

_TRASH = ".removing-"
# A step hidden for removal: .removing-<step>-<8 hex digits> (``Store.remove_step``).
_TRASH_NAME = re.compile(r"\.removing-[0-9]+-[0-9a-f]{8}")
# What the tier writes in a step directory: a copy (p<i>-of-<n>), and names that begin
# with one and a dot: its manifest, and the temporaries of its save
# (.checkpointables-tmp-...), of its manifest (.manifest.json.tmp-<pid>) and of a fetch
# (.fetching-...); a restore's combined copy (combined-p<i>-of-<n>, ``_combine``) and its
# temporaries.
_OWN_NAME = re.compile(r"(?:combined-)?p(?:0|[1-9][0-9]*)-of-[1-9][0-9]*(?:\..*)?", re.DOTALL)


def is_trash(name: str) -> bool:
    """Whether ``name`` is that of a step being removed (the tier's own)."""
    return _TRASH_NAME.fullmatch(name) is not None


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a file" if stat.S_ISREG(mode) else "not a directory"


def foreign(path: str) -> str | None:
    """Why the numbered entry at ``path`` is not a step the tier wrote (``None``: it is, or
    nothing is there): it is no directory (a link is not followed), or it holds names
    the tier never writes (the first few are named)."""
    try:
        mode = os.lstat(path).st_mode
        if not stat.S_ISDIR(mode):
            return _kind(mode)
        names = os.listdir(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable ({e.strerror})"
    others = sorted(n for n in names if _OWN_NAME.fullmatch(n) is None)
    if not others:
        return None
    more = f" and {len(others) - 3} more" if len(others) > 3 else ""
    return f"a directory holding {', '.join(others[:3])}{more}"


def writer_name(process_index: int, process_count: int) -> str:
    """The name of the copies a process writes."""
    return f"p{process_index}-of-{process_count}"


class Store:
    """A host's local-tier directory (see the module's docstring)."""

    def __init__(self, directory: str, run: str = "", runs: frozenset[str] = frozenset()) -> None:
        """``run``: the run (persistent root) whose copies this host writes and keeps;
        ``runs``: further runs whose copies it uses (the steps it adopted)."""
        self.directory = directory
        self.run = run
        self._runs = runs | {run}
        self._reported: set[str] = set()  # Copies passed over and logged: once each.

    def step_dir(self, step: int) -> str:
        """The directory of ``step``."""
        return os.path.join(self.directory, str(step))

    def copy_dir(self, step: int, writer: str) -> str:
        """Where the copy of ``writer``'s files of ``step`` lives.

        Raises:
          ValueError: ``writer`` is not a copy's name (``p<index>-of-<count>``).
        """
        if not _manifest.is_writer_name(writer):
            raise InvalidManifest(f"{writer!r} is not the name of a copy (p<index>-of-<count>)")
        return os.path.join(self.step_dir(step), writer)

    def manifest_path(self, step: int, writer: str) -> str:
        """Where that copy's manifest lives."""
        return self.copy_dir(step, writer) + _manifest.SUFFIX

    def steps(self) -> list[int]:
        """The step directories present, sorted (also those without a finished copy): the
        directories with a number for name; a file or a link so named is none (not
        followed: a link may loop, or lead out of the directory)."""
        try:
            with os.scandir(self.directory) as entries:
                return sorted(
                    int(e.name)
                    for e in entries
                    if e.name.isascii() and e.name.isdigit() and e.is_dir(follow_symlinks=False)
                )
        except FileNotFoundError:
            return []

    def copies(self, step: int) -> dict[str, Manifest]:
        """The finished copies of ``step`` of this run: writer -> manifest (their files not
        yet checked). A damaged or malformed manifest, or another run's, is logged."""
        try:
            names = os.listdir(self.step_dir(step))
        except OSError:  # Gone, or no directory (a file, a looping link put in its place).
            return {}
        found = {}
        for name in names:
            if not name.endswith(_manifest.SUFFIX):
                continue
            writer = name[: -len(_manifest.SUFFIX)]
            path = os.path.join(self.step_dir(step), name)
            try:
                manifest = _manifest.read(path)
            except InvalidManifest as e:
                self._pass_over(path, str(e))
                continue
            if manifest is None or (manifest.step, manifest.writer) != (step, writer):
                continue  # Another copy's manifest (copied here): it describes other files.
            if manifest.run not in self._runs:
                why = f"a copy of the run of {manifest.run!r}, not of this run ({self.run!r})"
                self._pass_over(path, f"{path} is {why}; remove it")
                continue
            if os.path.isdir(self.copy_dir(step, writer)):
                found[writer] = manifest
        return found

    def left_behind(self, step: int) -> list[_manifest.Copy]:
        """What a save of ``step`` leaves behind (its manifest's ``left``): the copies here
        of ``step`` and later steps (the save removes them: the run went back, or saves
        the step again), and the copies of such steps that the copies here record as left.
        Copies of earlier steps are not carried on: no restore prefers them to ``step``."""
        found: set[_manifest.Copy] = set()
        for held in self.steps():
            for manifest in self.copies(held).values():
                if held >= step:
                    found.add(manifest.copy)
                found.update(entry for entry in manifest.left if entry[0] >= step)
        return sorted(found)

    def _pass_over(self, path: str, why: str) -> None:
        if path not in self._reported:
            self._reported.add(path)
            logger.warning("Local tier: passing over a copy (it is not used): %s", why)

    def commit_copy(self, manifest: Manifest) -> None:
        """Records the finished copy ``manifest`` describes."""
        _manifest.write(manifest, self.manifest_path(manifest.step, manifest.writer))

    def forget_copy(self, step: int, writer: str) -> None:
        """Removes one copy (its manifest first, so it is never seen half-removed)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.manifest_path(step, writer))
        shutil.rmtree(self.copy_dir(step, writer), ignore_errors=True)

    def check_own(self, step: int) -> None:
        """Raises unless the entry of ``step`` is missing or a step the tier wrote.

        Raises:
          cp.errors.InvalidArgumentError: something else is there (see ``foreign``).
        """
        path = self.step_dir(step)
        why = foreign(path)
        if why is not None:
            raise errors.InvalidArgumentError(
                f"The local tier cannot save step {step}: {path} is {why}, which the tier "
                f"did not write (it never removes what it did not write). Move it out of "
                f"{self.directory}: a local tier's directory is its own."
            )

    def remove_step(self, step: int) -> bool:
        """Removes a step: hidden at once by a rename, then deleted. What the tier did not
        write under its number (``foreign``) is left alone, and logged once (``False``)."""
        path = self.step_dir(step)
        why = foreign(path)
        if why is not None:
            if path not in self._reported:
                self._reported.add(path)
                logger.warning(
                    "Local tier: not removing %s, %s that the tier did not write; move it "
                    "out of the local tier's directory.",
                    path,
                    why,
                )
            return False
        trash = os.path.join(self.directory, f"{_TRASH}{step}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return True
        shutil.rmtree(trash, ignore_errors=True)  # Never follows a link inside.
        return True

    def retain(self, keep: int, newest: int | None = None) -> list[int]:
        """Keeps the newest ``keep`` steps that have a finished copy; removes the other step
        directories (older steps, and what killed saves and fetches left) and leftovers
        of removals; returns the steps removed. What the tier did not write is never
        removed (``remove_step``).

        ``newest``: the step just saved; steps after it are removed too. They belong to a
        trajectory the run left (it went on from an older step): kept, they would push
        out the run's new steps and be restored in their place.

        Called only when no save or fetch of this host is in flight."""
        steps = self.steps()
        abandoned = [s for s in steps if newest is not None and s > newest]
        steps = steps[: len(steps) - len(abandoned)]
        finished = [s for s in steps if self.copies(s)]
        kept = set(finished[-keep:])
        dropped = abandoned + [s for s in steps if s not in kept]
        removed = [step for step in dropped if self.remove_step(step)]
        try:
            leftovers = [n for n in os.listdir(self.directory) if is_trash(n)]
        except FileNotFoundError:
            leftovers = []
        for name in leftovers:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        return removed
