"""Which distribution's leaf handler saved a tree's custom leaves: recorded, and named on load.

A save records, in ``_METADATA``'s own field (``"checkpointables"``, which
Orbax ignores), the distribution (name and version) of each plugin whose leaf
handler wrote some of its leaves, by the value type it recorded::

    "leaf_handler_distributions": {"acme_ckpt.handlers.QuantArrayLeafHandler":
                                   {"distribution": "acme-ckpt", "version": "0.3.1"}}

A load that finds no leaf handler for a value type names that distribution,
so that the user knows what to install. The record is a hint, never a source
of code: nothing it names is imported, at most ``MAX_RECORDED`` entries are
read, and a name or version that does not look like one is ignored (the
checks of ``cp.checkpoint_metadata.recorded_distribution``). The pytree
plugin's own leaf handlers are not recorded: every load of a pytree has them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import checkpointables as cp

from checkpointables_pytree.storage import listing

__all__ = ["FIELD", "MAX_RECORDED", "of_handlers", "recorded", "merged", "missing_message"]

FIELD = "leaf_handler_distributions"
# A tree records a handful of custom leaf handlers; a record of more is not read (nor written:
# the first ones by value type are kept), so a forged one costs nothing.
MAX_RECORDED = 64
_OWN_PACKAGE = __name__.partition(".")[0] + "."

# Per leaf handler class, its plugin's (distribution, version); made once per discovery.
_by_class: tuple[object, dict[type, tuple[str, str | None]]] | None = None
_lock = threading.Lock()


def _plugin_distributions() -> dict[type, tuple[str, str | None]]:
    """Each plugin-registered leaf handler class -> its plugin's distribution and version."""
    global _by_class
    registrations = cp.plugins.leaf_registrations()  # The same tuple until plugins change.
    with _lock:
        if _by_class is not None and _by_class[0] is registrations:
            return _by_class[1]
    found: dict[type, tuple[str, str | None]] = {}
    for info in cp.plugins.list_plugins():
        if info.distribution is None:
            continue
        for leaf in info.leaf_handlers:
            found.setdefault(leaf.handler_cls, (info.distribution, info.version))
    with _lock:
        _by_class = (registrations, found)
    return found


def of_handlers(recorded_types: Iterable[tuple[str, type]]) -> dict[str, dict[str, Any]]:
    """The record for ``_METADATA``: per recorded value type whose leaf handler (a class of
    ``recorded_types``' pairs) a plugin of another distribution registered, that distribution.
    """
    distributions = _plugin_distributions()
    record: dict[str, dict[str, Any]] = {}
    for value_type, handler_cls in sorted(recorded_types, key=lambda pair: pair[0]):
        found = distributions.get(handler_cls)
        if found is None or handler_cls.__module__.startswith(_OWN_PACKAGE):
            continue
        if len(record) == MAX_RECORDED:
            break
        record[value_type] = {"distribution": found[0], "version": found[1]}
    return record


def recorded(extra: Mapping[str, Any], value_type: str) -> tuple[str, str | None] | None:
    """The ``(distribution, version)`` a tree's ``extra`` records for ``value_type``, or
    ``None`` (none recorded, too many recorded, or not a distribution's name)."""
    record = extra.get(FIELD)
    if not isinstance(record, dict) or len(record) > MAX_RECORDED:
        return None
    field = cp.checkpoint_metadata.DISTRIBUTIONS_FIELD  # Checked as checkpoints' own records.
    return cp.checkpoint_metadata.recorded_distribution({field: record}, value_type)


def merged(extras: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The records of several trees (partial saves) as one; later trees win."""
    record: dict[str, Any] = {}
    for extra in extras:
        own = extra.get(FIELD)
        if isinstance(own, dict) and len(own) <= MAX_RECORDED:
            record.update(own)
    return dict(list(record.items())[:MAX_RECORDED])


def _installable(value_type: str, distribution: tuple[str, str | None]) -> str:
    """The end of a sentence: what to install for ``value_type``, or, where its plugin is
    installed but disabled or broken, what to fix (``cp.handlers.install_hint`` says which)."""
    name, version = distribution
    if cp.handlers.unavailable_plugin(value_type, name) is not None:
        return ". " + cp.handlers.install_hint(value_type, distribution).strip()
    pinned = f"{name}=={version}" if version else name
    return f": pip install '{pinned}' (if you trust it), then run again."


def missing_message(
    unknown: Mapping[str, list[str]], extra: Mapping[str, Any], where: object | None = None
) -> str:
    """Why no leaf handler here reads the leaves of ``unknown`` (recorded value type -> the
    key paths shown) of the pytree in ``where`` (its ``_METADATA``'s ``extra``), and what to
    do: install the recorded distribution, or skip them."""
    sentences, own_handlers = [], False
    for value_type, paths in unknown.items():
        distribution = recorded(extra, value_type)
        saved = f"{listing(paths)} were saved by the leaf handler {value_type}"
        if distribution is None:
            own_handlers = True
            hint = cp.handlers.install_hint(value_type).strip()
            sentences.append(f"{saved}.{f' {hint}' if hint else ''}")
            continue
        name, version = distribution
        sentences.append(
            f"{saved}, from the distribution {name}{f' {version}' if version else ''}"
            f"{_installable(value_type, distribution)}"
        )
    if own_handlers:
        sentences.append(
            "If a leaf handler is your own, pass a registry holding it: cp.Context(pytree_options="
            "cp.options.PyTreeOptions(leaf_handler_registry=registry))."
        )
    of = f" of the pytree in {where}" if where is not None else ""
    return (
        f"No leaf handler registered here reads some leaves{of}. {' '.join(sentences)} Or skip "
        "those leaves with cp.PLACEHOLDER in an abstract tree."
    )
