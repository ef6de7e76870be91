"""The ``proto.pbtxt`` file: protobuf text format with a header naming the message type.

The header uses the comment convention of protobuf text format files
(``# proto-file:`` and ``# proto-message:``). Text format parsers skip comments,
so Orbax's ``ProtoHandler`` and ``text_format.Parse`` read the file unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import checkpointables as cp
from etils import epath

__all__ = [
    "PROTO_FILE",
    "render",
    "check_size",
    "recorded_type_name",
    "skim",
    "write_durably",
    "quoted_problem",
    "quoted_name",
    "MAX_NAME_CHARS",
]

PROTO_FILE = "proto.pbtxt"
# The header is at the top; stop looking after this many comment lines so a
# damaged or huge file is never read whole just to find its type.
_MAX_HEADER_LINES = 32
_MESSAGE_LINE = re.compile(r"#\s*proto-message:(.*)")
# A message type's full name: dot-separated identifiers (``google.protobuf.Duration``).
_FULL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
# protoc refuses packages of 512 characters or more and messages nested 32 deep; no
# real full name comes near this, and a recorded one beyond it is damage (or a forged
# header whose name every error would otherwise quote, megabytes at a time).
MAX_NAME_CHARS = 4096
# How much of a type name an error quotes (a name given to load may be any string).
_MAX_QUOTED_NAME = 200
# How much of a parser's message an error quotes: it quotes the offending line whole.
_MAX_QUOTED = 300


def render(message: Any, name: str) -> str:
    """The file's contents for ``message`` (checkpointable ``name``): header comments,
    then text format.

    Raises:
      cp.errors.InvalidArgumentError: protobuf cannot write the message as text (nested
        too deeply), or the file would exceed ``MAX_FILE_BYTES`` (see ``check_size``).
    """
    from google.protobuf import message as message_lib
    from google.protobuf import text_format

    descriptor = message.DESCRIPTOR
    header = f"# proto-file: {descriptor.file.name}\n# proto-message: {descriptor.full_name}\n"
    try:
        text = header + text_format.MessageToString(message)
    except (message_lib.Error, RecursionError) as e:
        raise cp.errors.InvalidArgumentError(
            f"Checkpointable {name!r}, a {descriptor.full_name} message, cannot be written as "
            f"text format ({type(e).__name__}: {quoted_problem(e)}). Protobuf refuses messages "
            f"nested more deeply than it can read back (100 levels, a Struct in a Struct "
            f"counting two); flatten the message."
        ) from None
    check_size(text, name)
    return text


def check_size(text: str, name: str) -> None:
    """Refuses the text of checkpointable ``name`` if its file would hold more than
    ``cp.metadata_checksums.MAX_FILE_BYTES``, which the checkpoint's checksums cover."""
    limit = cp.metadata_checksums.MAX_FILE_BYTES
    if len(text) <= limit // 4:  # No character takes more than 4 bytes of UTF-8.
        return
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    if size > limit:
        raise cp.errors.InvalidArgumentError(
            f"Checkpointable {name!r} is {size:,} bytes of text format, more than the {limit:,} "
            f"a {PROTO_FILE} may hold (a larger file would not be covered by the checkpoint's "
            f"checksums). Store large data as arrays in a pytree checkpointable, which "
            f"checksums every chunk, and keep the message small."
        )


def quoted_problem(error: BaseException) -> str:
    """The text of ``error``, cut to a few hundred characters (a parser quotes whole lines)."""
    text = str(error)
    if len(text) <= _MAX_QUOTED:
        return text
    return f"{text[:_MAX_QUOTED]}... (cut from {len(text):,} characters)"


def quoted_name(name: str) -> str:
    """A message type name for an error message, cut to a couple of hundred characters."""
    if len(name) <= _MAX_QUOTED_NAME:
        return name
    return f"{name[:_MAX_QUOTED_NAME]}... (cut from {len(name):,} characters)"


def recorded_type_name(text: str, file: epath.Path) -> str | None:
    """The full message type name in the header of ``file``'s ``text``, or ``None`` if
    unrecorded.

    Files written by Orbax have no header, hence no recorded type.

    Raises:
      cp.errors.IntegrityError: the ``# proto-message:`` header records something that
        is no message type's full name (a save always records one).
    """
    lines = text.split("\n", _MAX_HEADER_LINES)
    for line in lines[:_MAX_HEADER_LINES]:
        if not line.startswith("#"):
            return None
        match = _MESSAGE_LINE.match(line)
        if match is not None:
            return _checked_name(match.group(1).strip(), file)
    return None


def _checked_name(name: str, file: epath.Path) -> str:
    if len(name) <= MAX_NAME_CHARS and _FULL_NAME.fullmatch(name):
        return name
    raise cp.errors.IntegrityError(
        f"{file} records the message type {quoted_name(name)!r} in its '# proto-message:' "
        f"header, which is no protobuf full name (identifiers joined by dots, at most "
        f"{MAX_NAME_CHARS:,} characters, as every save writes). The checkpointable "
        f"{file.parent.name!r} is damaged: load an older checkpoint, or put the message's "
        f"full type name (e.g. google.protobuf.Duration) back in the header."
    )


def skim(text: str) -> str | None:
    """A problem found in ``text`` without knowing its message type, or ``None``.

    Only checks what needs no schema: that it tokenizes and that its braces
    balance, which catches truncated and garbled files.
    """
    from google.protobuf import text_format

    depth = 0
    tokenizer = text_format.Tokenizer(text.splitlines())
    while not tokenizer.AtEnd():
        token = tokenizer.token
        if token in ("{", "<"):
            depth += 1
        elif token in ("}", ">"):
            depth -= 1
            if depth < 0:
                return f"an unmatched {token!r}"
        tokenizer.NextToken()
    if depth:
        return f"{depth} unclosed brace(s): the file is truncated"
    return None


def write_durably(path: epath.Path, text: str) -> None:
    """Writes ``text`` to ``path`` (a local file or an object) durably before returning."""
    cp.storage.write_text(path, text, durable=True)
