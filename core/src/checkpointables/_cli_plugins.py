"""The command line's shared option and the commands plugins add (``register_commands``)."""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # The plugins module is imported only when commands are listed.
    from checkpointables.plugins import CommandRegistration

__all__ = ["quiet_option", "add_plugin_commands", "plugin_commands", "registered_commands"]


def quiet_option(default: Any) -> argparse.ArgumentParser:
    """A parent parser holding ``-q``/``--quiet`` (progress bars off) with ``default``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default,
        help="show no progress bars (see cp.progress)",
    )
    return common


def registered_commands(*, commands_only: bool = False) -> tuple[CommandRegistration, ...]:
    """The commands plugins registered (``plugins.command_registrations``).

    ``commands_only``: unless plugins were discovered already, import each plugin and
    call its ``register_commands`` hook alone, not the hooks registering handlers and
    leaf types, which import what a command may not need (JAX, TensorStore). Where
    that fails (a plugin does not import, a registration is wrong), the plugins are
    discovered in full, whose warnings say what is wrong, as without this.
    """
    from checkpointables import plugins

    if commands_only and plugins._cached is None:  # Nothing discovered yet in this process.
        with contextlib.suppress(Exception):
            return _commands_alone()
    return plugins.command_registrations()


def _commands_alone() -> tuple[CommandRegistration, ...]:
    """What the enabled plugins' ``register_commands`` hooks register, in plugin order
    (as ``plugins.discover`` collects it); raises what a plugin raises."""
    import pluggy

    from checkpointables import hookspecs, plugins

    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    found: list[CommandRegistration] = []
    disabled = plugins._disabled_names()
    for ep in plugins._entry_points():
        if ep.name in disabled:
            continue
        manager.register(ep.load(), name=ep.name)

        def make(name: str, run: Any, plugin: str = ep.name, **kwargs: Any) -> Any:
            return plugins.make_command_registration(name, run, plugin=plugin, **kwargs)

        for impl in manager.hook.register_commands.get_hookimpls():
            if impl.plugin_name == ep.name:
                found += plugins._collect(impl.function, make)
    return tuple(found)


def plugin_commands(
    built_in: Iterable[str], commands: Iterable[CommandRegistration] | None = None
) -> list[tuple[CommandRegistration, str | None]]:
    """Each command plugins registered, with why it is skipped (``None``: it is added).

    ``built_in`` names the commands of ``checkpointables`` itself; ``commands`` are
    those plugins registered (default: ``plugins.command_registrations()``). Our
    plugins' commands come first (``PROJECT_DISTRIBUTIONS``: a third party never
    takes one of their names, whatever the order), then the others in plugin
    order, so of two third parties' commands with one name the first is added;
    one whose ``add_arguments`` fails is skipped. ``checkpointables plugins``
    shows the same answers the parser acts on.
    """
    from checkpointables import plugins

    taken = dict.fromkeys(built_in, "a built-in command")
    planned: list[tuple[CommandRegistration, str | None]] = []
    ours = _our_entry_points()
    registered = plugins.command_registrations() if commands is None else commands
    for command in sorted(registered, key=lambda c: c.plugin not in ours):  # Stable.
        reason: str | None
        if command.name in taken:
            reason = f"the name {command.name!r} is already taken by {taken[command.name]}"
        else:
            reason = _arguments_failure(command)
        if reason is None:
            taken[command.name] = f"the command of plugin {command.plugin!r}"
        planned.append((command, reason))
    return planned


def _our_entry_points() -> set[str]:
    """The entry points of our plugins (``PROJECT_DISTRIBUTIONS``), from the installed
    metadata alone: ``--help`` imports no plugin's handlers (nor JAX)."""
    import importlib_metadata

    from checkpointables import plugins

    installed = importlib_metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)
    return {
        ep.name
        for ep in installed
        if plugins.is_project_distribution(plugins.distribution_of(ep)[0])
    }


def _arguments_failure(command: CommandRegistration) -> str | None:
    """Why ``add_arguments`` fails, tried on a scratch parser (``None``: it works); a
    failing plugin must not break the other commands."""
    if command.add_arguments is None:
        return None
    try:
        command.add_arguments(argparse.ArgumentParser(add_help=False))
    except Exception as e:
        return f"adding its arguments failed: {type(e).__name__}: {e}"
    return None


def add_plugin_commands(
    sub: Any,
    common: argparse.ArgumentParser,
    commands: Iterable[CommandRegistration] | None = None,
) -> None:
    """Adds the commands plugins registered (``register_commands``; ``commands``: these
    instead); a clash is skipped."""
    from checkpointables.plugins import sentence

    for command, skipped in plugin_commands(sub.choices, commands):
        if skipped is not None:
            warnings.warn(
                f"plugin {command.plugin!r} registers the command {command.name!r}, which is "
                f"skipped: {sentence(skipped)}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        p = sub.add_parser(
            command.name, help=command.help, description=command.help, parents=[common]
        )
        if command.add_arguments is not None:
            command.add_arguments(p)
        p.set_defaults(run=command.run)
