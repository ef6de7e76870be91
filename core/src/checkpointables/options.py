"""Option classes: frozen attrs classes, set through ``cp.Context`` or ``cp.configure``.

Example::

    import checkpointables as cp

    with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=60)):
        cp.save_pytree(path, state)

Core defines the options core reads (``BUILTIN``). Settings only a plugin
reads are the plugin's own classes, added through the ``register_options``
hook; they are found here by name too: ``cp.options.ArrayOptions``,
``cp.options.ArrayStorageOptions`` and ``cp.options.StorageOptions`` are the
pytree plugin's (TensorStore and S3 settings), looked up when first used.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from checkpointables import errors, plugins

__all__ = [
    "AsyncOptions",
    "MultiprocessingOptions",
    "FileOptions",
    "PyTreeOptions",
    "CheckpointablesOptions",
    "MemoryOptions",
    "MIN_HOST_BYTES",
    "BUILTIN",
    "OptionValidator",
    "invalid_option",
    "option_validator",
    "int_at_least",
    "positive_seconds",
    "boolean",
    "checked_bool",
    "text_or_none",
    "python_scalar",
]

# -- Validation -----------------------------------------------------------------------------
# Every option class checks its fields when it is built, so that a mistake fails where it is
# made, naming the class, the field, the value and what the field takes, rather than deep
# inside a save. Plugins' option classes use the same validators (see writing-a-plugin.md).

OptionValidator = Callable[[Any, "attrs.Attribute[Any]", Any], None]
"""An attrs validator: ``validator(instance, attribute, value)`` raises or returns ``None``."""


class InvalidOptionTypeError(errors.InvalidArgumentError, errors.InvalidArgumentTypeError):
    """An option of the wrong type: both a ``cp.errors.InvalidArgumentError`` (what every bad
    option raises) and a ``TypeError`` (``InvalidArgumentTypeError``), as Python's own."""


def python_scalar(value: Any) -> Any:
    """``value`` as the Python ``bool``, ``int`` or ``float`` it holds, when it is a NumPy
    scalar or a 0-d NumPy or JAX array of such a dtype; anything else as given.

    A JAX user's ``jnp.int32(5)`` is a 0-d ``jax.Array``, not a ``numbers.Integral``: an
    option takes it as the ``5`` it holds, as it takes ``np.int32(5)``. Arrays of other
    shapes, and 0-d arrays of other dtypes (complex, dates), are left for the check to refuse.

    Example::

        cp.options.python_scalar(jnp.float32(0.5))  # 0.5, a float
    """
    if type(value) in (bool, int, float) or getattr(value, "shape", None) != ():
        return value
    item = getattr(value, "item", None)
    if not callable(item):
        return value
    try:
        held = item()  # A traced value inside jit has none: left for the check to name.
    except Exception:
        return value
    return held if type(held) in (bool, int, float) else value


def _shape_hint(value: Any) -> str:
    # An array where a number goes: say why, as its repr alone looks like a number.
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple) and shape:
        return f"; an array is taken only when 0-d (one number), and this one has shape {shape}"
    return ""


def invalid_option(
    owner: str,
    field: str,
    value: Any,
    allowed: str,
    *,
    wrong_type: bool = False,
    show_value: bool = True,
) -> errors.InvalidArgumentError:
    """The error for the option ``owner.field`` set to ``value``, which must be ``allowed``.

    ``cp.errors.InvalidArgumentError``; with ``wrong_type``, also a
    ``cp.errors.InvalidArgumentTypeError`` (a ``TypeError``). ``show_value=False``
    names only the value's type (secrets: fields with ``repr=False``).

    Example::

        raise cp.options.invalid_option("MyOptions", "level", 12, "an int from 1 to 9")
    """
    error = InvalidOptionTypeError if wrong_type else errors.InvalidArgumentError
    shown = f"{value!r} ({type(value).__name__})" if show_value else f"<a {type(value).__name__}>"
    return error(f"{owner}.{field}={shown} is not valid: it must be {allowed}.")


def option_validator(
    allowed: str,
    *,
    kind: type | tuple[type, ...],
    test: Callable[[Any], bool] | None = None,
    optional: bool = False,
) -> OptionValidator:
    """An attrs validator for an option field: its value is a ``kind`` passing ``test``.

    ``allowed`` says what the field takes, in the error's words ("an int >= 1
    or None"). ``optional`` also accepts ``None``. A ``bool`` is refused unless
    ``kind`` names ``bool``: to Python ``True`` is an int, never to an option.
    When ``kind`` is numeric (``int``, ``numbers.Real``, ``bool``...), NumPy
    scalars and 0-d NumPy or JAX arrays are checked and stored as the Python
    number they hold (``python_scalar``); an array of another shape is refused.
    Anything else raises ``invalid_option``, naming the class being built (and
    the value, unless the field has ``repr=False``).

    Example::

        @attrs.frozen
        class MyOptions:
            level: int = attrs.field(
                default=3, validator=cp.options.option_validator(
                    "an int from 1 to 9", kind=int, test=lambda v: 1 <= v <= 9))
    """
    kinds = kind if isinstance(kind, tuple) else (kind,)
    numeric = any(issubclass(k, numbers.Number | np.bool_) for k in kinds)

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        given = value
        if numeric and (value := python_scalar(given)) is not given:
            # NumPy and JAX scalars are stored as the Python number they hold: options then
            # hash, compare and print as numbers, and a device value is read once, here.
            # attrs has set the field already; a frozen class is set the way attrs does.
            object.__setattr__(instance, attribute.name, value)
        wrong_type = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
        if wrong_type or (test is not None and not test(value)):
            raise invalid_option(
                type(instance).__name__,
                attribute.name,
                given,
                allowed + (_shape_hint(given) if numeric else ""),
                wrong_type=wrong_type,
                show_value=attribute.repr is not False,
            )

    return check


def int_at_least(
    minimum: int, *, optional: bool = False, allowed: str | None = None
) -> OptionValidator:
    """A validator: an int (NumPy's too) ``>= minimum``; ``optional``: or ``None``."""
    allowed = allowed or f"an int >= {minimum}" + (" or None" if optional else "")
    return option_validator(
        allowed, kind=numbers.Integral, test=lambda v: v >= minimum, optional=optional
    )


def positive_seconds(*, optional: bool = False) -> OptionValidator:
    """A validator: a finite number of seconds ``> 0``; ``optional``: or ``None``."""
    allowed = "a finite number of seconds > 0 (e.g. 600)" + (" or None" if optional else "")
    return option_validator(
        allowed,
        kind=numbers.Real,
        test=lambda v: math.isfinite(v) and v > 0,
        optional=optional,
    )


def boolean() -> OptionValidator:
    """A validator: ``True`` or ``False`` (not a truthy string such as ``"no"``)."""
    return option_validator("True or False", kind=(bool, np.bool_))


def checked_bool(value: Any, argument: str) -> bool:
    """``value``, a function's argument named ``argument``, as the Python ``bool`` it is.

    ``True`` and ``False`` are taken, and so are NumPy's ``np.bool_`` and a 0-d NumPy or
    JAX bool array (a comparison's result), as the bool they hold. Anything else, a
    string such as ``"no"`` (which ``if`` would take for true) or an int, even ``0`` or
    ``1``, raises ``cp.errors.InvalidArgumentTypeError`` (also an
    ``InvalidArgumentError``, as a bad option's) naming the argument and the value.

    Example::

        overwrite = cp.options.checked_bool(overwrite, "overwrite")
    """
    if type(value) is bool:  # The usual case first: one comparison per call.
        return value
    held = python_scalar(value)
    if type(held) is bool:
        return held
    if isinstance(value, str | bytes):
        hint = f" (a string is not read as a bool: {value!r} would count as true)"
    elif isinstance(held, numbers.Integral):
        hint = " (not an int, even 0 or 1: pass False or True)"
    else:
        hint = _shape_hint(value)
    raise InvalidOptionTypeError(
        f"{argument}={value!r} ({type(value).__name__}) is not valid: it must be True or "
        f"False{hint}."
    )


def text_or_none() -> OptionValidator:
    """A validator: a ``str`` or ``None``."""
    return option_validator("a str or None", kind=str, optional=True)


def _process_indices(value: Any) -> frozenset[int] | None:
    """``active_processes`` as a frozenset, checked here to name the value as given."""
    if value is None:
        return None
    try:  # A 0-d array says it is Iterable, then refuses to be iterated.
        indices = None if isinstance(value, str | bytes) else [python_scalar(i) for i in value]
    except TypeError:
        indices = None
    if indices is not None and all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) and int(i) >= 0 for i in indices
    ):
        return frozenset(int(i) for i in indices)
    raise invalid_option(
        "MultiprocessingOptions",
        "active_processes",
        value,
        "a collection of process indices (ints >= 0) or None",
        wrong_type=indices is None,
    )


# -- Core's options -------------------------------------------------------------------------


@attrs.frozen
class AsyncOptions:
    """How waits between saves, loads and processes are bounded.

    Attributes:
      timeout_secs: a finite number of seconds > 0. The longest a wait on
        other processes (every multi-host barrier), a Checkpointer's wait for
        its previous save, or a load's wait for a save of the same path in
        this process may last before it fails with a ``TimeoutError`` that
        says what was being waited for; also the age after which an unfinished
        save whose heartbeat stopped is a leftover (``docs/multi-host.md``).
        A handler's own background work is not cut short by it: bound a wait
        on one save or load with ``AsyncResponse.result(timeout=...)``.

    Example::

        with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=300)):
            cp.save_pytree(path, state)
    """

    timeout_secs: float = attrs.field(default=1200, validator=positive_seconds())


@attrs.frozen
class MultiprocessingOptions:
    """Which processes take part in a save and which one commits it.

    Attributes:
      primary_host: the process index (an int >= 0) that writes metadata and
        commits. ``None`` means every process acts as its own primary
        (process-local storage).
      active_processes: the process indices (ints >= 0) taking part; ``None`` means all.
      barrier_sync_key_prefix: a prefix for the keys of cross-process barriers,
        so that several independent checkpointers may run in one job.
    """

    primary_host: int | None = attrs.field(default=0, validator=int_at_least(0, optional=True))
    active_processes: frozenset[int] | None = attrs.field(default=None, converter=_process_indices)
    barrier_sync_key_prefix: str | None = attrs.field(default=None, validator=text_or_none())


@attrs.frozen
class FileOptions:
    """How files and directories are created.

    Attributes:
      path_permission_mode: permission bits for directories the library
        creates, an int from ``0`` to ``0o7777`` (e.g. ``0o750``, not the
        string ``"0o750"``); ``None`` keeps the process umask.
    """

    path_permission_mode: int | None = attrs.field(
        default=None,
        validator=option_validator(
            "an int of permission bits from 0 to 0o7777 (e.g. 0o750, not the string "
            "'0o750'), or None to keep the process umask",
            kind=numbers.Integral,
            test=lambda v: 0 <= v <= 0o7777,
            optional=True,
        ),
    )


@attrs.frozen
class PyTreeOptions:
    """Options for pytree checkpointables.

    Attributes:
      leaf_handler_registry: the leaf handlers to use; ``None`` means a
        ``cp.serialization.StandardLeafHandlerRegistry()`` holding every leaf
        handler that plugins registered.
      partial_load: allow an abstract tree that omits keys of the stored tree
        (``True`` or ``False``).
    """

    leaf_handler_registry: Any = None
    partial_load: bool = attrs.field(default=False, validator=boolean())


# The smallest host-memory budget: a budget is cut into pieces of an eighth of it (several
# in flight, each copied once by the storage layer), and a piece is at least 1 MiB.
MIN_HOST_BYTES = 8 << 20


@attrs.frozen
class MemoryOptions:
    """How much host memory a save or load of pytrees may use for staging.

    Example::

        with cp.Context(memory_options=cp.options.MemoryOptions(host_bytes=8 << 30)):
            cp.save_pytree(path, state)     # device-to-host copies and writes stream
            state = cp.load_pytree(path, abstract_state)  # reads stream onto the devices

    Attributes:
      host_bytes: the most bytes of host memory the library holds at once for
        copies from the devices, encoding, reading and decoding of arrays
        (what the state itself occupies, e.g. on CPU devices, is not counted).
        ``None`` (the default): no bound, every array is staged at once (the
        fastest). At least ``MIN_HOST_BYTES`` (8 MiB), else
        ``cp.errors.InvalidArgumentError``. See docs/memory.md.
    """

    host_bytes: int | None = attrs.field(
        default=None,
        validator=int_at_least(
            MIN_HOST_BYTES,
            optional=True,
            allowed=f"None (no bound) or an int of at least {MIN_HOST_BYTES} bytes "
            f"({MIN_HOST_BYTES >> 20} MiB, the smallest workable budget: a save or load moves "
            f"arrays in pieces of an eighth of the budget, at least 1 MiB each)",
        ),
    )


def _handler_map(value: Any) -> Any:
    # Anything but a mapping is left to the validator to name.
    return dict(value or {}) if value is None or isinstance(value, Mapping) else value


def _handler_choices(value: Mapping[Any, Any]) -> bool:
    return all(isinstance(k, str) and isinstance(v, type | str) for k, v in value.items())


@attrs.frozen
class CheckpointablesOptions:
    """Which handler to use for which checkpointable name.

    Attributes:
      handlers: maps a checkpointable name to a handler class, or to the name
        or typestr of a registered handler. Those names skip resolution.
    """

    handlers: Mapping[str, Any] = attrs.field(
        factory=dict,
        converter=_handler_map,
        validator=option_validator(
            "a dict of checkpointable name (str) to a handler class, or to the name or "
            "typestr (str) of a registered handler",
            kind=dict,
            test=_handler_choices,
        ),
    )

    @classmethod
    def create_with_handlers(cls, **handlers: Any) -> CheckpointablesOptions:
        """Forces a handler per checkpointable name.

        Example::

            cp.options.CheckpointablesOptions.create_with_handlers(extra=cp.handlers.get("json"))
        """
        return cls(handlers=handlers)


BUILTIN: dict[str, type] = {
    "async_options": AsyncOptions,
    "multiprocessing_options": MultiprocessingOptions,
    "file_options": FileOptions,
    "pytree_options": PyTreeOptions,
    "checkpointables_options": CheckpointablesOptions,
    "memory_options": MemoryOptions,
}
"""Core's option classes by keyword of ``cp.Context`` / ``cp.configure``; plugins add theirs."""


def __getattr__(name: str) -> type:
    """An option class a plugin registered, by class name (e.g. ``StorageOptions``)."""
    if name.startswith("__"):  # Probes such as __path__ or __wrapped__ are not option classes.
        raise AttributeError(name)
    for registration in plugins.option_registrations():
        for cls in (registration.options_cls, *registration.parts):
            if cls.__name__ == name:
                return cls
    raise AttributeError(
        f"module 'checkpointables.options' has no attribute {name!r}: neither core nor any "
        f"installed plugin registers an option class of that name (`checkpointables plugins` "
        f"lists the plugins' options; ArrayOptions, ArrayStorageOptions and StorageOptions need "
        f"the pytree plugin: pip install checkpointables-pytree)."
    )
