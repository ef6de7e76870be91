"""Making one OCDBT database reference the keys of others, without copying data.

Two features need it: a multi-process save (each process writes its own
``ocdbt.process_<i>`` database, merged into the pytree's root database at
commit, as Orbax does) and ``cp.partial.finalize`` (the databases of several
partial saves become one checkpoint). The source databases must live under the
target's directory: the merged b-tree refers to their data files by relative
path, so they are moved, never copied, and must be kept.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs
import tensorstore as ts
from etils import epath

from checkpointables_pytree import _database

__all__ = ["Source", "merge_into", "prefix_range"]


@attrs.frozen
class Source:
    """A database to merge, and which of its keys to take.

    Attributes:
      directory: the source database's directory (inside the target's).
      prefixes: take only keys under these prefixes (e.g. ``"params.w/"``);
        ``None`` takes every key.
    """

    directory: epath.Path
    prefixes: tuple[str, ...] | None = None


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """The key range of every key that starts with ``prefix``."""
    raw = prefix.encode()
    end = raw.rstrip(b"\xff")
    end = end[:-1] + bytes([end[-1] + 1]) if end else b""
    return ts.KvStore.KeyRange(raw, end)


def merge_into(target: epath.Path, sources: Sequence[Source]) -> None:
    """Adds the chosen keys of every source to the database at ``target``, atomically.

    The key sets must not overlap (choose ``prefixes`` so that each key comes
    from one source). No array data is copied: the target's b-tree points at
    the sources' data files.
    """
    for source in sources:
        relative = os.path.relpath(os.fspath(source.directory), os.fspath(target))
        if relative.startswith(".."):
            raise ValueError(
                f"Database {source.directory} is not inside {target}: merged databases refer to "
                f"their sources' files by relative path."
            )
    context = _database.make_context()
    destination = ts.KvStore.open(
        _database.kvstore_spec(target, create=True), context=context
    ).result()
    with ts.Transaction(atomic=True) as transaction:
        into = destination.with_transaction(transaction)
        futures = []
        for source in sources:
            store = ts.KvStore.open(
                _database.kvstore_spec(source.directory), context=context
            ).result()
            if source.prefixes is None:
                futures.append(store.experimental_copy_range_to(into))
            else:
                for prefix in source.prefixes:
                    futures.append(
                        store.experimental_copy_range_to(into, source_range=prefix_range(prefix))
                    )
        for future in futures:
            future.result()
