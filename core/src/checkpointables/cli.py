"""The ``checkpointables`` command: ``plugins``, ``inspect``, ``verify``, ``demo``.

Plugins add more commands through the ``register_commands`` hook (the
safetensors plugin adds ``export`` and ``import``). Every command takes
``-q``/``--quiet``, which turns progress bars off (see ``cp.progress``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from collections.abc import Sequence
from typing import Any

from checkpointables import _cli_plugins

__all__ = ["main"]


def _plugins(args: argparse.Namespace) -> int:
    from checkpointables import handlers, plugins

    infos = plugins.list_plugins()
    if not infos:
        print("No plugins installed. pip install checkpointables for the pytree and JSON plugins.")
    for info in infos:
        where = f"{info.distribution or '?'} {info.version or ''}".strip()
        print(f"{info.name}  ({where})  [{info.status}]  {info.value}")
        if info.error:
            print(f"    error: {info.error}")
        for h in info.handlers:
            scope = f", only for {h.checkpointable_name!r}" if h.checkpointable_name else ""
            cls = handlers.typestr(h.handler_cls)
            recorded = f" (records {h.typestr})" if h.typestr != cls else ""
            print(f"    handler {h.name}: priority {h.priority}{scope}  {cls}{recorded}")
        for leaf in info.leaf_handlers:
            print(
                f"    leaf handler {leaf.handler_cls.__name__}: "
                f"{getattr(leaf.leaf_type, '__qualname__', leaf.leaf_type)}"
            )
        for reader in info.readers:
            print(f"    pytree reader {reader.name}: priority {reader.priority}")
        for command in info.commands:
            print(f"    command {command.name}: {command.help}")
        for storage in info.storages:
            print(f"    storage {storage.scheme}://")
        for option in info.options:
            print(f"    options {option.keyword}: {handlers.typestr(option.options_cls)}")
    print("\nSave resolution order (priority, name):")
    for i, h in enumerate(handlers.registered_handlers(), 1):
        print(f"  {i}. {h.name} ({h.priority}) from {h.plugin}")
    return 0


def _describe_leaf(leaf: Any) -> tuple[str, int | None]:
    """A leaf's line of ``inspect``, and its bytes (``None``: its metadata does not say)."""
    from checkpointables._verification import leaf_nbytes
    from checkpointables.serialization import AbstractArray, AbstractShardedArray

    if isinstance(leaf, AbstractArray) and leaf.shape is not None and leaf.dtype is not None:
        import numpy as np

        dtype = leaf.dtype
        # An extended dtype (PRNG keys: key<fry>) is shown and sized as it is.
        with contextlib.suppress(TypeError):
            dtype = np.dtype(dtype)
        sharding = leaf.sharding if isinstance(leaf, AbstractShardedArray) else None
        extra = f" sharding={sharding}" if sharding is not None else ""
        text = f"{type(leaf).__name__} shape={tuple(leaf.shape)} dtype={dtype}{extra}"
        return text, leaf_nbytes(leaf)
    if isinstance(leaf, type):
        return f"{leaf.__name__}", None
    # Metadata of scalars and strings is a placeholder of the stored type, not the value:
    # no size to show. A bytes leaf's metadata knows its size (its `nbytes`).
    return type(leaf).__name__, leaf_nbytes(leaf)


def _print_leaves(value: Any) -> int:
    """Prints one line per leaf of an abstract tree; returns the bytes of its arrays."""
    import jax

    from checkpointables import progress

    total = 0
    leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=lambda x: x is None)[0]
    if not leaves:
        print(f"  {value!r}"[:200])
    for keypath, leaf in leaves:
        text, size = _describe_leaf(leaf)
        shown = f"  {jax.tree_util.keystr(keypath) or '<root>'}: {text}"
        if size is None:
            print(shown)
            continue
        total += size
        print(f"{shown}  ({size:,} B)")
    progress.advance(total)
    return total


def _inspect(args: argparse.Namespace) -> int:
    from checkpointables import _loading, progress, readers
    from checkpointables.context import get_context

    if readers.reader_for(args.path) is not None:
        return _inspect_other_format(args.path)
    context = get_context()
    opened = _loading.open_for_load(args.path, context)
    path, meta = opened.path, opened.meta
    print(f"checkpoint {path}")
    for key in ("init_timestamp_nsecs", "commit_timestamp_nsecs"):
        value = meta.get(key)
        when = ""
        if isinstance(value, int):
            stamp = datetime.datetime.fromtimestamp(value / 1e9, tz=datetime.UTC)
            when = f"  ({stamp.isoformat(timespec='seconds')})"
        print(f"  {key}: {value}{when}")
    print(f"  custom_metadata: {meta.get('custom_metadata')}")
    _print_metrics(path, meta)
    _print_staging(meta)
    total = 0
    with progress.bytes_progress(None, "inspect"):
        for name, directory in _inspected_items(path, meta):
            recorded = opened.typestr(name, directory)
            print(f"\n{_printable(name)}/  {_escaped(_handler_line(recorded))}")
            try:
                value = _loading.item_metadata(directory, name, recorded, context)
            except Exception as e:  # Show what can be shown; the error names the problem.
                print(f"  cannot read metadata: {type(e).__name__}: {_escaped(str(e))}")
                continue
            total += _print_leaves(value)
            _print_reuse(directory, name, recorded, context)
    print(f"\ntotal array bytes: {total:,}")
    return 0


def _handler_line(recorded: str | None) -> str:
    """The recorded handler, and which installed plugin reads it (a checkpoint records
    Orbax's names where Orbax reads the data too, so the name alone does not say)."""
    from checkpointables import handlers

    if recorded is None:
        return "handler: unrecorded"
    found = next((r for r in handlers.registered_handlers() if r.matches_typestr(recorded)), None)
    if found is None:
        return f"handler: {recorded}  (no installed plugin reads it)"
    return f"handler: {recorded}  (read by plugin {found.plugin!r})"


def _print_reuse(directory: Any, name: str, recorded: str | None, context: Any) -> None:
    """Per array an incremental save tracked: written by it, or reused from which checkpoint."""
    from checkpointables import _loading
    from checkpointables.protocols import ReportsReuse

    try:
        handler = _loading.resolve_load_handler(directory, name, recorded, None, context)
        if not isinstance(handler, ReportsReuse):
            return
        with context:
            report = handler.reuse_report(directory)
    except Exception as e:  # Show the rest; the error names the problem.
        print(f"  reuse: cannot read: {type(e).__name__}: {_escaped(str(e))}")
        return
    if report:
        print("  incremental save (arrays of at least 64 KiB):")
    for array, source in sorted(report.items()):
        how = "written" if source is None else f"reused from {_printable(source)}"
        print(f"    {_printable(array)}: {how}")


def _printable(text: str) -> str:
    """``text`` as recorded, or quoted with escapes where it holds control characters (a
    forged record must not drive the terminal)."""
    return text if text.isprintable() else repr(text)


def _escaped(text: str, *, lines: bool = False) -> str:
    """``text`` with each control character written as its escape (``\\n``, ``\\x1b``): a
    name from a checkpoint inside a message must not drive the terminal or forge a line
    (``lines``: newlines are kept, for messages of several lines)."""
    if text.isprintable():
        return text
    kept = "\n" if lines else ""
    return "".join(c if c.isprintable() or c in kept else repr(c)[1:-1] for c in text)


def _print_staging(meta: dict[str, Any]) -> None:
    """The peak host memory the save staged (``cp.staging``), if it was recorded."""
    from checkpointables import staging

    peak = staging.recorded_peak(meta)
    if peak is not None:
        print(f"  peak staging memory of the save: {peak:,} bytes ({peak / 2**20:.1f} MiB)")


def _print_metrics(path: Any, meta: dict[str, Any]) -> None:
    from checkpointables import _step_metrics

    try:
        metrics = _step_metrics.read(path, meta)
    except Exception as e:  # Show the rest; the error names the file.
        print(f"  metrics: cannot read: {type(e).__name__}: {_escaped(str(e))}")
        return
    if metrics:
        print(f"  metrics: {metrics}")


def _inspect_other_format(path: str) -> int:
    """``inspect`` of a path a pytree reader recognizes (e.g. a safetensors file)."""
    from checkpointables import _pytree_api, progress

    with progress.bytes_progress(None, "inspect"):
        meta = _pytree_api.pytree_metadata(path)
        print(f"pytree {meta.path} (not a checkpoint: read by a pytree reader plugin)")
        print(f"  custom_metadata: {meta.custom_metadata}")
        total = _print_leaves(meta.metadata)
    print(f"\ntotal array bytes: {total:,}")
    return 0


def _inspected_items(path: Any, meta: dict[str, Any]) -> list[tuple[str, Any]]:
    from checkpointables import _loading, layout

    if isinstance(meta.get("item_handlers"), str):
        return [("<root>", path)]
    names = layout.checkpointable_directories(path, _loading.recorded_typestrs(meta))
    return [(n, path / n) for n in names]


def _verify(args: argparse.Namespace) -> int:
    from checkpointables import _verification

    findings = _verification.verify_checkpoint(args.path)
    print(f"checkpoint {args.path}")
    failures = 0
    for finding in findings:
        if finding.problem is not None:
            failures += 1
            print(f"{_escaped(finding.subject)}: FAILED {_escaped(finding.problem)}")
        else:
            print(f"{_escaped(finding.subject)}: {_escaped(finding.note or 'ok')}")
    print("all checks passed" if not failures else f"{failures} problem(s) found")
    return 1 if failures else 0


def _demo(args: argparse.Namespace) -> int:
    from checkpointables import demo

    return demo.main(args.directory, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``checkpointables`` command, with the plugins' commands."""
    parser = argparse.ArgumentParser(
        prog="checkpointables",
        description="Checkpointing for JAX: tools and a demo.",
        parents=[_cli_plugins.quiet_option(default=False)],
    )
    # Accepted after the command too; SUPPRESS keeps a -q given before it.
    common = _cli_plugins.quiet_option(default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plugins", help="list installed plugins and their handlers", parents=[common]
    )
    p.set_defaults(run=_plugins)
    p = sub.add_parser(
        "inspect",
        help="print what a checkpoint (or a file a plugin reads) holds, without loading arrays",
        parents=[common],
    )
    p.add_argument(
        "path", help="a checkpoint, a training root's step, or a file a plugin reads (s3:// too)"
    )
    p.set_defaults(run=_inspect)
    p = sub.add_parser(
        "verify",
        help="check every metadata file and read every chunk, as a load would; exit status 1 "
        "if a load would fail or return different values",
        parents=[common],
    )
    p.add_argument("path", help="a checkpoint (a local path, s3:// or gs://)")
    p.set_defaults(run=_verify)
    p = sub.add_parser(
        "demo", help="train a small JAX model with checkpoints, then resume it", parents=[common]
    )
    p.add_argument(
        "directory", nargs="?", default=None, help="where to write (default: a temp dir)"
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.set_defaults(run=_demo)
    _cli_plugins.add_plugin_commands(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    from checkpointables import errors, progress

    args = build_parser().parse_args(argv)
    progress.set_enabled(not args.quiet)
    try:
        return int(args.run(args))
    except (errors.CheckpointError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
        print(f"error: {_escaped(str(e), lines=True)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `checkpointables inspect ... | head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps interpreter exit quiet
        return 0


if __name__ == "__main__":
    sys.exit(main())
