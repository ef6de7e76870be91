"""Leaf handler registries: which ``LeafHandler`` saves which leaf type."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from checkpointables import errors, plugins
from checkpointables.protocols import typestr


class AlreadyRegisteredTypeError(errors.CheckpointError, ValueError):
    """A leaf or abstract type is already registered to another handler."""


class UnregisteredTypeError(errors.CheckpointError, TypeError):
    """No leaf handler is registered for a type."""


_MEMBERS: dict[Any, frozenset[str] | None] = {}  # Per abstract type: looked up for every leaf.


def _protocol_members(cls: Any) -> frozenset[str] | None:
    """The member names of a ``typing.Protocol`` class, or ``None`` for other types."""
    try:
        return _MEMBERS[cls]
    except KeyError:
        members = _MEMBERS[cls] = _find_protocol_members(cls)
        return members
    except TypeError:  # An unhashable abstract type.
        return _find_protocol_members(cls)


def _find_protocol_members(cls: Any) -> frozenset[str] | None:
    if not getattr(cls, "_is_protocol", False):
        return None
    members: set[str] = set()
    for base in cls.__mro__:
        if base is object or base.__name__ in ("Protocol", "Generic"):
            continue
        members.update(getattr(base, "__annotations__", {}))
        members.update(n for n, v in vars(base).items() if callable(v) and not n.startswith("_"))
    return frozenset(members)


def abstract_matches(abstract: Any, abstract_type: Any) -> bool:
    """Whether an abstract leaf (an instance or a type) fits ``abstract_type``."""
    members = _protocol_members(abstract_type)
    if members is not None:
        return all(hasattr(abstract, m) for m in members)
    if isinstance(abstract, type):
        return isinstance(abstract_type, type) and issubclass(abstract, abstract_type)
    return isinstance(abstract_type, type) and isinstance(abstract, abstract_type)


def _narrower(a: Any, b: Any) -> bool:
    """Whether abstract type ``a`` is strictly narrower than ``b``."""
    ma, mb = _protocol_members(a), _protocol_members(b)
    if ma is not None and mb is not None:
        return ma > mb
    if ma is None and mb is not None:
        return all(hasattr(a, m) for m in mb) and a is not b
    if ma is None and mb is None:
        return a is not b and issubclass(a, b)
    return False


@attrs.frozen
class LeafEntry:
    """One registration: a leaf type, its abstract type and the handler class."""

    leaf_type: type
    abstract_type: Any
    handler_cls: type
    secondary_typestrs: tuple[str, ...] = ()

    @property
    def typestr(self) -> str:
        """The ``value_type`` recorded in tree metadata: the first secondary typestr, if any."""
        return self.secondary_typestrs[0] if self.secondary_typestrs else typestr(self.handler_cls)


class LeafHandlerRegistry:
    """An ordered set of ``(leaf_type, abstract_type, handler_cls)`` registrations.

    Lookups pick the most specific match: a subclass before its base class, a
    protocol with more members before one with fewer.
    """

    def __init__(self) -> None:
        self._entries: list[LeafEntry] = []

    def add(
        self,
        leaf_type: type,
        abstract_type: Any,
        handler_cls: type,
        *,
        override: bool = False,
        secondary_typestrs: Iterable[str] = (),
    ) -> LeafHandlerRegistry:
        """Registers ``handler_cls`` for ``leaf_type`` (saving) and ``abstract_type`` (loading).

        Raises:
          AlreadyRegisteredTypeError: ``leaf_type`` is registered to another
            handler and ``override`` is false.
        """
        entry = LeafEntry(leaf_type, abstract_type, handler_cls, tuple(secondary_typestrs))
        for existing in list(self._entries):
            if existing.leaf_type is leaf_type:
                if existing == entry:
                    return self
                if not override:
                    raise AlreadyRegisteredTypeError(
                        f"Leaf type {typestr(leaf_type)} is already handled by "
                        f"{typestr(existing.handler_cls)}; pass override=True to replace it."
                    )
                self._entries.remove(existing)
        self._entries.append(entry)
        return self

    def get_all(self) -> list[LeafEntry]:
        """Every registration, in the order added."""
        return list(self._entries)

    def _for_leaf(self, leaf_type: type) -> LeafEntry | None:
        for base in leaf_type.__mro__:
            for entry in self._entries:
                if entry.leaf_type is base:
                    return entry
        return None

    def get(self, leaf_type: type) -> type:
        """The handler class for saving leaves of ``leaf_type`` (nearest base class)."""
        entry = self._for_leaf(leaf_type)
        if entry is None:
            raise UnregisteredTypeError(
                f"No leaf handler is registered for {typestr(leaf_type)}; registered: "
                f"{[typestr(e.leaf_type) for e in self._entries]}."
            )
        return entry.handler_cls

    def entry_for_leaf(self, leaf_type: type) -> LeafEntry | None:
        """The registration used to save ``leaf_type``, or ``None``."""
        return self._for_leaf(leaf_type)

    def is_handleable(self, leaf_type: type) -> bool:
        """Whether some handler saves leaves of ``leaf_type``."""
        return self._for_leaf(leaf_type) is not None

    def entry_for_abstract(self, abstract: Any) -> LeafEntry | None:
        """The most specific registration whose abstract type fits ``abstract``."""
        matches = [e for e in self._entries if abstract_matches(abstract, e.abstract_type)]
        best: list[LeafEntry] = []
        for m in matches:
            if not any(_narrower(o.abstract_type, m.abstract_type) for o in matches if o is not m):
                best.append(m)
        return best[0] if best else None

    def get_abstract(self, abstract: Any) -> type:
        """The handler class for loading into ``abstract`` (an instance or a type)."""
        entry = self.entry_for_abstract(abstract)
        if entry is None:
            known = [getattr(e.abstract_type, "__name__", e.abstract_type) for e in self._entries]
            raise UnregisteredTypeError(
                f"No leaf handler accepts the abstract leaf {abstract!r}; registered abstract "
                f"types: {known}."
            )
        return entry.handler_cls

    def is_abstract_handleable(self, abstract: Any) -> bool:
        """Whether some handler loads into ``abstract``."""
        return self.entry_for_abstract(abstract) is not None

    def entry_for_typestr(self, recorded: str) -> LeafEntry | None:
        """The registration whose typestr or secondary typestr is ``recorded``."""
        for entry in self._entries:
            if recorded == typestr(entry.handler_cls) or recorded in entry.secondary_typestrs:
                return entry
        return None

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{e.leaf_type.__name__}->{e.handler_cls.__name__}" for e in self._entries
        )
        return f"{type(self).__name__}([{inner}])"


class StandardLeafHandlerRegistry(LeafHandlerRegistry):
    """A registry holding every leaf handler that plugins registered.

    With the pytree plugin installed that means ``jax.Array``, ``np.ndarray``,
    scalars and strings; add your own with ``add``.
    """

    def __init__(self) -> None:
        super().__init__()
        for r in plugins.leaf_registrations():
            self.add(
                r.leaf_type,
                r.abstract_type,
                r.handler_cls,
                override=True,
                secondary_typestrs=r.secondary_typestrs,
            )
