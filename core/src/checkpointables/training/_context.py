"""Which options a Checkpointer call runs with.

Three levels, innermost first: a ``cp.Context`` entered around the call (after
the Checkpointer was created), the Checkpointer's ``context=``, then whatever
was in force when the Checkpointer was created (an enclosing ``Context`` or
the global defaults).

This reads ``Context``'s private chain (``_parent``, ``_overrides``) and the
active-context variable, because layering the call's context over the
Checkpointer's needs to know which options the call's context set itself.
"""

from __future__ import annotations

from typing import Any

from checkpointables import context as context_lib
from checkpointables.context import Context


def active() -> Context | None:
    """The innermost entered ``Context``, or ``None``."""
    return context_lib._active.get()


def base_context(context: Context | None) -> Context:
    """The Checkpointer's own context: ``context`` over what is in force now."""
    ambient = context_lib.get_context()
    if context is None:
        return Context(ambient)
    return Context(ambient, **_own_overrides(context, stop=None))


def _own_overrides(context: Context, stop: Context | None) -> dict[str, Any]:
    """The options set by ``context`` and its parents up to (excluding) ``stop``."""
    chain = []
    current: Context | None = context
    while current is not None and current is not stop:
        chain.append(current)
        current = current._parent
    overrides: dict[str, Any] = {}
    for c in reversed(chain):  # Outermost first, so inner settings win.
        overrides.update(c._overrides)
    return overrides


def for_call(base: Context, ambient_at_creation: Context | None) -> Context:
    """The context of one call: a ``Context`` entered since creation, layered over ``base``."""
    current = active()
    if current is None or current is base or current is ambient_at_creation:
        return base
    overrides = _own_overrides(current, stop=ambient_at_creation)
    return Context(base, **overrides) if overrides else base
