"""The ``_sharding`` file: how each saved ``jax.Array`` was sharded, in Orbax's format.

Keys are ``base64.urlsafe_b64encode(storage name)``; values are JSON strings
such as ``{"sharding_type": "NamedSharding", "shape": [4, 2], "axis_names": [...],
"axis_types": [...], "partition_spec": [...], "device_mesh": {"mesh": [[{"id": 0}, ...]]}}``.

Loading never needs it: arrays load onto the default device unless the
abstract tree names a sharding. ``rebuild`` turns a record back into a
sharding only when every device it names exists here, and returns ``None``
otherwise, so metadata never depends on the current topology.
"""

from __future__ import annotations

import base64
import functools
import json
import math
from collections.abc import Mapping
from typing import Any

import checkpointables as cp
import jax
import numpy as np
from etils import epath

__all__ = [
    "SHARDING_FILE",
    "file_key",
    "describe",
    "device_count",
    "summary",
    "rebuild",
    "read_sharding_file",
    "write_sharding_file",
]

SHARDING_FILE = "_sharding"


@functools.lru_cache(maxsize=1 << 16)  # The arrays of recent structures: saves repeat them.
def file_key(storage_name: str) -> str:
    """The key of an array in the ``_sharding`` file."""
    return base64.urlsafe_b64encode(storage_name.encode()).decode()


def _device_mesh(devices: np.ndarray) -> dict[str, Any]:
    return {"mesh": np.vectorize(lambda d: {"id": int(d.id)}, otypes=[object])(devices).tolist()}


@functools.lru_cache(maxsize=1024)
def describe(sharding: jax.sharding.Sharding) -> dict[str, Any] | None:
    """The JSON-able record of a sharding, or ``None`` for kinds Orbax does not record."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        record: dict[str, Any] = {
            "sharding_type": "NamedSharding",
            "shape": [int(s) for s in mesh.devices.shape],
            "axis_names": [str(a) for a in mesh.axis_names],
        }
        axis_types = getattr(mesh, "axis_types", None)
        if axis_types is not None:
            record["axis_types"] = [str(a) for a in axis_types]
        record["partition_spec"] = spec
        record["device_mesh"] = _device_mesh(mesh.devices)
        return record
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return {"sharding_type": "SingleDeviceSharding", "device_str": str(device)}
    return None


def _axis_type(name: str) -> Any:
    for value in jax.sharding.AxisType:
        if str(value) == name:
            return value
    return None


def rebuild(record: Mapping[str, Any] | None) -> jax.sharding.Sharding | None:
    """The sharding a record describes, if its devices exist in this process; else ``None``."""
    if not record:
        return None
    try:
        kind = record.get("sharding_type")
        devices = {d.id: d for d in jax.devices()}
        if kind == "NamedSharding":
            ids = np.asarray(
                jax.tree_util.tree_map(
                    lambda d: d["id"],
                    record["device_mesh"]["mesh"],
                    is_leaf=lambda x: isinstance(x, dict),
                )
            )
            if not all(int(i) in devices for i in ids.reshape(-1)):
                return None
            mesh_devices = np.vectorize(lambda i: devices[int(i)], otypes=[object])(ids)
            axis_types = None
            if record.get("axis_types"):
                axis_types = tuple(_axis_type(a) for a in record["axis_types"])
                if any(a is None for a in axis_types):
                    axis_types = None
            mesh_devices = mesh_devices.reshape(tuple(record["shape"]))
            names = tuple(record["axis_names"])
            mesh = (
                jax.sharding.Mesh(mesh_devices, names, axis_types=axis_types)
                if axis_types is not None
                else jax.sharding.Mesh(mesh_devices, names)
            )
            spec = [tuple(p) if isinstance(p, list) else p for p in record["partition_spec"]]
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        if kind == "SingleDeviceSharding":
            wanted = str(record.get("device_str", "")).replace("TFRT_CPU_", "cpu:")
            for device in jax.local_devices():
                if str(device).replace("TFRT_CPU_", "cpu:") == wanted:
                    return jax.sharding.SingleDeviceSharding(device)
    except (KeyError, TypeError, ValueError, IndexError, RecursionError):
        return None  # A record this process cannot rebuild: arrays load onto the default device.
    return None


def device_count(record: Mapping[str, Any] | None) -> int:
    """How many devices a record's sharding spans (0 for no record or one not understood)."""
    if not record:
        return 0
    kind = record.get("sharding_type")
    if kind == "SingleDeviceSharding":
        return 1
    try:
        return math.prod(int(s) for s in record["shape"]) if kind == "NamedSharding" else 0
    except (KeyError, TypeError, ValueError):
        return 0


def summary(record: Mapping[str, Any] | None) -> str:
    """A record in a few words, as reprs and warnings show it: "NamedSharding over 8 devices"."""
    if not record:
        return "none recorded"
    kind = str(record.get("sharding_type"))
    if kind == "SingleDeviceSharding":
        return f"{kind} on {record.get('device_str')}"
    count = device_count(record)
    return f"{kind} over {count} devices" if count else kind


def write_sharding_file(directory: epath.Path, records: Mapping[str, dict[str, Any]]) -> None:
    """Writes ``_sharding`` for ``{storage name: record}`` (the commit fsyncs it)."""
    texts: dict[int, str] = {}  # Per record: arrays of one sharding share theirs.
    document = {}
    for name, record in records.items():
        text = texts.get(id(record))
        if text is None:
            text = texts[id(record)] = json.dumps(record)
        document[file_key(name)] = text
    cp.storage.write_text(directory / SHARDING_FILE, json.dumps(document))


def read_sharding_file(directory: epath.Path) -> dict[str, dict[str, Any]]:
    """``{file key: record}`` from ``_sharding``; ``{}`` if absent (it is optional).

    The file is checked against the checksum recorded at commit (``cp.metadata_checksums``).

    Raises:
      cp.errors.MetadataError: the file is damaged.
      cp.errors.IntegrityError: it does not match its recorded checksum.
    """
    path = directory / SHARDING_FILE
    try:
        raw = cp.metadata_checksums.read_file(path, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise cp.errors.MetadataError(f"Cannot read {path}: {e}.") from e
    document = cp.safe_json.loads_object(raw, source=path)
    result = {}
    for key, value in document.items():
        try:
            record = cp.safe_json.loads(value, source=path) if isinstance(value, str) else value
        except cp.errors.MetadataError:
            continue  # One unreadable record only loses that array's recorded sharding.
        if isinstance(record, dict):
            result[key] = record
    return result
