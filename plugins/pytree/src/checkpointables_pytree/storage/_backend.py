"""``cp.storage.Storage`` for ``s3://`` and ``gs://``, through TensorStore's key-value stores.

Used by the core and the plugins for every file but a pytree's arrays (small
files, listing, deleting, the commit marker); the plugin registers it for
``s3`` and ``gs``. Configured as ``_object_store`` describes.
"""

from __future__ import annotations

import threading
from typing import Any

import checkpointables as cp
import tensorstore as ts

from checkpointables_pytree.storage._errors import missing_bucket
from checkpointables_pytree.storage._object_store import (
    S3Settings,
    bucket_and_key,
    context_resources,
    google_credentials_hint,
    kvstore_spec,
    s3_settings,
)
from checkpointables_pytree.storage._options import StorageOptions

__all__ = ["KvStoreStorage", "storage_for"]


_NO_AWS_CREDENTIALS = (
    " (none are configured, so only an EC2 instance's role was tried: set AWS_ACCESS_KEY_ID "
    "and AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass them in cp.options.StorageOptions)"
)


def _what_to_check(url: str, settings: S3Settings) -> str:
    if url.startswith("gs://"):
        return f"the network and the Google credentials{google_credentials_hint()}"
    unconfigured = _NO_AWS_CREDENTIALS if settings.credentials_key == ("imds",) else ""
    return (
        f"the path, the credentials{unconfigured} and the endpoint (cp.options.StorageOptions, "
        f"or the AWS_* environment variables)"
    )


def _answer(future: Any, action: str, url: str, storage: KvStoreStorage) -> Any:
    """The result of TensorStore's ``future`` within the options' timeout, retries included
    (TensorStore alone retries an unreachable host for many minutes); else it is cancelled."""
    timeout = storage.timeout_secs
    try:
        return future.result(timeout=timeout)
    except TimeoutError as e:
        future.cancel()
        raise cp.errors.StorageError(  # From the TimeoutError: see StorageError.
            f"{action} {url} got no answer within {timeout:g} s "
            f"(cp.options.StorageOptions.request_timeout_secs). Check "
            f"{_what_to_check(url, storage.settings)}."
        ) from e
    except Exception as e:
        missing = missing_bucket(action, url, e)  # Named with its endpoint, not the XML answer.
        if missing is not None:
            raise missing from e
        raise cp.errors.StorageError(
            f"{action} {url} failed: {str(e).rstrip('.')}. Check "
            f"{_what_to_check(url, storage.settings)}; "
            f"requests that failed transiently were already retried."
        ) from e


def _prefix_range(key: str) -> tuple[str, ts.KvStore.KeyRange]:
    """The prefix ``key/`` (``""`` for a bucket) and the range of the keys under it."""
    if not key:
        return "", ts.KvStore.KeyRange("", "")
    prefix = f"{key}/"
    return prefix, ts.KvStore.KeyRange(prefix, f"{key}0")  # "0" follows "/".


class KvStoreStorage:
    """``cp.storage.Storage`` for ``s3://`` and ``gs://``: one TensorStore kvstore per bucket.

    Writes are whole objects (one PUT each); there are no directories, so
    ``make_dirs`` does nothing and a "directory" is every key under a prefix.

    Attributes:
      settings: where S3 requests go, and with which credentials.
      timeout_secs: the longest one operation may take, retries included
        (``StorageOptions.request_timeout_secs``).
    """

    atomic_rename = False

    def __init__(self, options: StorageOptions, settings: S3Settings) -> None:
        self.settings = settings
        self.timeout_secs = options.request_timeout_secs
        self._context = ts.Context(context_resources(options))
        self._stores: dict[tuple[str, str], ts.KvStore] = {}
        self._lock = threading.Lock()
        self._buckets_seen: set[int] = set()  # Stores (by id) whose bucket answered a LIST.

    def _store(self, url: str) -> tuple[ts.KvStore, str]:
        scheme, bucket, key = bucket_and_key(url)
        with self._lock:
            store = self._stores.get((scheme, bucket))
            if store is None:
                spec = kvstore_spec(f"{scheme}://{bucket}", self.settings)
                opening = ts.KvStore.open(spec, context=self._context)
                store = _answer(opening, "Opening", f"{scheme}://{bucket}", self)
                self._stores[(scheme, bucket)] = store
        return store, key

    def _list(self, url: str) -> list[str]:
        store, key = self._store(url)
        prefix, keys_under = _prefix_range(key)
        keys = store.list(keys_under, strip_prefix_length=len(prefix))
        return [k.decode() for k in _answer(keys, "Listing", url, self) if k]

    def read_bytes(self, path: str) -> bytes:
        """The contents of an object (one GET)."""
        store, key = self._store(path)
        result = _answer(store.read(key), "Reading", path, self)
        if result.state != "value":
            raise FileNotFoundError(f"No object at {path}.")
        return bytes(result.value)

    def read_bytes_within(self, path: str, max_bytes: int) -> bytes | None:
        """``read_bytes``, or ``None`` for an object of more than ``max_bytes``
        (``cp.storage.BoundedReads``): a ranged GET of the byte at ``max_bytes`` first, so a
        larger object costs one byte, a small one a GET more, a missing one no more.

        TensorStore reads no range past an object's end (OUT_OF_RANGE), so no single GET
        can ask for "at most ``max_bytes`` + 1 bytes". An object replaced by a larger one
        between the two GETs is read whole, then refused by ``cp.storage.read_bytes``.
        """
        store, key = self._store(path)
        probe = store.read(key, byte_range=slice(max_bytes, max_bytes + 1))
        try:
            result = _answer(probe, "Reading", path, self)
        except cp.errors.StorageError as e:
            if not str(e.__cause__).startswith("OUT_OF_RANGE"):
                raise
            return self.read_bytes(path)  # No byte there: it holds at most max_bytes.
        if result.state != "value":
            raise FileNotFoundError(f"No object at {path}.")
        return None

    def write_bytes(self, path: str, data: bytes, durable: bool = False) -> None:
        """Creates or replaces an object (one PUT; durable once it returns)."""
        store, key = self._store(path)
        _answer(store.write(key, data), "Writing", path, self)

    def is_file(self, path: str) -> bool:
        """Whether an object is at ``path`` (one HEAD)."""
        return self.version(path) is not None

    def version(self, path: str) -> bytes | None:
        """The object's ETag (S3) or generation (GCS), from one HEAD; ``None`` if there is
        no object (``cp.storage.Versions``)."""
        store, key = self._store(path)
        if not key:
            return None
        head = _answer(store.read(key, byte_range=slice(0, 0)), "Checking", path, self)
        if head.state == "value":
            return bytes(head.stamp.generation)
        if id(store) not in self._buckets_seen:
            # A missing bucket answers HEAD as a missing object does (no body): a LIST,
            # once per bucket, tells them apart and raises with the bucket's name.
            _answer(store.list(ts.KvStore.KeyRange(key, key + "\0")), "Checking", path, self)
            self._buckets_seen.add(id(store))
        return None

    def exists(self, path: str) -> bool:
        """Whether an object, or any object under the prefix ``path/``, exists."""
        return self.is_file(path) or bool(self._list(path))

    def list_dir(self, path: str) -> list[cp.storage.Entry]:
        """The first components of the keys under ``path/`` (one LIST, paged by 1,000)."""
        children: dict[str, bool] = {}
        for relative in self._list(path):
            name, sep, _ = relative.partition("/")
            children[name] = children.get(name, False) or bool(sep)
        return [cp.storage.Entry(name, is_dir) for name, is_dir in children.items()]

    def list_files(self, path: str) -> list[str]:
        """Every key under ``path/``, relative to it."""
        return self._list(path)

    def remove_file(self, path: str) -> None:
        """Deletes an object (one DELETE); a missing one is fine."""
        store, key = self._store(path)
        _answer(store.write(key, None), "Deleting", path, self)

    def remove_tree(self, path: str) -> None:
        """Deletes every object under ``path/`` (a LIST, then a DELETE each)."""
        store, key = self._store(path)
        _answer(store.delete_range(_prefix_range(key)[1]), "Deleting", path, self)
        if key:
            self.remove_file(path)

    def make_dirs(self, path: str, mode: int | None = None) -> None:
        """Nothing to do: object stores have no directories."""


_storages: dict[tuple[Any, ...], KvStoreStorage] = {}
_storages_lock = threading.Lock()


def storage_for(context: cp.Context) -> cp.storage.Storage:
    """The storage of ``s3://`` and ``gs://`` paths under ``context`` (cached per configuration).

    The environment is part of the configuration: a change of the AWS_*
    variables is seen by the next call.
    """
    options = context.storage_options
    settings = s3_settings(options)
    key = (options, settings.endpoint, settings.region, settings.credentials_key)
    with _storages_lock:
        storage = _storages.get(key)
        if storage is None:
            if len(_storages) >= 16:  # Bounded: configurations come and go in tests.
                _storages.pop(next(iter(_storages)))
            storage = _storages[key] = KvStoreStorage(options, settings)
        return storage
