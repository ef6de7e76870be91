"""checkpointables plugin: protocol buffer messages stored as ``<name>/proto.pbtxt``.

Any ``google.protobuf.message.Message`` can be a checkpointable::

    cp.save_checkpointables(path, {"config": config_message})
    cp.load_checkpointables(path, {"config": MyConfig})   # or None: found by type name

The file is protobuf text format, readable by people and by Orbax's
``ProtoHandler``; a header comment records the full message type name so a
load without the class can find it among the message types the program has
already imported. Nothing named in a checkpoint is ever imported.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import checkpointables as cp
from etils import epath

from checkpointables_proto import _textproto, _types
from checkpointables_proto._textproto import PROTO_FILE

__all__ = [
    "ProtoHandler",
    "MessageTypeNotFoundError",
    "MessageTypeMismatchError",
    "PROTO_FILE",
]

_ORBAX_TYPESTRS = (
    "orbax.checkpoint.experimental.v1._src.handlers.proto_handler.ProtoHandler",
    "orbax.checkpoint._src.handlers.proto_checkpoint_handler.ProtoCheckpointHandler",
)


class MessageTypeNotFoundError(cp.errors.MissingHandlerError):
    """Loading needs a message class that the program has not imported, or that is unrecorded.

    The message names the type; import the module that defines it (its
    ``_pb2``), or pass the class as the abstract checkpointable.
    """


class MessageTypeMismatchError(cp.errors.CheckpointError, TypeError):
    """The abstract checkpointable is not the message type that was saved."""


class ProtoHandler:
    """Saves protobuf messages as text format; loads them into their class.

    The abstract checkpointable is the message class (``{"config": MyConfig}``),
    an instance of it (only its type is used), the full type name, or ``None``
    to use the type recorded at save time.
    """

    async def save(
        self, directory: cp.path.PathAwaitingCreation, checkpointable: Any
    ) -> Awaitable[None]:
        """Renders the message now (messages are mutable), writes it in the background."""
        text = _textproto.render(checkpointable, directory.name)
        primary = cp.multihost.is_primary_host()

        async def write() -> None:
            path = await directory.await_creation()
            if primary:  # Every process holds the same message; one file is enough.
                _textproto.write_durably(path / PROTO_FILE, text)

        return write()

    async def load(
        self, directory: epath.Path, abstract_checkpointable: Any = None
    ) -> Awaitable[Any]:
        """Checks the type now; returns an awaitable that reads and parses the message."""
        file = _data_file(directory)
        text = _checked_text(file, directory)  # Before its header is trusted.
        recorded = _textproto.recorded_type_name(text, file)
        message_class = _message_class_for(directory, recorded, abstract_checkpointable)

        async def read() -> Any:
            return _parse(text, message_class, file)

        return read()

    async def metadata(self, directory: epath.Path) -> type | str | None:
        """The saved message type: its class if the program has imported it, else its
        full name; ``None`` for files that do not record it (written by Orbax)."""
        file = _data_file(directory)
        recorded = _textproto.recorded_type_name(_checked_text(file, directory), file)
        if recorded is None:
            return None
        return _types.find_message_class(recorded) or recorded

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for protobuf message instances."""
        return _types.is_message(checkpointable)

    def unhandleable_reason(self, checkpointable: Any) -> str | None:
        """For a message class given to save: pass an instance of it
        (``cp.protocols.ExplainsUnhandleable``); ``None`` for anything else, which is no
        concern of protobuf's."""
        if not _types.is_message_class(checkpointable):
            return None
        name = checkpointable.__qualname__
        return (
            f"{name} is a message class; save a message, an instance such as {name}(...) "
            f"(the class is what a load takes, to say which type to parse into)"
        )

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """True for message classes and instances; undecided for anything else."""
        if _types.is_message_class(abstract_checkpointable) or _types.is_message(
            abstract_checkpointable
        ):
            return True
        return None

    @staticmethod
    def recognizes(directory: epath.Path) -> bool:
        """Whether ``directory`` holds a ``proto.pbtxt`` (for checkpoints with no typestr)."""
        return cp.storage.is_file(directory / PROTO_FILE)

    async def verify(self, directory: epath.Path) -> list[str]:
        """Problems found in the stored message (empty when it is sound).

        The message is parsed when the program has imported its type; otherwise
        it can only be skimmed (tokens and braces), which catches truncation.
        """
        try:
            file = _data_file(directory)
            text = _checked_text(file, directory)
            recorded = _textproto.recorded_type_name(text, file)
            message_class = None if recorded is None else _types.find_message_class(recorded)
            if message_class is not None:
                _parse(text, message_class, file)
                return []
            problem = _textproto.skim(text)
        except (cp.errors.CheckpointError, OSError) as e:
            return [str(e)]
        return [] if problem is None else [f"{file} is damaged: {problem}."]


def _parse(text: str, message_class: Any, file: epath.Path) -> Any:
    """The message of type ``message_class`` that ``text``, read from ``file``, holds."""
    from google.protobuf import text_format

    name = file.parent.name
    try:
        return text_format.Parse(text, message_class())
    except RecursionError:  # Python's parser recurses once per nested message.
        raise cp.errors.IntegrityError(
            f"{file} nests its messages deeper than this program can parse; the "
            f"checkpointable {name!r} is damaged or hostile."
        ) from None
    except text_format.ParseError as e:
        problem = _textproto.quoted_problem(e)
        if "not found in descriptor pool" in str(e):
            # A google.protobuf.Any holding a type the program has not imported.
            raise MessageTypeNotFoundError(
                f"{file} holds a google.protobuf.Any whose type is not imported here "
                f"({problem}). Import the module that defines that type before loading."
            ) from e
        raise cp.errors.IntegrityError(
            f"{file} is not a valid text-format {_types.type_name(message_class)} "
            f"({problem}); the checkpointable {name!r} is damaged."
        ) from e


def _checked_text(file: epath.Path, directory: epath.Path) -> str:
    """The text of ``file``, checked against the checksum recorded at commit; a file
    larger than any metadata file is refused unread (``cp.errors.MetadataError``)."""
    try:
        raw = cp.metadata_checksums.read_file(file, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES)
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise cp.errors.IntegrityError(
            f"{file} is not UTF-8 text (byte {e.start}); the checkpointable {directory.name!r} "
            f"is damaged."
        ) from None


def _data_file(directory: epath.Path) -> epath.Path:
    file = directory / PROTO_FILE
    if not cp.storage.is_file(file):
        raise cp.errors.IntegrityError(
            f"{directory} holds no {PROTO_FILE}: the proto checkpointable {directory.name!r} "
            f"is missing its data. The checkpoint is damaged or was not written by a proto handler."
        )
    return file


def _message_class_for(directory: epath.Path, recorded: str | None, abstract: Any) -> type:
    """The class to parse into, from the abstract checkpointable and the recorded type."""
    name = directory.name
    quoted = _textproto.quoted_name  # A name given to load may be any string, however long.
    if _types.is_message(abstract):
        abstract = type(abstract)
    if _types.is_message_class(abstract):
        given = _types.type_name(abstract)
        if recorded is not None and given != recorded:
            raise MessageTypeMismatchError(
                f"Checkpointable {name!r} holds a {quoted(recorded)} message, but {given} was "
                f"given to load it into. Pass {quoted(recorded)} (or None to use the recorded "
                f"type)."
            )
        return abstract
    if abstract is not None and not isinstance(abstract, str):
        given = (
            f"the class {abstract.__qualname__}"
            if isinstance(abstract, type)
            else f"a {type(abstract).__qualname__}"
        )
        raise MessageTypeMismatchError(
            f"The abstract checkpointable for proto checkpointable {name!r} must be a message "
            f"class, a message, its full type name or None; got {given}."
        )
    if isinstance(abstract, str) and recorded is not None and abstract != recorded:
        raise MessageTypeMismatchError(
            f"Checkpointable {name!r} holds a {quoted(recorded)} message, not {quoted(abstract)}."
        )
    wanted = abstract if isinstance(abstract, str) else recorded
    if wanted is None:
        raise MessageTypeNotFoundError(
            f"{directory / PROTO_FILE} does not record its message type (it was written without "
            f"a '# proto-message:' header, e.g. by Orbax). Pass the message class: "
            f"load_checkpointables(path, {{{name!r}: MyMessage}})."
        )
    found = _types.find_message_class(wanted)
    if found is None:
        short = quoted(wanted.rsplit(".", 1)[-1])
        raise MessageTypeNotFoundError(
            f"Checkpointable {name!r} holds a {quoted(wanted)} message, and no module defining "
            f"{quoted(wanted)} has been imported. Import the module that defines it (its _pb2 "
            f"module) before loading, or pass the class: "
            f"load_checkpointables(path, {{{name!r}: {short}}}). Checkpoints never import "
            f"modules themselves."
        )
    return found


@cp.hookimpl
def register_checkpointable_handlers(register: Any) -> None:
    """Registers the proto handler ahead of the JSON and pytree handlers (priority 30),
    also reading what Orbax's proto handlers wrote."""
    register(ProtoHandler, priority=30, name="proto", secondary_typestrs=_ORBAX_TYPESTRS)
