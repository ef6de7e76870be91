"""``checkpointables export`` and ``checkpointables import``, added through ``register_commands``.

The work is imported only when a command runs, so listing commands stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["register_all"]


def _size(text: str) -> int:
    from checkpointables_safetensors._writer import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _host_memory(text: str) -> int:
    import checkpointables as cp

    size = _size(text)
    if size < cp.options.MIN_HOST_BYTES:
        # The bound cp.options.MemoryOptions refuses below, said in the command's own terms.
        least = f"{cp.options.MIN_HOST_BYTES // (1 << 20)}MiB"
        raise argparse.ArgumentTypeError(
            f"{text!r} is below the smallest workable budget, {least} (arrays move in pieces "
            f"of an eighth of the budget, at least 1 MiB each); pass at least {least}, or "
            f"leave --host-memory out for no bound"
        )
    return size


def _add_host_memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host-memory",
        type=_host_memory,
        default=None,
        metavar="SIZE",
        help="hold at most this much host memory for arrays at once (e.g. 4GiB; default: "
        "no bound), as cp.options.MemoryOptions(host_bytes=...) does (docs/memory.md)",
    )


@contextlib.contextmanager
def _within(host_bytes: int | None) -> Iterator[None]:
    """The context of a command given ``--host-memory`` (none without it)."""
    if host_bytes is None:
        yield
        return
    import checkpointables as cp

    with cp.Context(memory_options=cp.options.MemoryOptions(host_bytes=host_bytes)):
        yield


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint holding a pytree")
    parser.add_argument(
        "out", help="the .safetensors file to write, or a directory (for model.safetensors)"
    )
    parser.add_argument(
        "--subtree",
        default=None,
        help="export only this subtree, a key path joined with dots (e.g. params)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=_size,
        default="5GB",
        help="above this, write Hub-style shards and an index (default 5GB; e.g. 500MB, 2GiB)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing files")
    _add_host_memory(parser)


def _export(args: argparse.Namespace) -> int:
    from checkpointables_safetensors._export import export_checkpoint

    try:
        with _within(args.host_memory):
            result = export_checkpoint(
                args.checkpoint,
                args.out,
                subtree=args.subtree,
                max_shard_size=args.max_shard_size,
                overwrite=args.overwrite,
            )
    except (KeyError, ValueError) as e:  # A wrong --subtree, or dtypes safetensors lacks.
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(f"wrote {result.tensors} tensors ({result.nbytes:,} B) to:")
    for file in result.files:
        print(f"  {file}")
    if result.skipped:
        skipped = list(result.skipped)
        print(
            f"skipped {len(skipped)} leaves safetensors cannot hold (not arrays, or PRNG keys: "
            f"RNG state, not weights): {skipped}"
        )
    return 0


def _import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="a .safetensors file, a .safetensors.index.json, or a directory of them"
    )
    parser.add_argument("checkpoint", help="the checkpoint to write (must not exist)")
    _add_host_memory(parser)


def _import(args: argparse.Namespace) -> int:
    from checkpointables_safetensors._import import import_safetensors

    with _within(args.host_memory):
        result = import_safetensors(args.source, args.checkpoint)
    print(
        f"wrote {result.tensors} tensors ({result.nbytes:,} B) from {len(result.files)} file(s) "
        f"to the checkpoint {result.checkpoint}"
    )
    return 0


def register_all(register: Any) -> None:
    """Registers both commands with ``register_commands``' callback."""
    register(
        "export",
        _export,
        help="write a checkpoint's pytree (or a subtree) as Hugging Face safetensors",
        add_arguments=_export_arguments,
    )
    register(
        "import",
        _import,
        help="write safetensors data (a file, an index or a directory) as a checkpoint",
        add_arguments=_import_arguments,
    )
