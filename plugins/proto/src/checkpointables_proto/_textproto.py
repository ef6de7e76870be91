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

__all__ = ["PROTO_FILE", "render", "recorded_type_name", "skim", "write_durably"]

PROTO_FILE = "proto.pbtxt"
# The header is at the top; stop looking after this many comment lines so a
# damaged or huge file is never read whole just to find its type.
_MAX_HEADER_LINES = 32
_MESSAGE_LINE = re.compile(r"#\s*proto-message:\s*(\S+)\s*$")


def render(message: Any) -> str:
    """The file's contents for ``message``: header comments, then text format."""
    from google.protobuf import text_format

    descriptor = message.DESCRIPTOR
    header = f"# proto-file: {descriptor.file.name}\n# proto-message: {descriptor.full_name}\n"
    return header + text_format.MessageToString(message)


def recorded_type_name(file: epath.Path) -> str | None:
    """The full message type name in the header of ``file``, or ``None`` if unrecorded.

    Files written by Orbax have no header, hence no recorded type.
    """
    lines = cp.storage.read_bytes(file).decode("utf-8", errors="replace").splitlines()
    for line in lines[:_MAX_HEADER_LINES]:
        if not line.startswith("#"):
            return None
        match = _MESSAGE_LINE.match(line)
        if match is not None:
            return match.group(1)
    return None


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
