"""Public names a package imports the first time they are asked for, not with the package.

A plugin's entry point is imported at every plugin discovery, ``checkpointables --help``
too: a package whose ``__init__`` imports JAX makes every command wait for it. Name each
public name's module instead, and keep the real imports for type checkers::

    from typing import TYPE_CHECKING

    from checkpointables.lazy import first_use_attributes

    if TYPE_CHECKING:
        from my_plugin._handler import MyHandler

    __all__ = ["MyHandler"]

    if not TYPE_CHECKING:  # Type checkers see the imports, so a typo stays an error.
        __getattr__, __dir__ = first_use_attributes(
            __name__, {"MyHandler": "my_plugin._handler"}, __all__
        )
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def first_use_attributes(
    package: str, names: Mapping[str, str | tuple[str, str]], public: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose public names load on first use.

    Args:
      package: the package's ``__name__``.
      names: each name -> the module defining it, or (module, its name there) for an alias.
      public: the package's ``__all__``.

    Returns:
      The two functions, to assign to the package's ``__getattr__`` and ``__dir__``. Any
      other name the package has a submodule of is that submodule, as if the package had
      imported it (``pkg.tree.MAX_DEPTH`` after ``import pkg``). A name asked for once is
      stored in the package, so later lookups do not come back here.
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            where = names[name]
            module, attribute = (where, name) if isinstance(where, str) else where
            value = getattr(importlib.import_module(module), attribute)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
