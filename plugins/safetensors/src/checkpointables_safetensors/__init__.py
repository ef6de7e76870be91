"""checkpointables plugin: Hugging Face safetensors files in and out.

Installed with ``pip install "checkpointables[safetensors]"`` and found
through the entry point ``safetensors`` (module
``checkpointables_safetensors.plugin``). Use it through the free functions
and the command line::

    import checkpointables as cp

    params = cp.load_pytree("gemma/model.safetensors")    # or a sharded set's directory
    abstract = cp.pytree_metadata("gemma/").metadata       # shapes and dtypes, no data read

    $ checkpointables export ckpt/1000 out/model.safetensors --subtree params
    $ checkpointables import gemma/ ckpt/gemma

The functions here do the same from Python. Guide: docs/safetensors.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointables.lazy import first_use_attributes

if TYPE_CHECKING:
    from checkpointables_safetensors._export import ExportResult, export_checkpoint, save_pytree
    from checkpointables_safetensors._import import ImportResult, import_safetensors
    from checkpointables_safetensors._reader import SafetensorsReader
    from checkpointables_safetensors._writer import DEFAULT_MAX_SHARD_SIZE, parse_size

__all__ = [
    "SafetensorsReader",
    "export_checkpoint",
    "save_pytree",
    "import_safetensors",
    "ExportResult",
    "ImportResult",
    "DEFAULT_MAX_SHARD_SIZE",
    "parse_size",
]


# Imported on first use: the plugin's entry point (plugin.py) is imported at every
# discovery, `checkpointables --help` too, which needs no JAX. Name -> its module.
_LAZY_NAMES: dict[str, str] = {
    "ExportResult": "checkpointables_safetensors._export",
    "export_checkpoint": "checkpointables_safetensors._export",
    "save_pytree": "checkpointables_safetensors._export",
    "ImportResult": "checkpointables_safetensors._import",
    "import_safetensors": "checkpointables_safetensors._import",
    "SafetensorsReader": "checkpointables_safetensors._reader",
    "DEFAULT_MAX_SHARD_SIZE": "checkpointables_safetensors._writer",
    "parse_size": "checkpointables_safetensors._writer",
}


if not TYPE_CHECKING:  # Type checkers see the imports above, so a typo stays an error.
    __getattr__, __dir__ = first_use_attributes(__name__, _LAZY_NAMES, __all__)
