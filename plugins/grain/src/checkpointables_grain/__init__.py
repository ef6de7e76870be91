"""checkpointables plugin: Grain dataset iterators, saved as per-process JSON state.

Save the iterator beside the model; load into a fresh iterator of the same
pipeline and it yields exactly what the original would have yielded next::

    it = iter(dataset)                       # grain.DatasetIterator, or iter(grain.DataLoader)
    cp.save_checkpointables(path, {"pytree": state, "dataset": it})
    ...
    fresh = iter(dataset)
    restored = cp.load_checkpointables(path, {"dataset": fresh})["dataset"]   # is fresh

Each process writes its own ``process_<i>-of-<n>.json`` (Grain's own file
names and contents, so Grain and Orbax read these checkpoints and we read
theirs); JSON only, nothing is pickled. The iterator state is captured in the
blocking phase of a save, so the training loop may keep iterating at once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from collections.abc import Awaitable
from typing import Any

import attrs
import checkpointables as cp
from etils import epath

from checkpointables_grain import _files, _grain_types, _positions, _state_json
from checkpointables_grain._grain_types import DATA_LOADER_ITERATOR, DATASET_ITERATOR

__all__ = [
    "GrainIteratorHandler",
    "GrainIteratorMetadata",
    "IteratorStateError",
    "ProcessCountMismatchError",
    "UnsupportedStateError",
]

# Grain's own Orbax V0 handlers (current and older module paths): checkpoints
# they wrote have the same per-process files.
_GRAIN_TYPESTRS = (
    "grain._src.python.checkpoint.handler.CheckpointHandler",
    "grain._src.python.checkpoint_handlers.CheckpointHandler",
    "grain._src.python.checkpoint_handlers.PyGrainCheckpointHandler",
)


class IteratorStateError(cp.errors.CheckpointError, ValueError):
    """The iterator given to load into cannot take the saved state.

    Raised when no iterator is given, when it is a different kind of iterator
    than the one saved, or when its ``set_state`` rejects the state (a
    different pipeline). A state file whose content no save writes (a
    malformed tag, a ``next_index`` that is no position) is damaged instead:
    ``cp.errors.IntegrityError``.
    """


class ProcessCountMismatchError(IteratorStateError):
    """The iterator states were saved by a different number of processes.

    Grain iterator states are per process; restore with the process count
    that saved them.
    """


class UnsupportedStateError(cp.errors.CheckpointError, TypeError):
    """An iterator's ``get_state()`` holds a value that cannot be stored as JSON exactly."""


@attrs.frozen
class GrainIteratorMetadata:
    """What ``checkpointables_metadata`` reports for a saved Grain iterator.

    Attributes:
      iterator_type: ``"DatasetIterator"`` (from ``iter(dataset)``) or
        ``"DataLoaderIterator"`` (from ``iter(grain.DataLoader(...))``);
        ``None`` when not recorded (checkpoints written by Grain or Orbax).
      process_count: how many processes saved a state.
      grain_version: the Grain version that produced the states, if recorded.
    """

    iterator_type: str | None
    process_count: int | None
    grain_version: str | None = None


@functools.cache
def _grain_version() -> str | None:
    try:
        return importlib.metadata.version("grain")
    except importlib.metadata.PackageNotFoundError:
        return None


def _kind_name(kind: str | None) -> str:
    if kind == DATA_LOADER_ITERATOR:
        return "a grain.DataLoader iterator (iter(data_loader))"
    if kind == DATASET_ITERATOR:
        return "a grain.DatasetIterator (iter(dataset))"
    return "an unknown iterator"


def _state_text(iterator: Any, kind: str, name: str) -> str:
    """The iterator's current state as the text of its state file."""
    if kind == DATA_LOADER_ITERATOR:
        # DataLoader iterators hand out their state as UTF-8 JSON bytes.
        raw = iterator.get_state()
        try:
            raw = bytes(raw)
            _refuse_too_large(len(raw), name)
            text = raw.decode("utf-8")
            _refuse_bad_position(json.loads(text), kind, name)
        except (TypeError, ValueError) as e:
            if isinstance(e, cp.errors.CheckpointError):
                raise
            raise UnsupportedStateError(
                f"The state of data loader iterator {name!r} is not UTF-8 JSON ({e}); "
                f"it cannot be stored as a JSON state file."
            ) from e
        return text
    state = iterator.get_state()
    _refuse_bad_position(state, kind, name)
    try:
        text = _state_json.dumps(state)
    except _state_json.StateEncodingError as e:
        raise UnsupportedStateError(f"Cannot save the state of iterator {name!r}: {e}") from e
    _refuse_too_large(len(text) if text.isascii() else len(text.encode("utf-8")), name)
    return text


def _refuse_bad_position(state: Any, kind: str, name: str) -> None:
    """Refuses a state that a load would refuse as damaged: a position that is no position."""
    found = _positions.bad_position(state, kind)
    if found is not None:
        where, value, expected = found
        raise UnsupportedStateError(
            f"Cannot save the state of iterator {name!r}: {where} is {_brief(value)}, but it "
            f"is a position in the data and must be {expected}."
        )


def _refuse_too_large(size: int, name: str) -> None:
    """Refuses a state file larger than a checkpoint's metadata file may be."""
    limit = cp.metadata_checksums.MAX_FILE_BYTES
    if size > limit:
        raise cp.errors.InvalidArgumentError(
            f"The state of iterator {name!r} is {size:,} bytes of JSON, more than the {limit:,} "
            f"a state file may hold (a larger file would not be covered by the checkpoint's "
            f"checksums). Keep large data out of the iterator's get_state(): save it as arrays "
            f"in a pytree checkpointable beside the iterator, which checksums every chunk."
        )


def _target_iterator(directory: epath.Path, abstract: Any) -> tuple[Any, str]:
    """The iterator to restore into, and its kind."""
    name = directory.name
    if _grain_types.is_iterable_source(abstract):
        abstract = iter(abstract)
    kind = _grain_types.iterator_kind(abstract)
    if kind is None:
        given = "nothing" if abstract is None else f"a {type(abstract).__qualname__}"
        raise IteratorStateError(
            f"Checkpointable {name!r} is a saved Grain iterator position; it can only be loaded "
            f"into a fresh iterator of the same pipeline, but {given} was given. Pass one: "
            f"load_checkpointables(path, {{{name!r}: iter(dataset)}}), or leave {name!r} out "
            f"of the abstract checkpointables to skip it."
        )
    return abstract, kind


def _this_process_file(directory: epath.Path, info: dict[str, Any] | None) -> epath.Path:
    """This process's state file; raises if the process counts differ or it is missing."""
    index, count = cp.multihost.process_index(), cp.multihost.process_count()
    files = _files.state_files(directory)
    saved_counts = sorted({n for _, n in files})
    saved = info["process_count"] if info else (saved_counts[0] if len(saved_counts) == 1 else None)
    if saved is not None and saved != count:
        example = _files.state_file_name(0, saved)
        raise ProcessCountMismatchError(
            f"Checkpointable {directory.name!r} holds the Grain iterator states of {saved} "
            f"process(es) ({example}, ...), but this job has {count}. Iterator states are per "
            f"process: restore with {saved} process(es), or leave {directory.name!r} out of the "
            f"abstract checkpointables and start the data pipeline afresh."
        )
    file = files.get((index, count))
    if file is None:
        held = sorted(f.name for f in files.values()) or "no state files"
        raise cp.errors.IntegrityError(
            f"{directory} has no {_files.state_file_name(index, count)} for process {index} of "
            f"{count} (it holds {held}). The checkpoint is incomplete: a process did not "
            f"finish writing its iterator state."
        )
    return file


def _read_info(directory: epath.Path) -> dict[str, Any] | None:
    try:
        return _files.read_info(directory)
    except cp.errors.CheckpointError:
        raise
    except ValueError as e:
        raise cp.errors.MetadataError(
            f"{e}; the checkpointable {directory.name!r} is damaged."
        ) from e


def _parse_state(file: epath.Path, kind: str) -> Any:
    """The state stored in ``file``, in the form ``set_state`` of ``kind`` takes."""
    # Checked against the checksum recorded when the checkpoint was committed.
    raw = cp.metadata_checksums.read_file(file, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES)
    try:
        plain = cp.safe_json.loads(raw, source=file)  # Reject damage here, with the file's name.
        state = plain if kind == DATA_LOADER_ITERATOR else _state_json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise cp.errors.IntegrityError(f"{file} is not a readable iterator state ({e}).") from e
    _check_positions(state, file, kind)
    # A DataLoader iterator takes the file's bytes, which it parses itself.
    return raw if kind == DATA_LOADER_ITERATOR else state


def _check_positions(state: Any, file: epath.Path, kind: str) -> None:
    """Refuses a stored position that is no whole number in range (Grain's own set_state
    takes 8.5, NaN, true, 2**64 and None, and the first ``next()`` then fails with a bare
    IndexError or TypeError, or yields other elements than the saved iterator would; see
    ``_positions``). No save writes one (it is refused there), so the file is damaged or
    forged: an ``IntegrityError``, as a malformed tag is, not an ``IteratorStateError``
    (a state that does not fit the iterator given)."""
    found = _positions.bad_position(state, kind)
    if found is not None:
        where, value, expected = found
        raise cp.errors.IntegrityError(
            f"{file} holds {where} = {_brief(value)}, which is not a position (or count) in "
            f"the data: it must be {expected}, as in every state Grain writes "
            f"(Grain would take it and fail at the first next()). The state is damaged or "
            f"was not written by Grain; load an older checkpoint, or leave "
            f"{file.parent.name!r} out of the abstract checkpointables and start the data "
            f"pipeline afresh."
        )


def _brief(value: Any) -> str:
    """``repr(value)``, cut short (a hostile file may hold a huge string or number)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... (cut)"


class GrainIteratorHandler:
    """Saves Grain iterators as JSON state, one file per process; restores into fresh ones.

    The abstract checkpointable is a fresh iterator of the same pipeline
    (restored in place and returned), or the dataset / ``grain.DataLoader``
    itself (a new iterator is made with ``iter()``).
    """

    async def save(
        self, directory: cp.path.PathAwaitingCreation, checkpointable: Any
    ) -> Awaitable[None]:
        """Captures the state now, so the caller may keep iterating; writes it later."""
        kind = _grain_types.iterator_kind(checkpointable)
        if kind is None:
            raise TypeError(f"{type(checkpointable).__qualname__} is not a Grain iterator.")
        text = _state_text(checkpointable, kind, directory.name)
        index, count = cp.multihost.process_index(), cp.multihost.process_count()
        info = None
        if cp.multihost.is_primary_host():
            info = json.dumps(
                {
                    "format_version": _files.FORMAT_VERSION,
                    "iterator_type": kind,
                    "process_count": count,
                    "grain_version": _grain_version(),
                },
                indent=2,
            )

        async def write() -> None:
            path = await directory.await_creation()
            _files.write_durably(path / _files.state_file_name(index, count), text)
            if info is not None:
                _files.write_durably(path / _files.INFO_FILE, info)

        return write()

    async def load(
        self, directory: epath.Path, abstract_checkpointable: Any = None
    ) -> Awaitable[Any]:
        """Checks iterator kind and process count now; returns an awaitable that restores."""
        iterator, kind = _target_iterator(directory, abstract_checkpointable)
        info = _read_info(directory)
        saved_kind = info.get("iterator_type") if info else None
        if saved_kind is not None and saved_kind != kind:
            raise IteratorStateError(
                f"Checkpointable {directory.name!r} was saved from {_kind_name(saved_kind)}, but "
                f"{_kind_name(kind)} was given to load it into; their states differ. Pass "
                f"{_kind_name(saved_kind)} over the same data."
            )
        file = _this_process_file(directory, info)

        async def restore() -> Any:
            state = _parse_state(file, kind)
            try:
                iterator.set_state(state)
            except Exception as e:  # Grain's own errors here are terse KeyErrors and the like.
                raise IteratorStateError(
                    f"The iterator given for {directory.name!r} rejected the saved state "
                    f"({type(e).__name__}: {e}). Load into a fresh iterator of the same pipeline "
                    f"(same sources, transformations, seeds and options) as the one saved."
                ) from e
            return iterator

        return restore()

    async def metadata(self, directory: epath.Path) -> GrainIteratorMetadata:
        """The saved iterator's kind and process count, from the files alone."""
        info = _read_info(directory)
        if info is not None:
            return GrainIteratorMetadata(
                iterator_type=info.get("iterator_type"),
                process_count=info["process_count"],
                grain_version=info.get("grain_version"),
            )
        counts = {n for _, n in _files.state_files(directory)}
        return GrainIteratorMetadata(
            iterator_type=None, process_count=counts.pop() if len(counts) == 1 else None
        )

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for ``grain.DatasetIterator`` and ``grain.DataLoader`` iterators."""
        return _grain_types.iterator_kind(checkpointable) is not None

    def unhandleable_reason(self, checkpointable: Any) -> str | None:
        """For a Grain dataset or data loader given to save: pass its iterator instead
        (``cp.protocols.ExplainsUnhandleable``). ``None`` for anything else, which is
        no concern of Grain's."""
        kind = _grain_types.source_kind(checkpointable)
        if kind is None:
            return None
        source = "data_loader" if kind == "DataLoader" else "dataset"
        return (
            f"a grain.{kind} has no position to save; save the iterator you draw from, "
            f"iter({source}), whose position is saved (a load may take the {kind} itself "
            f"and makes the iterator with iter())"
        )

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """True for Grain iterators, datasets and data loaders; undecided otherwise."""
        if _grain_types.iterator_kind(abstract_checkpointable) is not None:
            return True
        if _grain_types.is_iterable_source(abstract_checkpointable):
            return True
        return None

    @staticmethod
    def recognizes(directory: epath.Path) -> bool:
        """Whether ``directory`` holds per-process iterator states (for untyped checkpoints)."""
        return bool(_files.state_files(directory))

    async def verify(self, directory: epath.Path) -> list[str]:
        """Problems found in the stored states: missing processes, unreadable files."""
        try:
            info = _read_info(directory)
        except cp.errors.CheckpointError as e:
            return [str(e)]
        files = _files.state_files(directory)
        counts = sorted({n for _, n in files})
        if info is not None:
            counts = [info["process_count"]]
        if not counts:
            return [f"{directory} holds no process_<i>-of-<n>.json iterator state files."]
        kind = (info or {}).get("iterator_type") or DATASET_ITERATOR
        problems = []
        for count in counts:
            problems += _verify_states(directory, files, count, kind)
        return problems


# verify lists this many missing state files by name, then counts the rest.
_LISTED_MISSING = 10


def _verify_states(
    directory: epath.Path, files: dict[tuple[int, int], epath.Path], count: int, kind: str
) -> list[str]:
    """Problems of the states saved by ``count`` processes."""
    if not 1 <= count <= _files.MAX_PROCESS_COUNT:
        return [
            f"{directory / _files.state_file_name(0, count)} names {count:,} processes; a Grain "
            f"checkpoint is saved by 1 to {_files.MAX_PROCESS_COUNT:,}. The file name is damaged."
        ]
    missing = [i for i in range(count) if (i, count) not in files]
    problems = [
        f"{directory} lacks {_files.state_file_name(i, count)}." for i in missing[:_LISTED_MISSING]
    ]
    if len(missing) > _LISTED_MISSING:
        problems.append(
            f"{directory} lacks {len(missing) - _LISTED_MISSING:,} more of the {count:,} "
            f"processes' state files."
        )
    for (index, of), file in sorted(files.items()):
        if of != count or index >= count:
            continue
        try:
            _parse_state(file, kind)
        except cp.errors.CheckpointError as e:
            problems.append(str(e))
    return problems


@cp.hookimpl
def register_checkpointable_handlers(register: Any) -> None:
    """Registers the Grain handler at priority 10, ahead of the generic stateful
    handler (20), which would otherwise claim Grain iterators by their save/load methods."""
    register(GrainIteratorHandler, priority=10, name="grain", secondary_typestrs=_GRAIN_TYPESTRS)
