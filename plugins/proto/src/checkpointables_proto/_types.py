"""Recognizing protobuf messages and finding message classes, without importing anything new.

Nothing here imports protobuf unless the program already has: a message object
cannot exist before ``google.protobuf.message`` is imported, so the plugin
costs nothing to programs that never use protobuf.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_message", "is_message_class", "find_message_class", "type_name"]

_MESSAGE_MODULE = "google.protobuf.message"


def _message_base() -> type | None:
    module = sys.modules.get(_MESSAGE_MODULE)
    return None if module is None else module.Message


def is_message(obj: Any) -> bool:
    """Whether ``obj`` is a protobuf message instance."""
    base = _message_base()
    return base is not None and isinstance(obj, base)


def is_message_class(obj: Any) -> bool:
    """Whether ``obj`` is a protobuf message class (a generated or dynamic one)."""
    base = _message_base()
    return base is not None and isinstance(obj, type) and issubclass(obj, base) and obj is not base


def type_name(message_class: Any) -> str:
    """The full name of a message class, e.g. ``google.protobuf.Duration``."""
    return str(message_class.DESCRIPTOR.full_name)


def find_message_class(full_name: str) -> type | None:
    """The class of message type ``full_name`` if the program has already loaded it.

    Looks only in protobuf's default descriptor pool, which holds the types of
    every generated ``_pb2`` module imported so far (and files added to it on
    purpose). Never imports a module: a checkpoint must not choose code to run.
    """
    from google.protobuf import descriptor_pool, message_factory

    try:
        descriptor = descriptor_pool.Default().FindMessageTypeByName(full_name)
    except KeyError:
        return None
    return message_factory.GetMessageClass(descriptor)
