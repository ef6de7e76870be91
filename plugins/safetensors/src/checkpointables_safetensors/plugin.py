"""The safetensors plugin's hook implementations (entry point ``safetensors``).

It registers ``SafetensorsReader`` (so ``cp.load_pytree`` and
``cp.pytree_metadata`` read safetensors paths) and the ``export`` and
``import`` commands of ``checkpointables``. Importing this module is cheap:
the ``safetensors`` package is imported only when a file is read or written.
"""

from __future__ import annotations

from typing import Any

import checkpointables as cp

from checkpointables_safetensors import _commands

PRIORITY = 50


@cp.hookimpl
def register_pytree_readers(register: Any) -> None:
    """Registers ``SafetensorsReader`` as ``safetensors``."""
    # Here, not at the top: the reader imports JAX, which listing commands does not need.
    from checkpointables_safetensors._reader import SafetensorsReader

    register(SafetensorsReader, priority=PRIORITY, name="safetensors")


@cp.hookimpl
def register_commands(register: Any) -> None:
    """Adds ``checkpointables export`` and ``checkpointables import``."""
    _commands.register_all(register)
