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
import re
import sys
from collections.abc import Sequence
from typing import Any

from checkpointables import _cli_plugins

__all__ = ["main"]


def _plugins(args: argparse.Namespace) -> int:
    from checkpointables import handlers, plugins

    infos = plugins.list_plugins()
    # What the parser does with each plugin command: the listing must match what runs.
    skipped = {id(c): why for c, why in _cli_plugins.plugin_commands(_built_in_commands())}
    if not infos:
        print("No plugins installed. pip install checkpointables for the pytree and JSON plugins.")
    for info in infos:
        _print_plugin(info, skipped)
    print("\nSave resolution order (priority, name):")
    for i, h in enumerate(handlers.registered_handlers(), 1):
        print(f"  {i}. {h.name} ({h.priority}) from {h.plugin}")
    _print_typestr_clashes()
    return 0


def _print_plugin(info: Any, skipped: dict[int, str | None]) -> None:
    """One plugin's lines of ``checkpointables plugins``: what it registered, or, for one
    that loaded but registered nothing, that it is inactive and what its distribution is."""
    from checkpointables import handlers

    where = f"{info.distribution or '?'} {info.version or ''}".strip()
    registered = (
        info.handlers + info.leaf_handlers + info.readers + info.commands + info.storages
    ) + info.options
    status = "installed, inactive" if info.status == "loaded" and not registered else info.status
    print(f"{info.name}  ({where})  [{status}]  {info.value}")
    if info.error:
        print(f"    error: {info.error}")
    if status == "installed, inactive":
        summary = _distribution_summary(info.distribution)
        print(f"    registers nothing{f': {summary}' if summary else ''}")
    for h in info.handlers:
        scope = f", only for {h.checkpointable_name!r}" if h.checkpointable_name else ""
        # The class that runs, then, apart, the typestr it records and reads where that
        # differs: another library's class name (Orbax's), so each reads the other's data.
        cls = handlers.typestr(h.handler_cls)
        recorded = f" (records {h.typestr})" if h.typestr != cls else ""
        print(f"    handler {h.name}: priority {h.priority}{scope}  {cls}{recorded}")
        if h.secondary_typestrs:
            print(f"      also reads checkpoints recording: {', '.join(h.secondary_typestrs)}")
    for leaf in info.leaf_handlers:
        print(
            f"    leaf handler {leaf.handler_cls.__name__}: "
            f"{getattr(leaf.leaf_type, '__qualname__', leaf.leaf_type)}"
        )
    for reader in info.readers:
        print(f"    pytree reader {reader.name}: priority {reader.priority}")
    for command in info.commands:
        why = skipped.get(id(command))
        status = f"  [skipped: {_escaped(why)}]" if why is not None else ""
        print(f"    command {command.name}: {command.help}{status}")
    for storage in info.storages:
        print(f"    storage {storage.scheme}://")
    for option in info.options:
        print(f"    options {option.keyword}: {handlers.typestr(option.options_cls)}")


def _distribution_summary(distribution: str | None) -> str:
    """The installed distribution's one-line summary (its ``description``), or ``""``."""
    if distribution is None:
        return ""
    from importlib import metadata

    try:
        found = metadata.metadata(distribution)
    except metadata.PackageNotFoundError:
        return ""
    return _escaped(found["Summary"] or "") if "Summary" in found else ""


def _print_typestr_clashes() -> None:
    """Each typestr two handlers claim: checkpoints recording it are read by neither."""
    from checkpointables import handlers, plugins

    contested = plugins.contested_typestrs(handlers.registered_handlers())
    if not contested:
        return
    print(
        "\nTypestr clashes (neither handler reads or saves these until one is removed or forced):"
    )
    for claimed, claimants in contested.items():
        print(f"  {_escaped(claimed)}: claimed by")
        for r in claimants:
            print(f"    {_escaped(plugins.describe_claimant(r))}")


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
        shown = _recorded_sharding(getattr(leaf, "sharding_metadata", None))
        if shown is None and isinstance(leaf, AbstractShardedArray) and leaf.sharding is not None:
            shown = str(leaf.sharding)
        extra = f" sharding: {_escaped(shown)}" if shown is not None else ""
        text = f"{type(leaf).__name__} shape={tuple(leaf.shape)} dtype={dtype}{extra}"
        return text, leaf_nbytes(leaf)
    if isinstance(leaf, type):
        return f"{leaf.__name__}", None
    # Metadata of scalars and strings is a placeholder of the stored type, not the value:
    # no size to show. A bytes leaf's metadata knows its size (its `nbytes`).
    return type(leaf).__name__, leaf_nbytes(leaf)


def _recorded_sharding(record: Any) -> str | None:
    """The sharding an array was saved with, as its record (the pytree's ``_sharding``)
    says, whatever devices this machine has: ``mesh (data=2, model=4) spec P(None,
    'model')``. ``None`` when there is no record this can read."""
    if not isinstance(record, dict):
        return None
    kind = record.get("sharding_type")
    if kind == "SingleDeviceSharding":
        return f"device {record.get('device_str', '?')}"
    names, shape, spec = (record.get(k) for k in ("axis_names", "shape", "partition_spec"))
    if kind != "NamedSharding" or not (
        isinstance(names, list) and isinstance(shape, list) and isinstance(spec, list)
    ):
        return None
    axes = ", ".join(f"{name}={size}" for name, size in zip(names, shape, strict=False))

    def entry(part: Any) -> str:  # An axis name, several (a list), or None (replicated).
        return repr(tuple(part)) if isinstance(part, list) else repr(part)

    return f"mesh ({axes}) spec P({', '.join(map(entry, spec))})"


def _print_leaves(value: Any) -> int:
    """Prints one line per leaf of an abstract tree; returns the bytes of its arrays."""
    import jax

    from checkpointables import progress

    total = 0
    leaves = _naturally_sorted(
        jax.tree_util.tree_flatten_with_path(value, is_leaf=lambda x: x is None)[0]
    )
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


def _naturally_sorted(leaves: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """``(key path, leaf)`` pairs with string dict keys in natural order
    (``layout.natural_key``); other children (list items, dataclass fields, dict keys that
    are numbers, which JAX already orders by value) keep the order they flatten in."""
    import jax

    from checkpointables.layout import natural_key

    first_seen: dict[tuple[Any, ...], int] = {}  # Key path prefix -> its first leaf.
    for i, (keypath, _) in enumerate(leaves):
        for depth in range(1, len(keypath) + 1):
            first_seen.setdefault(tuple(keypath[:depth]), i)

    def key(item: tuple[Any, Any]) -> list[tuple[Any, ...]]:
        keypath = item[0]
        return [
            (0, natural_key(entry.key), entry.key)
            if isinstance(entry, jax.tree_util.DictKey) and isinstance(entry.key, str)
            else (1, first_seen[tuple(keypath[: depth + 1])])
            for depth, entry in enumerate(keypath)
        ]

    return sorted(leaves, key=key)


def _inspect(args: argparse.Namespace) -> int:
    from checkpointables import _loading, errors, progress, readers
    from checkpointables.context import get_context

    if readers.reader_for(args.path) is not None:
        return _inspect_other_format(args.path)
    context = get_context()
    try:
        opened = _loading.open_for_load(args.path, context)
    except errors.NotACheckpointError as e:
        raise errors.NotACheckpointError(_with_hint(str(e), args.path, "inspect")) from None
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
            _print_reuse(path, directory, name, recorded, context)
    print(f"\ntotal array bytes: {total:,}")
    return 0


def _handler_line(recorded: str | None) -> str:
    """The recorded handler, and which installed plugin reads it (a checkpoint records
    Orbax's names where Orbax reads the data too, so the name alone does not say)."""
    from checkpointables import handlers, plugins

    if recorded is None:
        return "handler: unrecorded"
    registered = handlers.registered_handlers()
    claimants = plugins.contested_typestrs(r for r in registered if r.matches_typestr(recorded))
    if claimants:
        who = " and ".join(repr(r.plugin) for r in claimants.get(recorded, ()))
        return f"handler: {recorded}  (claimed by plugins {who}: read by neither unless forced)"
    found = next((r for r in registered if r.matches_typestr(recorded)), None)
    if found is None:
        return f"handler: {recorded}  (no installed plugin reads it)"
    return f"handler: {recorded}  (read by plugin {found.plugin!r})"


def _print_reuse(
    checkpoint: Any, directory: Any, name: str, recorded: str | None, context: Any
) -> None:
    """Per array an incremental save tracked: written by it, or reused from which checkpoint."""
    from checkpointables import _loading, layout
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
    # Reused files are hard links or copies: the step stays whole when its source goes.
    notes = {s: _source_note(checkpoint, s) for s in set(report.values()) if s is not None}
    for array in sorted(report, key=layout.natural_key):
        source = report[array]
        how = "written" if source is None else f"reused from {_printable(source)}{notes[source]}"
        print(f"    {_printable(array)}: {how}")


def _source_note(checkpoint: Any, source: str) -> str:
    """What to add to ``reused from SOURCE`` where that checkpoint is gone: deleted, or
    this checkpoint's own name (a re-save over it, ``overwrite=True``, reused from the
    save it replaced, whose directory was then removed); ``""`` where it is there."""
    if source == checkpoint.name:
        return " (the save this one replaced; this checkpoint holds its own copy)"
    if _source_deleted(checkpoint, source):
        return " (since deleted; this checkpoint holds its own copy)"
    return ""


def _source_deleted(checkpoint: Any, source: str) -> bool:
    """Whether the checkpoint a reuse report names (by its name beside ``checkpoint``, or
    by its path) is gone; ``False`` when that cannot be told."""
    from checkpointables import errors, layout

    where = source if os.path.isabs(source) or "://" in source else checkpoint.parent / source
    try:
        return not layout.is_checkpoint(where)
    except (errors.CheckpointError, OSError):  # Unreachable: say nothing rather than "deleted".
        return False


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

    other = _other_format(args.path)
    # Else verify_checkpoint says a save to it did not finish: it is another format's data.
    if other is not None:
        findings = [_verification.Finding("checkpoint", other)]
    else:
        try:
            findings = _verification.verify_checkpoint(args.path)
        except FileNotFoundError as e:  # A load would fail: exit 1, as for any failed check.
            findings = [_verification.Finding("checkpoint", str(e))]
        if len(findings) == 1 and findings[0].subject == "checkpoint" and findings[0].problem:
            problem = _with_hint(findings[0].problem, args.path, "verify")
            findings = [_verification.Finding("checkpoint", problem)]
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


def _with_hint(message: str, path: str, command: str) -> str:
    """``message`` (``path`` is not a checkpoint) with its advice phrased for ``command``:
    which checkpoint to run it on instead (``layout.where_instead``), where ``path`` holds,
    or is inside, one."""
    from checkpointables import errors, layout
    from checkpointables.path._parse import as_path

    try:
        layout.validate_checkpoint_directory(as_path(path), command)
    except errors.NotACheckpointError as e:
        return str(e)
    except (OSError, ValueError):  # Refused otherwise now (deleted, say): the message stands.
        pass
    return message


def _other_format(path: str) -> str | None:
    """Why ``path``, which a pytree reader recognizes, is not a checkpoint to verify, and
    what reads it: the reader, and the commands its plugin adds (an ``import``, say);
    ``None`` when no reader recognizes it."""
    from checkpointables import readers

    reader = readers.reader_for(path)
    if reader is None:
        return None
    found = next(r for r in readers.registered_readers() if type(reader) is r.reader_cls)
    text = (
        f"{path} is not a checkpoint: it is {found.name} data (the pytree reader "
        f"{found.name!r} of plugin {found.plugin!r} recognizes it), which cp.load_pytree "
        f"loads and `checkpointables inspect` shows; verify checks checkpoints only."
    )
    commands = [
        f"`checkpointables {c.name}` ({c.help})"
        for c, skipped in _cli_plugins.plugin_commands(_built_in_commands())
        if c.plugin == found.plugin and skipped is None
    ]
    if commands:
        text += f" Plugin {found.plugin!r} adds the commands {', '.join(commands)}."
    return text


def _demo(args: argparse.Namespace) -> int:
    from checkpointables import demo

    return demo.main(args.directory, steps=args.steps)


def build_parser(*, commands_only: bool = False) -> argparse.ArgumentParser:
    """The argument parser of the ``checkpointables`` command, with the plugins' commands
    (``commands_only``: found calling plugins' ``register_commands`` alone, see
    ``_cli_plugins.registered_commands``)."""
    parser, sub, common = _built_in_parser()
    commands = _cli_plugins.registered_commands(commands_only=commands_only)
    _cli_plugins.add_plugin_commands(sub, common, commands)
    return parser


def _built_in_commands() -> list[str]:
    """The names of the commands of ``checkpointables`` itself (no plugin's)."""
    return list(_built_in_parser()[1].choices)


def _built_in_parser() -> tuple[argparse.ArgumentParser, Any, argparse.ArgumentParser]:
    """The parser with the built-in commands, its subparsers and the ``--quiet`` parent."""
    parser = argparse.ArgumentParser(
        prog="checkpointables",
        description="Checkpointing for JAX: tools and a demo.",
        parents=[_cli_plugins.quiet_option(default=False)],
    )
    # Accepted after the command too; SUPPRESS keeps a -q given before it.
    common = _cli_plugins.quiet_option(default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    p = _command(sub, common, "plugins", "list installed plugins and their handlers")
    p.set_defaults(run=_plugins)
    p = _command(
        sub,
        common,
        "inspect",
        "print what a checkpoint (or a file a plugin reads) holds, without loading arrays",
    )
    p.add_argument(
        "path", help="a checkpoint, a training root's step, or a file a plugin reads (s3:// too)"
    )
    p.set_defaults(run=_inspect)
    p = _command(
        sub,
        common,
        "verify",
        "check every metadata file and read every chunk, as a load would; exit status 1 "
        "if a load would fail or return different values",
    )
    p.add_argument("path", help="a checkpoint (a local path, s3:// or gs://)")
    p.set_defaults(run=_verify)
    p = _command(sub, common, "demo", "train a small JAX model with checkpoints, then resume it")
    p.add_argument(
        "directory", nargs="?", default=None, help="where to write (default: a temp dir)"
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.set_defaults(run=_demo)
    return parser, sub, common


def _command(sub: Any, common: argparse.ArgumentParser, name: str, text: str) -> Any:
    """Adds built-in command ``name``; ``text`` is both its line in ``--help`` and the
    description its own ``--help`` opens with (as plugins' commands have)."""
    return sub.add_parser(name, help=text, description=text, parents=[common])


def _with_dashed_values_joined(argv: Sequence[str], options: dict[str, bool]) -> list[str]:
    """``argv`` with ``--option -5GB`` written ``--option=-5GB``, for the long options
    that take a value (``options``: ``_long_options``), named in full or abbreviated.

    argparse takes a word starting with ``-`` for an option unless it is a plain
    number (``-5``, ``-0.5``), so ``--max-shard-size -5GB`` would fail with
    "expected one argument"; joined, the value reaches the option, whose own error
    says what is wrong with it, as for ``--max-shard-size=-5GB``. No option name
    starts with a digit, so no option is lost; after ``--`` nothing is touched.
    """
    joined: list[str] = []
    words = list(argv)
    while words:
        word = words.pop(0)
        if word == "--":
            return [*joined, word, *words]
        if _takes_value(word, options) and words and _is_dashed_value(words[0]):
            word = f"{word}={words.pop(0)}"
        joined.append(word)
    return joined


def _long_options(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """The long options of ``parser`` and of its commands, each with whether it takes a
    value (``False`` where any command has it take none)."""
    found: dict[str, bool] = {}

    def add(option: str, takes_value: bool) -> None:
        found[option] = found.get(option, True) and takes_value

    for action in parser._actions:  # argparse lists no actions publicly.
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                for option, takes_value in _long_options(command).items():
                    add(option, takes_value)
        else:
            for option in action.option_strings:
                if option.startswith("--"):
                    add(option, action.nargs != 0)
    return found


def _takes_value(word: str, options: dict[str, bool]) -> bool:
    """Whether ``word`` names a long option that takes a value: in full, or by a prefix
    of it alone, as argparse accepts (``--max-shard`` for ``--max-shard-size``)."""
    if word in options:
        return options[word]
    if not word.startswith("--") or len(word) < 3:
        return False
    matching = [option for option in options if option.startswith(word)]
    return len(matching) == 1 and options[matching[0]]


def _is_dashed_value(word: str) -> bool:
    """Whether ``word`` starts with ``-`` and a digit but argparse takes it for an option."""
    return bool(re.match(r"-\d", word)) and not re.fullmatch(r"-\d+|-\d*\.\d+", word)


def _parsed(parser: argparse.ArgumentParser, words: Sequence[str]) -> argparse.Namespace:
    return parser.parse_args(_with_dashed_values_joined(words, _long_options(parser)))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    from checkpointables import errors, progress

    words = sys.argv[1:] if argv is None else argv
    # `--help`, a wrong argument and the built-in commands need only the plugins' commands:
    # no plugin's handlers, which import JAX (a second or two). A plugin's command is
    # parsed again as all plugins register it, so it runs only where its plugin loads.
    args = _parsed(build_parser(commands_only=True), words)
    if args.command not in _built_in_commands():
        args = _parsed(build_parser(), words)
    progress.set_enabled(not args.quiet)
    try:
        return int(args.run(args))
    except BrokenPipeError:  # e.g. `checkpointables inspect ... | head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps interpreter exit quiet
        return 0
    # The library's errors, and the system's about the paths given (a symbolic link loop,
    # no permission): said in one line, not a traceback.
    except (errors.CheckpointError, OSError) as e:
        print(f"error: {_escaped(str(e), lines=True)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
