"""Every hook a checkpointables plugin can implement.

A plugin is a module named by an entry point in the group ``checkpointables``.
It implements any of these hooks with ``@checkpointables.hookimpl``::

    import checkpointables as cp

    @cp.hookimpl
    def register_checkpointable_handlers(register):
        register(PointHandler, priority=50)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME", "PLUGIN_API_VERSION"]

PROJECT_NAME = "checkpointables"
# Bumped when a hook changes incompatibly; plugins may check it.
PLUGIN_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_checkpointable_handlers(register: Callable[..., Any]) -> None:
    """Registers checkpointable handlers.

    Called once per plugin when handlers are first needed (the first save,
    load or listing), and again after ``cp.plugins.refresh()``.

    Args:
      register: call it as ``register(handler_cls, *, priority=None, name=None,
        checkpointable_name=None, secondary_typestrs=(), typestr=None)`` for
        each handler. Lower priority values are tried earlier when saving; ties
        are broken by name. ``typestr`` is what checkpoints record for the
        handler (default ``module.qualname`` of the class): a handler writing
        another library's format records that library's typestr, so that
        library reads the checkpoint. ``secondary_typestrs`` are other
        typestrs (e.g. older names) the handler can load.

    Returns:
      Nothing.
    """


@hookspec
def register_leaf_handlers(register: Callable[..., Any]) -> None:
    """Registers pytree leaf handlers.

    Called once per plugin when a ``StandardLeafHandlerRegistry`` is first
    built, and again after ``cp.plugins.refresh()``.

    Args:
      register: call it as ``register(leaf_type, abstract_type, handler_cls,
        *, secondary_typestrs=())``.

    Returns:
      Nothing.
    """


@hookspec
def register_pytree_readers(register: Callable[..., Any]) -> None:
    """Registers readers of pytrees stored in other formats than checkpoints.

    ``cp.load_pytree``, ``cp.load_pytree_async`` and ``cp.pytree_metadata``
    consult readers for a path that is not a checkpoint directory (no
    ``_CHECKPOINT_METADATA``): the first, by ``(priority, name)``, whose
    ``recognizes(path)`` is true reads it. A reader meets
    ``cp.protocols.PyTreeReader``. Called once per plugin, like the other hooks.

    Args:
      register: call it as ``register(reader_cls, *, priority=None, name=None)``.
        ``reader_cls`` must be constructible with no arguments; lower priority
        values are asked first (default 50); ``name`` defaults to the class name
        without ``Reader``, lower-cased.

    Returns:
      Nothing.
    """


@hookspec
def register_commands(register: Callable[..., Any]) -> None:
    """Adds subcommands to the ``checkpointables`` command line.

    Called once per plugin, when the command line starts (plugins are loaded
    then, as for ``checkpointables plugins``).

    Args:
      register: call it as ``register(name, run, *, help, add_arguments=None)``.
        ``add_arguments(parser)`` adds the command's arguments to its
        ``argparse.ArgumentParser``; ``run(args)`` runs it with the parsed
        ``argparse.Namespace`` (which also holds the global ``quiet`` flag)
        and returns the exit status. A name taken by a built-in command or an
        earlier plugin is skipped with a warning.

    Returns:
      Nothing.
    """


@hookspec
def register_storage(register: Callable[..., Any]) -> None:
    """Registers storage backends for URL schemes (``s3://``, ``gs://``, ...).

    Called once per plugin when a path with a scheme is first used, and again
    after ``cp.plugins.refresh()``. See ``cp.storage``.

    Args:
      register: call it as ``register(scheme, factory)``, e.g. ``register("s3",
        factory)``, where ``factory(context)`` returns a ``cp.storage.Storage``
        configured by ``context`` (a ``cp.Context``; its ``storage_options``).

    Returns:
      Nothing.
    """


@hookspec
def register_options(register: Callable[..., Any]) -> None:
    """Adds option classes to ``cp.Context`` and ``cp.configure``, each under a keyword.

    Settings that only a plugin uses belong to it (as fsspec hands storage
    options to the backend that owns them): the pytree plugin registers
    ``array_options`` and ``storage_options`` this way. Called once per plugin
    when plugins are discovered: never at ``import checkpointables``, but when a
    keyword core does not know is passed to ``cp.Context(...)`` or
    ``cp.configure(...)``, when such a keyword is read (``context.<keyword>``),
    or when ``cp.options.<Name>`` names no class of core's.

    Args:
      register: call it as ``register(keyword, options_cls, *, parts=())``. ``keyword`` is an
        identifier ending in ``_options`` that core and earlier plugins (by
        name) did not take; ``options_cls`` is a class constructible with no
        arguments (that instance is the default) whose instances are
        immutable (e.g. ``attrs.frozen``). Then ``cp.Context(keyword=...)``
        accepts its instances, ``context.<keyword>`` and
        ``context.options(options_cls)`` return the one in force, and
        ``cp.options.<class name>`` is the class. ``parts`` are classes its
        fields take (e.g. ``ArrayStorageOptions`` inside ``ArrayOptions``),
        also offered as ``cp.options.<class name>``.

    Returns:
      Nothing.
    """
