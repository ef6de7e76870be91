"""The command line's shared option and the commands plugins add (``register_commands``)."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

__all__ = ["quiet_option", "add_plugin_commands"]


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


def add_plugin_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Adds the commands plugins registered (``register_commands``); a clash is skipped."""
    from checkpointables import plugins

    for command in plugins.command_registrations():
        if command.name in sub.choices:
            warnings.warn(
                f"plugin {command.plugin!r} registers the command {command.name!r}, which is "
                f"already taken; it is skipped.",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        try:  # On a scratch parser first: a failing plugin must not break the others.
            if command.add_arguments is not None:
                command.add_arguments(argparse.ArgumentParser(add_help=False))
        except Exception as e:
            warnings.warn(
                f"plugin {command.plugin!r} failed to add the arguments of its command "
                f"{command.name!r}, which is skipped: {type(e).__name__}: {e}",
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
