"""Finding the committed steps of a root directory.

A step is a subdirectory whose name the step name format parses and that is
a finished checkpoint (``cp.is_checkpoint``): temporary directories of
unfinished saves and half-deleted steps have names no format parses, so they
are never listed. Roots written by Orbax's ``CheckpointManager`` qualify too:
their steps have ``_CHECKPOINT_METADATA`` and keep metrics in a ``metrics/``
item, which is read when ``_CHECKPOINT_METADATA`` has none (``_step_metrics``).

On an object store one listing of the root shows every step and whether it
has its ``commit_success.txt``; the committed steps' metadata is then read
in parallel (one request each).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
from etils import epath

from checkpointables import _commit, _enclosing, _saving, _step_metrics, errors, layout, storage
from checkpointables._asyncio import concurrently
from checkpointables.checkpoint_metadata import read_checkpoint_metadata
from checkpointables.context import Context
from checkpointables.training import _root_metadata, step_name_formats
from checkpointables.training.step_info import StepInfo
from checkpointables.training.step_name_formats import StepNameFormat

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _metrics(path: epath.Path, meta: dict[str, Any]) -> dict[str, Any]:
    try:
        return _step_metrics.read(path, meta)
    except errors.CheckpointError as e:
        if _commit.identity(path) is None:
            raise  # Deleted while we read it (see read_step), not damaged.
        # The step's checkpointables may be fine: list it, without metrics.
        logger.warning("Ignoring the damaged metrics of step directory %s: %s", path, e)
        return {}


def read_step(step: int, path: epath.Path, *, validated: bool = False) -> StepInfo:
    """The ``StepInfo`` of the committed checkpoint at ``path``.

    ``validated``: the caller knows it is committed (from a listing).

    A read that fails may have raced another process: its preservation policy
    deleting the step (renamed away, or its marker deleted, between our reads
    of ``_CHECKSUMS`` and ``_CHECKPOINT_METADATA``), or a save replacing it. So
    a failure counts as damage only if the step is still committed and a
    second read fails too.

    Raises:
      FileNotFoundError, cp.errors.NotACheckpointError: ``path`` is not a
        finished checkpoint.
      cp.errors.CheckpointChangedError: the step was deleted while it was read.
      cp.errors.MetadataError, cp.errors.IntegrityError: its metadata is damaged.
    """
    retries = 1
    while True:
        try:
            return _read_step_once(step, path, validated=validated)
        except (FileNotFoundError, errors.NotACheckpointError):
            raise
        except (errors.CheckpointError, OSError) as e:
            if _commit.identity(path) is None:
                raise errors.CheckpointChangedError(
                    f"Step {step} ({path}) was deleted while its metadata was being read (by a "
                    f"preservation policy, or another process). Nothing is damaged: call "
                    f"reload() or steps() for the steps that remain."
                ) from e
            if not retries:
                raise
            retries -= 1  # Still committed: maybe replaced meanwhile, which a new read tells.


def _read_step_once(step: int, path: epath.Path, *, validated: bool) -> StepInfo:
    if not validated:
        layout.validate_checkpoint_directory(path)
    meta = read_checkpoint_metadata(path)
    commit = meta.get("commit_timestamp_nsecs")
    return StepInfo(
        step=step,
        path=path,
        metrics=_metrics(path, meta),
        commit_timestamp_nsecs=commit if isinstance(commit, int) else None,
    )


@attrs.frozen
class Listing:
    """What a root holds: committed steps, and (object stores) step prefixes without a commit."""

    steps: dict[int, StepInfo]
    unfinished: tuple[epath.Path, ...] = ()


def _read(step: int, path: epath.Path, *, validated: bool) -> StepInfo | None:
    try:
        return read_step(step, path, validated=validated)
    except (FileNotFoundError, errors.NotACheckpointError, errors.CheckpointChangedError):
        return None  # Not committed, or deleted while we looked.
    except (errors.CheckpointError, OSError) as e:  # Damaged: its metadata, or checksums.
        logger.warning("Skipping step directory %s: %s", path, e)
        return None


def list_root(root: epath.Path, name_format: StepNameFormat) -> Listing:
    """The committed steps under ``root`` and, on object stores, the unfinished ones.

    Steps whose metadata cannot be read are left out with a logged warning:
    one damaged step must not stop a run from resuming from the others.
    """
    if not storage.is_local(root):
        return _list_object_store(root, name_format)
    found: dict[int, StepInfo] = {}
    try:
        children = list(root.iterdir())
    except FileNotFoundError:
        return Listing(found)
    for child in children:
        step = name_format.parse_step(child.name)
        if step is None or layout.is_temporary_path(child):
            continue
        info = _read(step, child, validated=False)
        if info is not None:
            found[step] = info
    if not found:
        _warn_if_unmatched(root, name_format)
    return Listing(found)


_warned: set[tuple[str, str]] = set()  # (root, format) already warned about in this process.


def _warn_if_unmatched(root: epath.Path, name_format: StepNameFormat) -> None:
    """Logs, once per root and format, that ``root`` holds checkpoints the format does not
    name: a run resuming there would otherwise silently start from scratch."""
    warned = (storage.key(root), repr(name_format))
    if warned in _warned:
        return
    names = committed_unmatched(root, lambda name: name_format.parse_step(name) is not None)
    if names:
        _warned.add(warned)
        note = unmatched_note(names)
        logger.warning("No step of %s matches its step_name_format. %s", root, note)


def committed_unmatched(root: epath.Path, matches: Callable[[str], bool]) -> list[str]:
    """The names of the committed checkpoints directly under ``root`` for which ``matches``
    (does the step name format write this name?) is false, sorted as steps are."""
    if storage.is_local(root):
        try:
            children = [child.name for child in root.iterdir()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        committed = [n for n in children if layout.is_checkpoint(root / n)]
    else:
        committed = [
            name
            for name, _, rest in (key.partition("/") for key in storage.list_files(root))
            if rest == layout.COMMIT_SUCCESS_FILE
        ]
    names = {n for n in committed if not layout.is_temporary_path(n) and not matches(n)}
    return sorted(names, key=lambda n: [(len(p), p) for p in re.split(r"(\d+)", n)])


def unmatched_note(names: list[str]) -> str:
    """Says that the committed checkpoints ``names`` were not listed, and which
    ``step_name_format`` would list them (when a standard one would)."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    text = (
        f"It holds committed checkpoints whose names the step_name_format does not "
        f"match ({shown}), so they are not listed as steps."
    )
    guess = step_name_formats.guess_standard_format(names)
    if guess is not None:
        text += (
            f" They were probably saved with step_name_format="
            f"{step_name_formats.as_code(guess)}: pass that to the Checkpointer."
        )
    else:
        text += " Pass the step_name_format they were saved with to the Checkpointer."
    return text


def open_root(
    root: epath.Path,
    name_format: StepNameFormat,
    custom_metadata: Any,
    *,
    context: Context,
    primary: bool,
) -> Listing:
    """Checks ``root`` can hold steps, writes its metadata if it has none, and lists it.

    Raises:
      storage.PathIsAFileError: ``root`` or (local) one of its parents is a file (also a
        ``NotADirectoryError``, as a save there raises).
      cp.errors.InvalidArgumentError: ``root`` is a finished checkpoint, or lies in one
        (the same error every save there would raise; the step saves then skip that check).
    """
    custom = None
    if custom_metadata is not None:
        custom = _saving.json_or_raise(custom_metadata, "custom_metadata")
    with context:  # An object store is reached as the context says.
        _refuse_file_in(root)
        if layout.is_checkpoint(root):
            raise errors.InvalidArgumentError(
                f"{root} is itself a checkpoint, not a root of step checkpoints. Pass the "
                f"directory that holds the steps (probably {root.parent}), or load this "
                f"checkpoint with the free functions (cp.load_pytree, cp.load_checkpointables)."
            )
        # Every save of a step would be refused (a step would add a directory to that
        # checkpoint): refused now, once, rather than at the first save.
        _enclosing.refuse_inside(root)
        if custom is not None and primary:
            _root_metadata.write_if_absent(root, custom)
        return list_root(root, name_format)


def _blocking_file(root: epath.Path) -> str | None:
    """``root`` if a file is there, or (local) its first parent that is a file, or ``None``.

    Only local parents are checked: an object store holds ``a`` and ``a/b`` side by side.
    """
    if not storage.is_local(root):
        return os.fspath(root) if storage.is_file(root) else None
    path = os.path.normpath(os.fspath(root))  # As the user wrote it, to name it so.
    while path:  # The deepest existing path decides: every parent above it is a directory.
        if os.path.exists(path):
            return None if os.path.isdir(path) else path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None


def _refuse_file_in(root: epath.Path) -> None:
    """Raises, before anything is created, if a file stands where ``root`` needs a directory
    (the same error a free function's save there raises)."""
    blocking = _blocking_file(root)
    if blocking is None:
        return
    text = os.fspath(root)
    where = "" if blocking in (text, os.path.normpath(text)) else f" (in the path {root})"
    raise storage.PathIsAFileError(
        errno.ENOTDIR,
        f"{blocking} is a file, not a directory{where}: a Checkpointer needs a directory "
        f"to hold one checkpoint per step. Pass a directory (or a path where one can be "
        f"created), or move {blocking} away; nothing was created",
    )


def _list_object_store(root: epath.Path, name_format: StepNameFormat) -> Listing:
    committed: dict[int, epath.Path] = {}
    unfinished: dict[str, epath.Path] = {}
    for key in storage.list_files(root):
        name, _, rest = key.partition("/")
        step = name_format.parse_step(name) if rest else None
        if step is None or layout.is_temporary_path(name):
            continue
        if rest == layout.COMMIT_SUCCESS_FILE:
            committed[step] = root / name
            unfinished.pop(name, None)
        elif step not in committed:
            unfinished.setdefault(name, root / name)
    # One request per step: many at once.
    infos = concurrently(lambda item: _read(*item, validated=True), committed.items())
    steps = {info.step: info for info in infos if info is not None}
    if not steps:
        _warn_if_unmatched(root, name_format)
    return Listing(steps, tuple(unfinished.values()))


class StepIndex:
    """The committed steps of a root, by step number, shared by a Checkpointer's threads."""

    def __init__(self, steps: dict[int, StepInfo]) -> None:
        self._lock = threading.Lock()
        self._steps = dict(steps)
        # How many steps loads found deleted (``forget``) since the last listing: a load of
        # the latest step that fails meanwhile tries again after a reload.
        self.forgotten = 0

    def sorted(self) -> list[StepInfo]:
        """Every step, sorted by step number."""
        with self._lock:
            return [self._steps[s] for s in sorted(self._steps)]

    def latest(self) -> StepInfo | None:
        """The step with the highest number, or ``None``."""
        with self._lock:
            return self._steps[max(self._steps)] if self._steps else None

    def get(self, step: int) -> StepInfo | None:
        """The step ``step``, or ``None``."""
        with self._lock:
            return self._steps.get(step)

    def add(self, info: StepInfo) -> None:
        """Records a step (replacing one of the same number)."""
        with self._lock:
            self._steps[info.step] = info

    def replace_all(self, steps: dict[int, StepInfo]) -> None:
        """Forgets every step, and records ``steps``."""
        with self._lock:
            self._steps = dict(steps)
            self.forgotten = 0

    def forget(self, info: StepInfo) -> None:
        """Forgets ``info``, found deleted by another process, unless a save replaced it."""
        with self._lock:
            if self._steps.get(info.step) is info:
                del self._steps[info.step]
                self.forgotten += 1

    def take(self, info: StepInfo, action: Callable[[], T]) -> T | None:
        """Runs ``action`` and forgets ``info``, unless another save replaced it (or it is
        gone): then ``None``. Atomic with the other methods."""
        with self._lock:
            if self._steps.get(info.step) is not info:
                return None
            result = action()
            del self._steps[info.step]
            return result
