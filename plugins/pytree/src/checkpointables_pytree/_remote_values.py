"""Reading the values of many small keys of an OCDBT database on an object store, in few requests.

TensorStore's OCDBT reads each value with its own ranged GET: a load of
5,000 small arrays made about 3,300 requests to S3, at tens of milliseconds
each. But the values of one save sit next to each other in a few data
files. So, as for local databases (``_local_values``), ``ts.ocdbt.dump``
says where each value is (inline in the b-tree, or a range of a data file),
and the ranges are read here: neighbouring values of one data file in one
ranged GET (gaps of up to ``GAP_BYTES`` read and dropped, at most
``SPAN_BYTES`` per request), all requests at once.

Anything unusual (a key the walk does not find, a location outside the
database) is left to TensorStore's reads by the caller, which report damage
as before.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from typing import Any

from checkpointables_pytree import _value_files

__all__ = ["read_remote_values", "GAP_BYTES", "SPAN_BYTES"]

# A request costs what tens of milliseconds of transfer would: read through gaps this small.
GAP_BYTES = 1 << 20
# At most this much per request, so that one slow request does not hold up a whole load.
SPAN_BYTES = 64 << 20


def _spans(
    located: list[tuple[bytes, _value_files.ValueLocation]],
) -> list[tuple[int, int, list[tuple[bytes, _value_files.ValueLocation]]]]:
    """``(start, end, values)`` of each request: neighbouring values of one file."""
    spans: list[tuple[int, int, list[tuple[bytes, _value_files.ValueLocation]]]] = []
    for key, location in sorted(located, key=lambda item: item[1].offset):
        end = location.offset + location.length
        if spans:
            start, last, members = spans[-1]
            if location.offset - last <= GAP_BYTES and end - start <= SPAN_BYTES:
                members.append((key, location))
                spans[-1] = (start, max(last, end), members)
                continue
        spans.append((location.offset, end, [(key, location)]))
    return spans


async def read_remote_values(
    index: _value_files.DatabaseIndex, keys: Sequence[str]
) -> list[bytes | memoryview | None]:
    """The values of ``keys`` (in order), ``None`` for those left to TensorStore.

    ``index`` walks the database's b-tree through its object-store location,
    whose keys are paths relative to the database's directory.
    """
    base = await index.base()
    encoded = [key.encode() for key in keys]
    found: dict[bytes, Any] = await index.find(encoded)
    by_file: dict[str, list[tuple[bytes, _value_files.ValueLocation]]] = collections.defaultdict(
        list
    )
    for key, value in found.items():
        if isinstance(value, _value_files.ValueLocation):
            by_file[value.file].append((key, value))
            found[key] = None  # Until read.
    requests = []
    for file, located in by_file.items():
        name = os.path.relpath(file, index.root)
        for start, end, members in _spans(located):
            requests.append((base.read(name, byte_range=slice(start, end)), start, end, members))
    for future, start, end, members in requests:
        result = await future
        data = memoryview(result.value) if result.state == "value" else memoryview(b"")
        if len(data) != end - start:
            continue  # Cut short: TensorStore's reads report what is wrong.
        for key, location in members:
            offset = location.offset - start
            found[key] = data[offset : offset + location.length]
    return [found.get(key) for key in encoded]
