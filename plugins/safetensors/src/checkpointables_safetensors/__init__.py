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
