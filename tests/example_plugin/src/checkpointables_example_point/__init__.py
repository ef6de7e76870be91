"""An example third-party checkpointables plugin: the tests' (see docs/writing-a-plugin.md).

The default dev dependency group installs it, so that the tests exercise real
entry-point discovery; it is no part of what users install. So that a newcomer's
``checkpointables --help`` in a fresh development checkout shows no test command
and their saves try no test handler, it registers nothing unless the environment
variable ``CHECKPOINTABLES_EXAMPLE_PLUGIN`` is ``1``, as the test suite's
``tests/conftest.py`` sets it; without it ``checkpointables plugins`` lists it as
installed but inactive.

It ships a ``Point`` type and two ways to checkpoint it: ``PointHandler``
(a whole checkpointable) and ``PointLeafHandler`` (a leaf inside pytrees);
a pytree reader for ``*.point.json`` files (``cp.load_pytree("a.point.json")``
gives ``{"x": ..., "y": ...}``); and a ``checkpointables points CKPT``
command. All are registered through the entry point in this package's
``pyproject.toml``::

    [project.entry-points.checkpointables]
    example-point = "checkpointables_example_point"

so that users never import this module to save or load a ``Point``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from collections.abc import Awaitable, Sequence
from typing import Any

import checkpointables as cp
from etils import epath

__all__ = [
    "ACTIVATION_ENVIRONMENT_VARIABLE",
    "Point",
    "AbstractPoint",
    "PointHandler",
    "PointLeafHandler",
    "PointFileReader",
]

# Set to "1" (tests/conftest.py does) for the hooks below to register anything.
ACTIVATION_ENVIRONMENT_VARIABLE = "CHECKPOINTABLES_EXAMPLE_PLUGIN"


def _active() -> bool:
    """Whether the test suite asked for this plugin; read at each hook call, so that a
    process discovering plugins sees the environment it was started with."""
    return os.environ.get(ACTIVATION_ENVIRONMENT_VARIABLE) == "1"


@dataclasses.dataclass
class Point:
    """A point with numeric coordinates."""

    x: int | float
    y: int | float


@dataclasses.dataclass
class AbstractPoint:
    """The types of a ``Point``'s coordinates, used to guide loading."""

    x: type = int
    y: type = int

    @classmethod
    def from_point(cls, point: Point) -> AbstractPoint:
        """The abstract form of ``point``."""
        return cls(type(point.x), type(point.y))


_TYPES = {"int": int, "float": float}


def _write_json(path: epath.Path, value: Any) -> None:
    # cp.storage reaches local disks and s3:// or gs:// alike; open() and epath only disks.
    cp.storage.write_text(path, json.dumps(value), durable=True)


def _read_json(path: epath.Path) -> Any:
    """A file this plugin wrote, checked against the checksum recorded at the commit
    (``cp.storage.read_text`` would read a damaged file unchecked)."""
    return cp.safe_json.loads(cp.metadata_checksums.read_file(path), source=path)


class PointHandler:
    """Saves one ``Point`` as ``point.json`` plus ``point_metadata.json``."""

    async def save(
        self, directory: cp.path.PathAwaitingCreation, checkpointable: Point
    ) -> Awaitable[None]:
        """Copies the coordinates now; writes them in the background."""
        values = dataclasses.asdict(checkpointable)
        types = {k: type(v).__name__ for k, v in values.items()}

        async def write() -> None:
            path = await directory.await_creation()
            if cp.multihost.is_primary_host():
                await asyncio.gather(
                    asyncio.to_thread(_write_json, path / "point.json", values),
                    asyncio.to_thread(_write_json, path / "point_metadata.json", types),
                )

        return write()

    async def load(
        self, directory: epath.Path, abstract_checkpointable: AbstractPoint | None = None
    ) -> Awaitable[Point]:
        """Reads the point, casting coordinates to the abstract point's types if given."""

        async def read() -> Point:
            values = _read_json(directory / "point.json")
            if abstract_checkpointable is None:
                return Point(**values)
            return Point(
                abstract_checkpointable.x(values["x"]), abstract_checkpointable.y(values["y"])
            )

        return read()

    async def metadata(self, directory: epath.Path) -> AbstractPoint:
        """The stored coordinate types."""
        types = _read_json(directory / "point_metadata.json")
        return AbstractPoint(**{k: _TYPES[v] for k, v in types.items()})

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for ``Point`` instances."""
        return isinstance(checkpointable, Point)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """True for ``AbstractPoint`` instances."""
        return isinstance(abstract_checkpointable, AbstractPoint)


class PointLeafHandler:
    """Saves ``Point`` leaves of a pytree as ``<leaf name>.point.json`` files."""

    def __init__(self, context: cp.Context | None = None) -> None:
        del context

    async def serialize(
        self,
        params: Sequence[cp.serialization.SerializationParam[Point]],
        serialization_context: cp.serialization.SerializationContext,
    ) -> Awaitable[None]:
        """Copies the points now; writes them in the background (primary host only)."""
        values = [(p.name, dataclasses.asdict(p.value)) for p in params]

        async def write() -> None:
            directory = await serialization_context.parent_dir.await_creation()
            if cp.multihost.is_primary_host():
                for name, value in values:
                    _write_json(directory / f"{name}.point.json", value)

        return write()

    async def deserialize(
        self,
        params: Sequence[cp.serialization.DeserializationParam[AbstractPoint]],
        deserialization_context: cp.serialization.DeserializationContext,
    ) -> Awaitable[Sequence[Point]]:
        """Returns an awaitable reading the points in the order of ``params``."""

        async def read() -> list[Point]:
            points = []
            for p in params:
                values = _read_json(deserialization_context.parent_dir / f"{p.name}.point.json")
                point = Point(**values)
                if isinstance(p.value, AbstractPoint):
                    point = Point(p.value.x(point.x), p.value.y(point.y))
                points.append(point)
            return points

        return read()

    async def metadata(
        self,
        params: Sequence[cp.serialization.DeserializationParam[None]],
        deserialization_context: cp.serialization.DeserializationContext,
    ) -> Sequence[AbstractPoint]:
        """The abstract form of each stored point."""
        result = []
        for p in params:
            values = _read_json(deserialization_context.parent_dir / f"{p.name}.point.json")
            result.append(AbstractPoint(type(values["x"]), type(values["y"])))
        return result


class PointFileReader:
    """Reads a ``*.point.json`` file (``{"x": 1, "y": 2}``) as the pytree ``{"x": 1, "y": 2}``."""

    SUFFIX = ".point.json"

    def recognizes(self, path: epath.Path) -> bool:
        """True for existing files named ``*.point.json``."""
        return path.name.endswith(self.SUFFIX) and cp.storage.is_file(path)

    async def load(self, path: epath.Path, abstract_pytree: Any = None) -> Awaitable[Any]:
        """Reads the coordinates; an abstract tree of types casts them."""

        async def read() -> dict[str, Any]:
            values = json.loads(cp.storage.read_text(path))
            if abstract_pytree is None:
                return values
            return {k: abstract_pytree[k](values[k]) for k in abstract_pytree}

        return read()

    async def metadata(self, path: epath.Path) -> cp.CheckpointMetadata[dict[str, type]]:
        """The coordinates' types."""
        values = json.loads(cp.storage.read_text(path))
        return cp.CheckpointMetadata(path, metadata={k: type(v) for k, v in values.items()})


def _add_points_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a checkpoint holding Point checkpointables")


def _points_command(args: argparse.Namespace) -> int:
    """``checkpointables points CKPT``: prints each Point checkpointable of a checkpoint."""
    metadata = cp.checkpointables_metadata(args.path).metadata
    names = [n for n, m in metadata.items() if isinstance(m, AbstractPoint)]
    if not names:
        print(f"{args.path} holds no Point.")
        return 1
    loaded = cp.load_checkpointables(args.path, {n: metadata[n] for n in names})
    for name in names:
        print(f"{name}: ({loaded[name].x}, {loaded[name].y})")
    return 0


@cp.hookimpl
def register_commands(register: Any) -> None:
    """Adds ``checkpointables points CKPT``."""
    if not _active():
        return
    register(
        "points",
        _points_command,
        help=(
            "print the Points saved in a checkpoint (the tests' example plugin; "
            "see docs/writing-a-plugin.md)"
        ),
        add_arguments=_add_points_arguments,
    )


@cp.hookimpl
def register_pytree_readers(register: Any) -> None:
    """Registers ``PointFileReader`` for ``*.point.json`` files."""
    if not _active():
        return
    register(PointFileReader)


@cp.hookimpl
def register_checkpointable_handlers(register: Any) -> None:
    """Registers ``PointHandler`` for ``Point`` checkpointables."""
    if not _active():
        return
    register(PointHandler, priority=50, name="example-point")


@cp.hookimpl
def register_leaf_handlers(register: Any) -> None:
    """Registers ``PointLeafHandler`` for ``Point`` leaves in pytrees."""
    if not _active():
        return
    register(Point, AbstractPoint, PointLeafHandler)
